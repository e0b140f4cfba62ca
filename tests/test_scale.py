"""Multi-node launches and the costs that grow with the world size: torchrun agents as separate nodes (c10d rendezvous
on 127.0.0.1), the shared-file-system check, vLLM tensor parallelism kept inside a node, HSDP across nodes, the fake
engine and timings.jsonl (of a run with token balancing, whose own tests are tests/test_balancing.py)."""

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import check, only_run_dir, read_metrics, run_agents, run_script

from common.llm import checks
from common.llm.engines import nvlinked, tensor_parallel_problem
from common.llm.run import LLMArgs

# The fake engine (no vLLM): lognormal lengths, sleep tau0 x the longest; small enough for 4 ranks on 2 cores
FAKE = ["--rollout-engine", "fake", "--fake-tau0-s", "0.005", "--fake-median-length", "12",
        "--fake-length-sigma", "1.0", "--max-completion-length", "64", "--prompts-per-step", "16",
        "--num-generations", "4", "--micro-batch-size", "8", "--total-steps", "3", "--eval-every", "0",
        "--num-eval-prompts", "16"]


def worker_exit_codes(result: subprocess.CompletedProcess) -> list[int]:
    """The exit codes torchrun's failure table reports for its workers."""
    return [int(code) for code in re.findall(r"^\s*exitcode\s+:\s*(-?\d+)", result.stderr, re.M)]


def test_a_node_that_does_not_share_the_run_root_stops_every_rank_fast(tmp_path: Path):
    """The second agent starts in another directory, so the relative --run-root is another directory on it: both
    ranks stop with the shared-file-system message, exit 2, instead of failing later at a checkpoint or resume."""
    elsewhere = tmp_path / "node1"
    elsewhere.mkdir()
    started = time.time()
    results = run_agents("grpo_llm.py", [*FAKE, "--run-root", "runs_shared_fs_test"], cwds=[tmp_path, elsewhere],
                         timeout=120)
    elapsed = time.time() - started
    for result in results:
        assert result.returncode != 0
        assert "is not one shared file system for all ranks: rank(s) [1] do not see the file" in result.stderr
        assert worker_exit_codes(result) == [2], result.stderr[-2000:]
    assert elapsed < 60, elapsed  # 5 s of looking plus start-up; a hang would run into the 120 s timeout
    assert [p.name for p in (tmp_path / "runs_shared_fs_test").iterdir()] == []  # the token is gone
    assert not (elsewhere / "runs_shared_fs_test").exists()


def test_vllm_tensor_parallel_groups_never_span_nodes(tmp_path: Path):
    """Two single-process agents with --vllm-tp 2 would make one group of the two nodes: refused on both, before any
    engine or process group starts. (One agent with two processes and --vllm-tp 2 runs: test_grpo_llm.py.)"""
    results = run_agents("grpo_llm.py", ["--vllm-tp", "2", "--rollout-engine", "vllm", "--run-root", str(tmp_path)],
                         timeout=120)
    for result in results:
        assert "--vllm-tp 2 would put a tensor-parallel group across nodes: each node runs 1 rank(s)" in result.stderr
        assert result.returncode != 0 and set(worker_exit_codes(result)) <= {2}
    # an agent whose worker exits before the rendezvous settles may leave torchrun's table out
    assert 2 in worker_exit_codes(results[0]) + worker_exit_codes(results[1])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tp, all_nvlinked, refused", [(2, False, False), (4, True, False), (6, True, False),
                                                       (8, True, False), (4, False, True), (8, False, True),
                                                       (3, True, True), (16, True, True)])
def test_deterministic_tensor_parallelism_needs_vllm_s_custom_all_reduce(tp: int, all_nvlinked: bool, refused: bool):
    """vLLM's custom all-reduce (fixed order) runs at 2 GPUs, and at 4, 6 or 8 all linked by NVLink; anything else
    falls back to NCCL, whose pinned settings never reach the engine's communicator after the trainer's."""
    assert (tensor_parallel_problem(tp, all_nvlinked) is not None) == refused


