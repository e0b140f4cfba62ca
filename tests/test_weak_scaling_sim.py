"""benchmarks/weak_scaling_sim.py: the weak-scaling model's limits, its Monte Carlo tail, its collectives and fixes,
and the timings mode's prediction against hand arithmetic."""

import importlib.util
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
SPEC = importlib.util.spec_from_file_location("weak_scaling_sim", ROOT / "benchmarks" / "weak_scaling_sim.py")
sim = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = sim  # dataclasses look their module up by name
SPEC.loader.exec_module(sim)

H200 = sim.load_constants(ROOT / "benchmarks" / "scaling_constants" / "h200.json")


def test_constant_lengths_and_free_communication_give_efficiency_one() -> None:
    """Every completion the same length, collectives without latency or bandwidth cost: nothing grows with N, so
    every configuration keeps T(N) = T(1), from 1 and from 8."""
    free = {**H200, "nvlink_latency": 0.0, "ib_latency": 0.0, "collective_base_latency": 0.0,
            "nvlink_bandwidth": math.inf, "ib_bandwidth": math.inf}
    constant = replace(sim.WORKLOADS["short"], sigma=0.0)
    results = sim.simulate(free, constant, world_sizes=(1, 8, 64, 1024), steps=2)
    for per_size in results.values():
        for base in (1, 8):
            assert all(value == pytest.approx(1.0, rel=1e-12) for value in sim.efficiency(per_size, base).values())