def test_nvlink_is_asked_of_nvml_about_the_physical_devices(monkeypatch):
    """A stand-in NVML on a node whose GPUs 4-7 are linked in pairs (4-5, 6-7) only: the visible ordinals map
    through CUDA_VISIBLE_DEVICES (indices or UUIDs), and one pair without NVLink makes the answer no."""
    class NVMLError(Exception):
        pass

    linked = {frozenset({4, 5}), frozenset({6, 7})}
    uuids = {f"GPU-{index}": index for index in range(8)}
    nvml = SimpleNamespace(NVMLError=NVMLError, NVML_P2P_CAPS_INDEX_NVLINK=4, NVML_P2P_STATUS_OK=0,
                           nvmlInit=lambda: None, nvmlShutdown=lambda: None,
                           nvmlDeviceGetHandleByIndex=lambda index: index,
                           nvmlDeviceGetHandleByUUID=lambda uuid: uuids[uuid],
                           nvmlDeviceGetP2PStatus=lambda a, b, capability: 0 if frozenset({a, b}) in linked else 1)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert nvlinked([0, 1]) and nvlinked([2, 3]) and not nvlinked([0, 1, 2, 3]) and not nvlinked([1, 2])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-6,GPU-7,GPU-4")
    assert nvlinked([0, 1]) and not nvlinked([1, 2])
    assert not nvlinked([0, 5])  # an ordinal past the visible devices: NVML cannot tell


@pytest.mark.parametrize("deterministic, linked, refused", [(True, False, True), (True, True, False),
                                                            (False, False, False)])
def test_the_tensor_parallel_check_asks_nvml_about_this_node_s_groups(deterministic: bool, linked: bool,
                                                                       refused: bool, monkeypatch, capsys):
    """Rank 9 of 16 on two nodes of 8, --vllm-tp 4 on CUDA: NVML is asked about the groups on rank 9's node, as
    devices 0-3 and 4-7; a deterministic run on GPUs without NVLink between them stops before any collective."""
    asked = []
    monkeypatch.setattr(checks.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(checks, "local_world_size", lambda: 8)
    monkeypatch.setattr(checks, "nvlinked", lambda devices: asked.append(devices) or linked)
    monkeypatch.setenv("RANK", "9")
    args = LLMArgs(vllm_tp=4, rollout_engine="vllm", deterministic=deterministic, fsdp_shard_size=8)
    if refused:
        with pytest.raises(SystemExit) as stopped:
            checks.check_llm_args(args, 16)
        assert stopped.value.code == 2
        message = capsys.readouterr().err
        assert "--vllm-tp 4 with --deterministic on CUDA: these GPUs are not all linked by NVLink" in message
    else:
        checks.check_llm_args(args, 16)
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]] if linked else [[0, 1, 2, 3]]  # a first group without NVLink decides
    assert asked == (groups if deterministic else [])


@pytest.fixture(scope="module")
def fake_balanced_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GRPO with the fake engine and token balancing to a token budget, on two nodes of one process."""
    run_root = tmp_path_factory.mktemp("fake_balanced")
    check(run_script("grpo_llm.py", [*FAKE, "--balance-tokens", "--micro-batch-tokens", "300", "--run-root",
                                     str(run_root)], nproc=1, nnodes=2))
    return only_run_dir(run_root)


def test_timings_cover_each_rank_s_step(fake_balanced_run: Path):
    """timings.jsonl: one line per step with every rank's phases; they add up to within 10% of perf/step_s (each is
    its own measured span, so a phase left out shows here), and the counts are the batch's."""
    lines = read_metrics(fake_balanced_run, "timings.jsonl")
    perf = {m["step"]: m for m in read_metrics(fake_balanced_run, "perf.jsonl")}
    assert [line["step"] for line in lines] == [1, 2, 3]
    for line in lines:
        assert len(line["ranks"]) == 2
        for rank in line["ranks"]:
            phases = sum(rank[name] for name in ("generate_s", "score_s", "wait_s", "train_s", "sync_gather_s",
                                                 "sync_reload_s", "reduce_s"))
            assert 0.9 * rank["step_s"] <= phases <= rank["step_s"], rank
            assert 1 <= rank["longest_completion"] <= 64 and rank["tokens"] <= rank["padded_tokens"]
            assert rank["generate_s"] >= 0.005 * rank["longest_completion"]  # the fake engine's sleep
            assert rank["micro_batches"] >= 1 and rank["sync_gather_s"] > 0
        assert line["ranks"][0]["step_s"] == pytest.approx(perf[line["step"]]["perf/step_s"], abs=1e-9)
        assert line["ranks"][0]["micro_batches"] == line["ranks"][1]["micro_batches"]  # the lock step
        tokens = [rank["tokens"] for rank in line["ranks"]]
        assert max(tokens) <= 1.1 * sum(tokens) / 2  # balanced


def test_fake_engine_lengths_follow_their_lognormal(fake_balanced_run: Path):
    """Median 12, sigma 1: about half the completions are longer than 12 tokens, and the longest per rank and step
    reaches far beyond (the tail that the max over ranks feels)."""
    metrics = read_metrics(fake_balanced_run)
    mean_length = sum(m["train/completion_length"] for m in metrics[1:]) / 3
    assert 12 < mean_length < 12 * math.exp(0.5) * 1.3  # lognormal mean exp(mu + sigma^2 / 2), capped at 64
    longest = [rank["longest_completion"] for line in read_metrics(fake_balanced_run, "timings.jsonl")
               for rank in line["ranks"]]
    assert max(longest) > 3 * 12


# PPO with the fake engine: its value model gives every step a real gradient although random tokens score 0
FAKE_PPO = ["--rollout-engine", "fake", "--fake-median-length", "6", "--max-completion-length", "16",
            "--prompts-per-step", "16", "--num-generations", "2", "--total-steps", "2", "--eval-every", "0",
            "--num-eval-prompts", "16"]


@pytest.fixture(scope="module")
def hsdp_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two nodes x two processes: HSDP (the default shard size, the ranks of a node: 2) and the flat mesh."""
    runs = {}
    for name, shard in (("hsdp", "0"), ("flat", "4")):
        run_root = tmp_path_factory.mktemp(name)
        check(run_script("ppo_llm.py", [*FAKE_PPO, "--fsdp-shard-size", shard, "--run-root", str(run_root)], nproc=2,
                         nnodes=2))
        runs[name] = only_run_dir(run_root)
    return runs


def test_hsdp_across_two_nodes_equals_the_flat_mesh(hsdp_runs: dict[str, Path]):
    """Shard within a node, replicate across nodes: the flat mesh's losses and gradient norms up to the order of
    float32 sums (measured: 1e-5 relative on the policy loss, a difference of near-cancelling terms, 1e-6 on the
    norms). Two HSDP runs giving the same bits: tests/test_sharding.py, at the step's level."""
    hsdp, flat = read_metrics(hsdp_runs["hsdp"]), read_metrics(hsdp_runs["flat"])
    for mesh, flat_mesh in zip(hsdp[1:], flat[1:]):
        for key in ("train/loss", "train/value_loss", "train/grad_norm", "train/value_grad_norm"):
            assert mesh[key] == pytest.approx(flat_mesh[key], rel=1e-4), key
        assert mesh["train/grad_norm"] > 0 and mesh["train/value_grad_norm"] > 0
    manifests = {name: json.loads((run / "manifest.json").read_text()) for name, run in hsdp_runs.items()}
    assert manifests["flat"]["args"]["fsdp_shard_size"] == 4 and manifests["hsdp"]["args"]["fsdp_shard_size"] == 0