@pytest.mark.parametrize("sigma, n", [(0.7, 8), (0.7, 64), (0.7, 1024), (0.8, 64), (0.8, 1024)])
def test_monte_carlo_longest_matches_the_analytic_quantile(sigma: float, n: int) -> None:
    """The simulator's draws: the mean of the longest of n completions is within 3% of Hazen's quantile."""
    workload = sim.Workload("uncapped", 600, sigma, cap=10**9, prompts=n, generations=1)
    lengths = sim.draw_lengths(workload, ranks=1, steps=2_000_000 // n, rng=np.random.default_rng(1))
    monte_carlo = lengths.max(axis=-1).mean()
    assert monte_carlo == pytest.approx(sim.expected_longest(600, sigma, n), rel=0.03)


def test_the_tail_grows_with_the_number_of_ranks() -> None:
    """The step waits for the longest completion on the slowest rank: more ranks, longer wait (the design as built)."""
    results = sim.simulate(H200, sim.WORKLOADS["long_tail"], world_sizes=(1, 8, 64), steps=8)["today"]
    assert results[1]["longest"] < results[8]["longest"] < results[64]["longest"] <= 16384
    assert results[1]["generation"] < results[8]["generation"] < results[64]["generation"]


def test_flat_mesh_all_gathers_grow_with_n_and_hsdp_ones_do_not() -> None:
    per_micro_batch = {fixes: [sim.fsdp_comm_s(sim.QWEN25_7B, H200, n, frozenset(fixes), 0)[0]
                               for n in (8, 16, 64, 256, 1024)] for fixes in ((), ("hsdp",))}
    flat, hsdp = per_micro_batch[()], per_micro_batch[("hsdp",)]
    assert all(smaller < larger for smaller, larger in zip(flat, flat[1:]))
    assert flat[-1] > 3 * flat[0]  # past the node the bytes cross InfiniBand and the hops pile up
    assert hsdp == pytest.approx([hsdp[0]] * len(hsdp))
    assert sim.fsdp_comm_s(sim.QWEN25_7B, H200, 8, frozenset({"hsdp"}), 0)[1] == 0.0  # one node: no replicas
    assert sim.fsdp_comm_s(sim.QWEN25_7B, H200, 1024, frozenset({"hsdp"}), 0)[1] > 0.0


def test_hsdp_all_reduces_once_per_optimizer_step() -> None:
    """--num-minibatches 4 --num-iterations 2 at N = 16 (two nodes, HSDP): 8 optimizer steps a training step, so 8
    all-reduces of the gradient shards across the nodes (pricing them once per training step would charge 1). With
    training compute free each micro-batch costs its collectives: 64 rows a rank, 4 minibatches of 16, 8 micro-batches
    of 8 rows, the first pass with pi_old's forward-only pass, the second without; and 7 more gradient norms."""
    free_compute = {**H200, "train_efficiency": math.inf}
    fixes = frozenset({"hsdp", "fewer_collectives"})
    lengths = sim.draw_lengths(sim.WORKLOADS["short"], ranks=16, steps=2, rng=np.random.default_rng(0))
    first_pass = sim.fsdp_comm_s(sim.QWEN25_7B, free_compute, 16, fixes, 1)[0]
    again, all_reduce = sim.fsdp_comm_s(sim.QWEN25_7B, free_compute, 16, fixes, 0)
    assert all_reduce > 0 and sim.fsdp_comm_s(sim.QWEN25_7B, free_compute, 8, fixes, 0)[1] == 0.0  # one node: none

    def training(workload: sim.Workload) -> np.ndarray:
        micro_batches = sim.padded_micro_batches(lengths, workload)
        assert [len(batch) for batch in micro_batches] == [8, 8]
        return sim.training_s(micro_batches, workload, sim.QWEN25_7B, free_compute, 16, fixes)

    one_update = sim.WORKLOADS["short"]
    eight_updates = replace(one_update, num_minibatches=4, num_iterations=2)
    assert eight_updates.optimizer_steps == 8 and eight_updates.no_grad_passes == 1
    np.testing.assert_allclose(training(one_update), 8 * again + all_reduce, rtol=1e-12)
    np.testing.assert_allclose(training(eight_updates), 8 * (first_pass + again) + 8 * all_reduce, rtol=1e-12)
    np.testing.assert_allclose(training(replace(one_update, num_minibatches=4)), 8 * first_pass + 4 * all_reduce,
                               rtol=1e-12)
    nodes = sim.nodes_spanned(H200, 16)
    assert sim.bookkeeping_s(16, H200, fixes, 8) == pytest.approx(sim.collective_s(0.0, 16, nodes, H200, 3 + 7))


def test_micro_batches_are_cut_within_each_minibatch() -> None:
    """8 completions of lengths 1..8 after 10-token prompts, micro-batches of 8 rows: one micro-batch padded to 18
    tokens a row; with 2 minibatches of 4 rows, two micro-batches padded to 14 and 18. k must divide the prompts."""
    workload = sim.Workload("cut", 1, 0.0, 100, prompts=2, generations=4, prompt_tokens=10)
    lengths = np.arange(1.0, 9.0).reshape(1, 1, 8)
    np.testing.assert_array_equal(sim.padded_micro_batches(lengths, workload)[0], [8 * 18])
    np.testing.assert_array_equal(sim.padded_micro_batches(lengths, replace(workload, num_minibatches=2))[0],
                                  [4 * 14, 4 * 18])
    with pytest.raises(ValueError, match="must divide"):
        replace(workload, num_minibatches=3)


def test_bucketed_sync_does_not_depend_on_the_tensor_count() -> None:
    many_tensors = replace(sim.QWEN25_7B, state_tensors=10 * sim.QWEN25_7B.state_tensors)
    for ranks in (16, 1024):
        bucketed = frozenset({"bucketed_sync"})
        assert sim.weight_sync_s(many_tensors, H200, ranks, bucketed) == sim.weight_sync_s(
            sim.QWEN25_7B, H200, ranks, bucketed)
        today = frozenset()
        assert sim.weight_sync_s(many_tensors, H200, ranks, today)[0] > sim.weight_sync_s(
            sim.QWEN25_7B, H200, ranks, today)[0]
    assert sim.weight_sync_s(sim.QWEN25_7B, H200, 1, frozenset())[0] == 0.0


def test_balancing_evens_the_ranks_and_keeps_every_token() -> None:
    workload = sim.WORKLOADS["short"]
    lengths = sim.draw_lengths(workload, ranks=64, steps=4, rng=np.random.default_rng(0))
    loads = sim.balanced_rank_tokens(lengths, workload.prompt_tokens, int(H200["gpus_per_node"]))
    np.testing.assert_allclose(loads.sum(axis=1), (lengths + workload.prompt_tokens).sum(axis=(1, 2)))
    assert (loads.max(axis=1) / loads.mean(axis=1)).max() < 1.10
    own = (lengths + workload.prompt_tokens).sum(axis=2)  # without balancing: each rank its own completions
    assert (own.max(axis=1) / own.mean(axis=1)).min() > (loads.max(axis=1) / loads.mean(axis=1)).max()
    padded = sum(batch.sum() for batch in sim.padded_micro_batches(lengths, workload))
    packed = sum(batch.sum() for batch in sim.packed_micro_batches(lengths, workload, int(H200["gpus_per_node"])))
    assert padded > 1.5 * packed  # padding to the longest row of 8, and the slowest rank per micro-batch


def test_generation_is_the_decode_arithmetic() -> None:
    """Memory-bound without a KV cache: tau0 x longest; compute-bound (free HBM): 2 P_m x all tokens / F."""
    workload = sim.Workload("two", 1, 0.0, 100, prompts=1, generations=3, prompt_tokens=10)
    lengths = np.array([[[5.0, 40.0, 20.0]]])
    no_cache = replace(sim.QWEN25_7B, kv_heads=0)
    tau0 = 2 * no_cache.matmul_parameters / H200["hbm_bandwidth"]
    prefill = 2 * no_cache.matmul_parameters * 10 / H200["matmul_flops"]
    assert sim.generation_s(lengths, workload, no_cache, H200)[0, 0] == pytest.approx(prefill + 40 * tau0)
    free_memory = {**H200, "hbm_bandwidth": math.inf}
    compute_bound = 2 * no_cache.matmul_parameters * (10 + 65) / H200["matmul_flops"]
    assert sim.generation_s(lengths, workload, sim.QWEN25_7B, free_memory)[0, 0] == pytest.approx(compute_bound)


CPU_CONSTANTS = {"decode_step_s": 0.01, "train_s_per_padded_token": 1e-3, "train_s_per_micro_batch": 0.1,
                 "sync_s": 0.5, "step_overhead_s": 0.2, "cores": 2}


def timings_record(step: int, longest: list[int]) -> dict:
    padded, micro_batches = [1000, 800, 1200, 900], [2, 2, 3, 2]
    return {"step": step, "ranks": [
        {"generate_s": 0.01 * length, "longest_completion": length, "completions": 8, "tokens": tokens - 100,
         "padded_tokens": tokens, "micro_batches": count, "train_s": 1.0, "wait_s": 0.1, "sync_gather_s": 0.3,
         "sync_reload_s": 0.2, "score_s": 0.05, "reduce_s": 0.05, "step_s": 7.0}
        for length, tokens, count in zip(longest, padded, micro_batches)]}


def test_timings_prediction_is_the_hand_computed_one() -> None:
    """4 ranks on 2 cores share them (x 2): generation 0.01 x 250 = 2.5 s; training 2 x max(1.0 + 0.2, 0.8 + 0.2,
    1.2 + 0.3, 0.9 + 0.2) = 3.0 s; sync 2 x 0.5; overhead 2 x 0.2: 6.9 s. The second step's longest, 300: 7.4 s.
    On 2 machines (2 ranks a machine, no sharing): 2.5 + 1.5 + 0.5 + 0.2 = 4.7 s."""
    records = [timings_record(2, [100, 250, 80, 120]), timings_record(3, [300, 250, 80, 120])]
    assert sim.predict_record(records[0], CPU_CONSTANTS)["step"] == pytest.approx(6.9)
    assert sim.predict_mean_step_s(records, CPU_CONSTANTS) == pytest.approx((6.9 + 7.4) / 2)
    assert sim.predict_mean_step_s(records[:1], CPU_CONSTANTS, machines=2) == pytest.approx(4.7)


def test_timings_command_reads_a_run_and_refuses_unsourced_constants(tmp_path: Path) -> None:
    """The CLI skips the first (warm-up) step, prints predicted against measured; a constant without a source fails."""
    timings = tmp_path / "timings.jsonl"
    records = [timings_record(1, [999, 999, 999, 999]), timings_record(2, [100, 250, 80, 120])]
    timings.write_text("".join(json.dumps(record) + "\n" for record in records))
    constants = tmp_path / "cpu.json"
    constants.write_text(json.dumps({name: {"value": value, "source": "hand-set for this test"}
                                     for name, value in CPU_CONSTANTS.items()}))
    command = [sys.executable, str(ROOT / "benchmarks" / "weak_scaling_sim.py"), "--timings", str(timings),
               "--constants", str(constants)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    assert "1 steps, 4 ranks" in result.stdout
    assert "| step | 6.9000 | 7.0000 | 0.986 |" in result.stdout
    constants.write_text(json.dumps({**json.loads(constants.read_text()), "cores": {"value": 2}}))
    with pytest.raises(ValueError, match="cores"):
        sim.load_constants(constants)


# ---------------------------------------------------------------- split layout (--one-step-off)
H100 = sim.load_constants(ROOT / "benchmarks" / "scaling_constants" / "h100.json")
FREE_COMMUNICATION = {"nvlink_latency": 0.0, "ib_latency": 0.0, "collective_base_latency": 0.0,
                      "nvlink_bandwidth": math.inf, "ib_bandwidth": math.inf}


def test_engines_are_dealt_whole_prompts_and_empty_slots_cost_nothing() -> None:
    """8 prompts of 2 completions on 3 engines: round robin, 3 + 3 + 2 prompts; every completion lands once. Engine 0
    prefills its 3 prompts (not a rank's 2), and the engine dealt one prompt fewer generates as if its empty slots
    were not there (no decode, no prefill)."""
    workload = sim.Workload("deal", 1, 0.0, 100, prompts=2, generations=2)
    lengths = np.arange(1.0, 17.0).reshape(1, 4, 4)  # prompt p holds completions 2p + 1 and 2p + 2
    engines = sim.rollout_engine_lengths(lengths, workload, 3)
    assert engines.shape == (1, 3, 6)
    np.testing.assert_array_equal(engines[0, 2], [5, 6, 11, 12, 0, 0])  # prompts 2 and 5
    assert sorted(engines[engines > 0]) == list(range(1, 17))
    free_memory = {**H100, "hbm_bandwidth": math.inf}  # compute-bound: 2 P_m x (prompt + completion tokens) / F
    compute_bound = 2 * sim.QWEN25_7B.matmul_parameters * (3 * 200 + 1 + 2 + 7 + 8 + 13 + 14) / H100["matmul_flops"]
    assert sim.generation_s(engines, workload, sim.QWEN25_7B, free_memory)[0, 0] == pytest.approx(compute_bound)
    np.testing.assert_allclose(sim.generation_s(engines[:, 2:], workload, sim.QWEN25_7B, H100),
                               sim.generation_s(engines[:, 2:, :4], workload, sim.QWEN25_7B, H100), rtol=1e-12)


def test_kv_peak_is_the_fullest_moment_of_the_decode() -> None:
    """Lengths 40, 20, 5 after 10-token prompts: 1 x 50, 2 x 30 or 3 x 15 tokens cached; the peak is 60 tokens.
    The 7 empty slots hold nothing (counted as live, 10 x 10 prompt tokens would be the peak)."""
    workload = sim.Workload("kv", 1, 0.0, 100, prompts=1, generations=10, prompt_tokens=10)
    per_token = sim.kv_bytes_per_token(sim.QWEN25_7B)
    peak = sim.kv_peak_bytes(np.array([[[5.0, 40.0, 20.0, *[0.0] * 7]]]), workload, sim.QWEN25_7B)
    assert peak[0, 0] == 60 * per_token


def test_weight_broadcast_is_bucket_latencies_plus_one_pass_of_the_bytes() -> None:
    """N = 16, K = 8: one trainer and one node of engines, 9 GPUs on 2 nodes: 7 NVLink hops and 1 InfiniBand hop
    per bucket, the bytes once through InfiniBand; inside one node NVLink only."""
    weight_bytes = 2 * sim.QWEN25_7B.parameters
    buckets = math.ceil(weight_bytes / sim.SYNC_BUCKET_BYTES)
    latency = H100["collective_base_latency"] + 7 * H100["nvlink_latency"] + H100["ib_latency"]
    assert sim.weight_broadcast_s(sim.QWEN25_7B, H100, 16, 8) == pytest.approx(
        buckets * latency + weight_bytes / H100["ib_bandwidth"])
    inside = H100["collective_base_latency"] + 2 * H100["nvlink_latency"]
    assert sim.weight_broadcast_s(sim.QWEN25_7B, H100, 8, 2) == pytest.approx(
        buckets * inside + weight_bytes / H100["nvlink_bandwidth"])


def test_synchronous_split_step_is_the_hand_computed_one() -> None:
    """N = 4, K = 1, free communication, every completion 100 tokens: the engine decodes all 4 ranks' 8 prompts x 3
    completions at once (N / K = 4 times a rank's), memory-bound; the 3 trainers train 24 rows of 110 tokens, 880
    tokens each (N / (N - K) = 4 / 3 times a rank's 660), in micro-batches of the 2 x 110 budget; then the reload."""
    workload = sim.Workload("tiny", 100, 0.0, 100, prompts=2, generations=3, prompt_tokens=10, micro_batch_rows=2)
    free = {**H100, **FREE_COMMUNICATION}
    phases = sim.split_phases(np.full((1, 4, 6), 100.0), workload, sim.QWEN25_7B, free, rollout_ranks=1)
    matmul, hbm, flops = sim.QWEN25_7B.matmul_parameters, H100["hbm_bandwidth"], H100["matmul_flops"]
    prefill = 2 * matmul * 8 * 10 / flops
    decode = 100 * max(2 * matmul / hbm, 24 * 2 * matmul / flops)
    kv_read = 24 * (10 * 100 + 100 * 101 / 2) * sim.kv_bytes_per_token(sim.QWEN25_7B) / hbm
    training = 880 * 6 * matmul / (flops * H100["train_efficiency"])
    reload = 2 * 2 * sim.QWEN25_7B.parameters / hbm
    assert sim.split_step_s(phases, 0)[0] == pytest.approx(prefill + decode + kv_read + training + reload, rel=1e-12)


def test_one_step_off_halves_the_step_when_generation_and_training_take_as_long() -> None:
    """Free communication and HBM (no reload), constant lengths, the training rate set so that training takes what
    generation does: S=1 overlaps the two and takes half of S=0."""
    free = {**H100, **FREE_COMMUNICATION, "hbm_bandwidth": math.inf}
    constant = replace(sim.WORKLOADS["short"], sigma=0.0)
    lengths = sim.draw_lengths(constant, ranks=4, steps=3, rng=np.random.default_rng(0))
    phases = sim.split_phases(lengths, constant, sim.QWEN25_7B, free, rollout_ranks=2)
    rate = free["train_efficiency"] * phases["training"][0] / phases["generation"][0]
    phases = sim.split_phases(lengths, constant, sim.QWEN25_7B, {**free, "train_efficiency": rate}, rollout_ranks=2)
    np.testing.assert_allclose(phases["training"], phases["generation"], rtol=1e-12)
    np.testing.assert_allclose(sim.split_step_s(phases, 1), sim.split_step_s(phases, 0) / 2, rtol=1e-12)


def test_without_training_compute_one_step_off_is_generation_plus_what_never_overlaps() -> None:
    """Training's compute free (FSDP's collectives stay, well under generation): S=1 is the generation, then the
    samples' transfer and the weights' gather, broadcast (over InfiniBand at N = 16) and reload, all nonzero."""
    workload = sim.WORKLOADS["short"]
    lengths = sim.draw_lengths(workload, ranks=16, steps=4, rng=np.random.default_rng(0))
    phases = sim.split_phases(lengths, workload, sim.QWEN25_7B, {**H100, "train_efficiency": math.inf}, 8)
    assert (phases["training"] + phases["bookkeeping"]).max() < phases["generation"].min()
    never_overlapped = [phases[phase].mean() for phase in ("transfer", "sync_gather", "sync_broadcast", "sync_reload")]
    assert min(never_overlapped) > 0
    assert sim.split_step_s(phases, 1).mean() == pytest.approx(phases["generation"].mean() + sum(never_overlapped))


def test_one_step_off_is_never_slower_than_synchronous_at_the_same_k() -> None:
    """On the mean over steps: max(generation, training) never exceeds their sum, whatever K."""
    workload = sim.WORKLOADS["long_tail"]
    for ranks in (2, 8, 32):
        lengths = sim.draw_lengths(workload, ranks, steps=4, rng=np.random.default_rng([1, ranks]))
        for rollout_ranks in sim.rollout_rank_choices(ranks, H100):
            phases = sim.split_phases(lengths, workload, sim.QWEN25_7B, H100, rollout_ranks)
            assert sim.split_step_s(phases, 1).mean() < sim.split_step_s(phases, 0).mean()


def test_best_k_is_never_worse_than_the_fraction_and_n1_is_colocated() -> None:
    """The search tries whole nodes from 2 nodes on (its K a multiple of 8), any K inside one; it never loses to
    K = 0.25 N, and beats it somewhere; N = 1 is colocated all fixes' row."""
    results = sim.simulate_split(H100, sim.WORKLOADS["short"], world_sizes=(1, 4, 8, 16, 32), steps=4)
    assert sim.rollout_rank_choices(32, H100) == [8, 16, 24] and sim.rollout_rank_choices(8, H100) == list(range(1, 8))
    improved = False
    for staleness in sim.STALENESS:
        fixed, best = results[sim.split_config(staleness, 0.25)], results[sim.split_config(staleness, None)]
        assert [fixed[n]["rollout_ranks"] for n in fixed] == [0, 1, 2, 8, 8]  # 16: whole nodes, 8 nearest 4
        assert all(best[n]["step"] <= fixed[n]["step"] for n in fixed)
        improved |= any(best[n]["step"] < fixed[n]["step"] for n in fixed)
        assert best[1]["step"] == results["all fixes"][1]["step"]
        assert all(best[n]["rollout_ranks"] % 8 == 0 for n in (16, 32))
    assert improved


def test_one_step_off_command_writes_its_page(tmp_path: Path) -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "weak_scaling_sim.py"), "--one-step-off", "--constants",
               str(ROOT / "benchmarks" / "scaling_constants" / "h100.json"), "--workloads", "short", "--world-sizes",
               "1", "8", "16", "--steps", "2", "--out", str(tmp_path)]
    subprocess.run(command, capture_output=True, text=True, check=True)
    page = (tmp_path / "one_step_off.md").read_text()
    assert "model prediction, not a measurement" in page and "--one-step-off" in page
    assert "| split S=1, best K | 1.00 |" in page and "| matmul_flops | 7.9e+14 |" in page
