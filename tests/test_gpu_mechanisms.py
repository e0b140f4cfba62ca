"""GPU mechanisms reproduced on CPU, where CI can run them.

Sharded loading (common/llm/models.py): only rank 0 reads the checkpoint, the others build the model on the meta device
and receive their shards by broadcast; checked at world size 2 against a plain `from_pretrained`, bit for bit.

vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1, which --deterministic sets on GPUs) registers its own kernels for
aten::mm, addmm, bmm, matmul and linear on compute capability 8.x, for the whole process the trainer shares. Here the
same registrations go to the CPU key, in a child process (the dispatcher is process-wide), with kernels written from
elementwise products and sums so that they call none of the ops they replace."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT


def _overriding_kernels(calls: dict[str, int]) -> torch.library.Library:
    """vLLM's SM 8.x registrations, on the CPU key; `calls` counts each kernel's calls."""
    def mm(a, b):
        calls["mm"] += 1
        return (a.unsqueeze(-1) * b.unsqueeze(0)).sum(-2)

    def addmm(bias, a, b, beta=1, alpha=1):
        return beta * bias + alpha * mm(a, b)

    def bmm(a, b):
        calls["mm"] += 1
        return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)

    def matmul(a, b):  # the shapes the embedded model's forward uses: [..., K] x [K, N] and batched [..., M, K]
        if b.dim() == 2:
            return mm(a.reshape(-1, a.shape[-1]), b).reshape(*a.shape[:-1], b.shape[-1])
        return bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])).reshape(*a.shape[:-1], b.shape[-1])

    def linear(x, weight, bias=None):
        out = mm(x.reshape(-1, x.shape[-1]), weight.t())
        return (out if bias is None else out + bias).reshape(*x.shape[:-1], weight.shape[0])

    library = torch.library.Library("aten", "IMPL")
    for name, kernel in [("mm", mm), ("addmm", addmm), ("bmm", bmm), ("matmul", matmul), ("linear", linear)]:
        library.impl(f"aten::{name}", kernel, "CPU")
    return library


def _grpo_update_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradients of one GRPO loss (grpo_llm.py's, shared-prompt layout) on a fixed rollout."""
    from common.llm.batching import make_batch, token_logprobs
    from grpo_llm import aggregate_loss, grpo_token_loss, truncated_importance_weight

    prompts, completions = [[3, 4, 12]] * 2 + [[5, 12, 6, 7, 13]] * 2, [[9, 10, 1], [11], [9, 1], [10, 11, 12]]
    rollout_logprobs = [[-1.0] * len(c) for c in completions]
    batch = make_batch(prompts, completions, 0, torch.device("cpu"), share_prompts=True,
                       rollout_logprobs=rollout_logprobs)
    model.zero_grad(set_to_none=True)
    logprobs = token_logprobs(model, batch, temperature=0.7)
    advantages = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]], dtype=torch.float64)
    weight = truncated_importance_weight(logprobs.detach(), batch.rollout_logprobs, 2.0)
    per_token = grpo_token_loss(logprobs - logprobs.detach(), weight, logprobs, None, advantages, 0.2,
                                0.28, 0.0)
    aggregate_loss(per_token, batch.mask, "dapo", 4, int(batch.mask.sum()), 4).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def child() -> None:
    """Reference gradients; then the overrides: the crash, the reroute, the gradients again. Prints a JSON report."""
    from test_llm import TINY, _rms_norm_64
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen2 import modeling_qwen2

    from common.llm.kernels import python_kernels, reroute_composite_autograd

    modeling_qwen2.Qwen2RMSNorm.forward = _rms_norm_64  # float64 throughout: the two sides differ by rounding only
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float64)
    reference = _grpo_update_gradients(model)
    calls = {"mm": 0}
    library = _overriding_kernels(calls)  # noqa: F841 (the registrations live as long as the Library)
    try:
        _grpo_update_gradients(model)
        crash = ""
    except NotImplementedError as error:
        crash = str(error).splitlines()[0]
    rerouted = reroute_composite_autograd("cpu")
    calls["mm"] = 0
    gradients = _grpo_update_gradients(model)
    print(json.dumps({
        "crash": crash, "rerouted": rerouted, "python_kernels": python_kernels("cpu"), "override_calls": calls["mm"],
        "rerouted_again": reroute_composite_autograd("cpu"), "same_names": sorted(gradients) == sorted(reference),
        "max_abs_difference": max((gradients[n] - reference[n]).abs().max().item() for n in reference),
        "max_abs_gradient": max(g.abs().max().item() for g in reference.values())}))


def sharded_loading_child(directory: str) -> None:
    """Under torchrun: the policy (float32 masters), a frozen copy in bfloat16, a value model with a fresh head, each
    compared with `from_pretrained` on every rank; then a bfloat16 checkpoint trained one step and exported."""
    import torch.distributed as dist
    from safetensors import safe_open
    from test_llm import TINY
    from transformers import AutoModelForCausalLM

    from common.determinism import parameter_hash
    from common.distributed import init_distributed
    from common.llm.batching import make_batch, token_logprobs
    from common.llm.models import export_pretrained, load_model
    from common.llm.run import LLMArgs
    from ppo_llm import ValueModel

    rank = init_distributed()[0]
    cpu, report = torch.device("cpu"), {}
    plain = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    policy = load_model(str(TINY), LLMArgs(), cpu)
    report["policy"] = parameter_hash(policy) == parameter_hash(plain)
    report["buffers"] = all(torch.equal(buffer, dict(plain.named_buffers())[name])
                            for name, buffer in policy.named_buffers())
    frozen = load_model(str(TINY), LLMArgs(dtype="bfloat16"), cpu, trainable=False)
    report["frozen_dtypes"] = sorted({str(p.dtype) for p in frozen.parameters()})
    report["frozen"] = parameter_hash(frozen) == parameter_hash({n: t.to(torch.bfloat16)
                                                                 for n, t in plain.state_dict().items()})
    torch.manual_seed(5)
    value_model = load_model(str(TINY), LLMArgs(), cpu, model_class=ValueModel)
    torch.manual_seed(5)
    report["value_model"] = parameter_hash(value_model) == parameter_hash(ValueModel.from_pretrained(
        str(TINY), dtype=torch.float32))
    # a checkpoint stored in bfloat16 trains on float32 masters and is exported in bfloat16 again
    stored = Path(directory) / "bf16-adder"
    if rank == 0:
        plain.to(torch.bfloat16).save_pretrained(stored)
    dist.barrier()
    model = load_model(str(stored), LLMArgs(), cpu)
    report["master_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    batch = make_batch([[3, 4, 12]], [[9, 10, 1]], 0, cpu)
    token_logprobs(model, batch, 1.0).sum().backward()
    exported = Path(directory) / "exported"
    exported.mkdir(exist_ok=True)
    full = {name: tensor.full_tensor() for name, tensor in model.state_dict().items()}
    export_pretrained(model, plain_tokenizer(), exported)
    if rank == 0:
        with safe_open(exported / "model.safetensors", "pt") as tensors:
            report["exported_dtypes"] = sorted({str(tensors.get_tensor(k).dtype) for k in tensors.keys()})
            report["exported_values"] = all(torch.equal(tensors.get_tensor(k), full[k].to(torch.bfloat16))
                                            for k in tensors.keys())
        report["exported_config_dtype"] = json.loads((exported / "config.json").read_text())["dtype"]
        print(json.dumps(report))
    dist.destroy_process_group()


def plain_tokenizer() -> object:
    from test_llm import TINY
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY)


def test_sharded_loading_at_world_size_2_equals_from_pretrained(tmp_path):
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             __file__, "load", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["policy"] and report["buffers"] and report["value_model"], report
    assert report["frozen"] and report["frozen_dtypes"] == ["torch.bfloat16"], report
    assert report["master_dtypes"] == ["torch.float32"], report
    assert report["exported_dtypes"] == ["torch.bfloat16"] and report["exported_values"], report
    assert report["exported_config_dtype"] == "bfloat16", report


def test_memory_estimate_is_within_15_percent_of_the_real_step(tmp_path):
    """benchmarks/memory_estimate.py on the embedded model: GRPO's step on fake tensors against the same step on real
    ones (the peak of live tensors), with and without gradient checkpointing (measured: 0.0% both, each building
    load_model's padded SDPA, whose mask is always built; +6.4% and +4.0% with transformers' "sdpa"). Outside the
    step, the weight sync's arithmetic: exactly the live tensors of the real send_weights (split layout, world of
    one) at three bucket sizes, and at 7B, shard size 8, the hand-computed bytes of the last bucket's gather. Run as
    `tools/doctor.py` runs it (`memory_check`: the command, then its verdict read from validation.json), so doctor's
    own test need not run it again."""
    import importlib.util
    import math
    import re

    from tools import doctor

    holds, shown = doctor.memory_check(tmp_path, 600)
    assert holds and re.match(r"CPU step, checkpointing off [+-]\d+\.\d%; CPU step, checkpointing on [+-]\d+\.\d%",
                              shown), (shown, (tmp_path / "memory_estimate.log").read_text()[-3000:])
    validation = json.loads((tmp_path / "validation.json").read_text())
    rows = validation["rows"]
    assert [row["gradient_checkpointing"] for row in rows] == [False, True]
    assert all(abs(row["error"]) <= 0.15 for row in rows), [row["error"] for row in rows]
    # checkpointing keeps less, in the estimate as in the real step
    assert rows[1]["estimate"]["activations"] < rows[0]["estimate"]["activations"] / 2
    assert rows[1]["measured"]["activations"] < rows[0]["measured"]["activations"] / 2
    assert [row["predicted"] for row in validation["sync"]] == [row["measured"] for row in validation["sync"]]
    assert len({row["buckets"] for row in validation["sync"]}) == 3

    spec = importlib.util.spec_from_file_location("memory_estimate", ROOT / "benchmarks" / "memory_estimate.py")
    estimate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(estimate)
    sync = estimate.outside_the_step("qwen2.5-7b", 8)
    embedding, mlp, norm = 152064 * 3584 * 2, 18944 * 3584 * 2, 3584 * 2  # bf16 bytes
    head_bucket = embedding + 3 * norm  # layer 27's two norms, the final norm, the untied head
    assert sync["buckets"] == 44 and sync["bucket_bytes"][0] == embedding and sync["bucket_bytes"][-1] == head_bucket
    assert sync["bucket_bytes"][-2] == 2 * mlp  # layer 27's up_proj and down_proj
    # gathering the head's bucket: its slices (1 / 8), the all-gather's output, the full tensors, the bucket before
    gathering = head_bucket // 8 + 2 * head_bucket + 2 * mlp
    assert sync["split_sync_held"] == sync["colocated_sync_held"] == gathering  # 2,468 MiB
    assert sync["split_sync_held_broadcast_in_flight"] == gathering + sync["bucket_bytes"][-3]  # 2,783 MiB
    assert sync["parameters"] == 7_615_616_512 and sync["trainer_state"] == 12 * 7_615_616_512 / 8
    assert math.isclose(sync["split_sync_held_broadcast_in_flight"] / 2**30, 2.72, abs_tol=0.005)
    assert estimate.nccl_ring_channel_bytes() == {"inside_a_node": 12 * 2**20, "across_nodes": 18_743_296}


def test_training_under_vllm_sm8x_overrides_reroutes_autograd_and_keeps_the_gradients():
    result = subprocess.run([sys.executable, __file__], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    # negative control: the overrides alone crash the first backward, as on an A100
    assert "aten::linear_backward" in report["crash"] or "aten::matmul_backward" in report["crash"], report["crash"]
    assert report["rerouted"] == ["linear", "matmul"] and report["rerouted_again"] == []
    assert report["python_kernels"] == ["aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "aten::mm"]
    # the rerouted forward and backward ran the overriding kernels, and the gradients are the same function's: float64
    # rounding alone separates the two (measured 4e-15 of the largest gradient)
    assert report["override_calls"] > 0 and report["same_names"]
    assert report["max_abs_difference"] <= 1e-10 * report["max_abs_gradient"], report


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    sharded_loading_child(sys.argv[2]) if sys.argv[1:2] == ["load"] else child()


def test_checkpoints_hold_and_restore_the_rank_s_own_cuda_rng_state(monkeypatch):
    """With a mocked torch.cuda on 8 visible devices, a checkpoint holds the current device's state alone, and a
    resume that sees one device (SLURM --gpus-per-task 1) restores it; an old checkpoint with every device's state
    restores the current device's entry."""
    from common.determinism import restore_rng_states, rng_states

    devices = {index: torch.full((4,), index, dtype=torch.uint8) for index in range(8)}
    current, restored = [3], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": devices[current[0]].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append(state.clone()))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [devices[i] for i in range(8)])
    states = rng_states()
    assert torch.equal(states["cuda"], devices[3])  # one tensor, the rank's own device
    current[0] = 0  # the resume sees a single device, index 0
    restore_rng_states(states)
    assert len(restored) == 1 and torch.equal(restored[0], devices[3])
    old = {**states, "cuda": [devices[i] for i in range(8)]}
    current[0] = 5
    restore_rng_states(old)
    assert torch.equal(restored[1], devices[5])


def test_float32_on_a_gpu_is_said_for_models_of_real_size():
    from common.llm.models import float32_warning

    assert "pass --dtype bfloat16" in float32_warning(494_000_000, "cuda", "float32")
    assert float32_warning(494_000_000, "cuda", "bfloat16") is None
    assert float32_warning(494_000_000, "cpu", "float32") is None  # float32 is the CPU's right default
    assert float32_warning(856_576, "cuda", "float32") is None  # the embedded model: nothing to gain


def test_the_engines_nccl_pins_do_not_stay_in_the_trainers_environment(monkeypatch):
    """A mocked engine start that pins NCCL variables as vLLM's batch-invariant mode does (and removes one): after
    it, the trainer's environment is what it was, and the pins are recorded for the manifest."""
    import common.distributed as distributed

    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.delenv("NCCL_PROTO", raising=False)
    monkeypatch.delenv("NCCL_MAX_NCHANNELS", raising=False)
    monkeypatch.setattr(distributed, "_nccl_engine_pins", {})
    before = distributed.nccl_env()

    def engine_start() -> str:
        os.environ.update({"NCCL_PROTO": "Simple", "NCCL_MAX_NCHANNELS": "1", "NCCL_ALGO": "Tree"})
        del os.environ["NCCL_DEBUG"]
        return "engine"

    assert distributed.keeping_trainer_nccl_env(engine_start) == "engine"
    assert distributed.nccl_env() == before
    assert distributed.nccl_record()["engine_pins"] == {"NCCL_PROTO": "Simple", "NCCL_MAX_NCHANNELS": "1",
                                                        "NCCL_ALGO": "Tree", "NCCL_DEBUG": None}


@pytest.mark.parametrize("share_prompts", [False, True])
def test_a_batch_is_built_without_reading_device_tensors(share_prompts: bool):
    """make_batch onto the meta device, where any read of a value (nonzero, int of a sum) raises: every index is
    worked out on the host before the move, so building a micro-batch (PPO: one per minibatch) never makes the host
    wait for a GPU. The same batch on the CPU gives the indices those host copies hold."""
    from common.llm.batching import make_batch

    prompts, completions = [[5, 6, 7], [5, 6, 7], [8, 9]], [[1, 2, 3], [4], [2, 2]]
    arguments = dict(share_prompts=share_prompts, rollout_logprobs=[[-0.5] * 3, [-0.1], [-0.2] * 2],
                     loss_masks=[[1, 0, 1], None, None])
    on_meta = make_batch(prompts, completions, 0, torch.device("meta"), **arguments)
    on_cpu = make_batch(prompts, completions, 0, torch.device("cpu"), **arguments)
    assert on_meta.head_rows.device.type == "meta" and on_meta.head_rows.shape == on_cpu.head_rows.shape
    assert on_cpu.head_rows.numel() == 5 and on_cpu.unpack_index.tolist().count(5) == on_cpu.mask.numel() - 5


def test_the_heads_weight_gradient_in_vocabulary_slices_equals_autograd(monkeypatch):
    """The head's backward accumulates the weight gradient slice by slice of the vocabulary (no [V, H] float32
    temporary per row chunk): in float64, with slices of 7 ids over a vocabulary of 50 and chunks of 3 rows, both
    gradients equal autograd's through a full log_softmax to rounding."""
    from common.llm import batching

    monkeypatch.setattr(batching, "VOCABULARY_SLICE", 7)
    monkeypatch.setattr(batching, "CHUNK_ROWS", 3)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 6, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(50, 6, dtype=torch.float64, generator=generator, requires_grad=True)
    tokens = torch.randint(0, 50, (10,), generator=generator)
    upstream = torch.randn(10, dtype=torch.float64, generator=generator)
    (batching._ChosenTokenLogprob.apply(hidden, weight, tokens, 0.7) * upstream).sum().backward()
    ours = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    reference = torch.log_softmax(hidden @ weight.t() / 0.7, -1).gather(-1, tokens[:, None])[:, 0]
    (reference * upstream).sum().backward()
    assert torch.allclose(ours[0], hidden.grad, rtol=0, atol=1e-12)
    assert torch.allclose(ours[1], weight.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_frozen_heads_backward_skips_its_gradient_and_keeps_the_hidden_states_bits(dtype: torch.dtype, monkeypatch):
    """LoRA holds the LM head frozen: its backward computes no weight gradient (before, a [V, H] float32
    accumulator, its copy in the head's dtype and one GEMM per chunk and vocabulary slice, all dropped by autograd).
    The hidden states' gradient is the trained head's bit for bit (what every default run computes is unchanged),
    the GEMMs are one per chunk instead of one per chunk plus one per chunk and slice."""
    from common.llm import batching

    monkeypatch.setattr(batching, "VOCABULARY_SLICE", 7)
    monkeypatch.setattr(batching, "CHUNK_ROWS", 3)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 6, generator=generator).to(dtype)
    weight = torch.randn(50, 6, generator=generator).to(dtype)
    tokens = torch.randint(0, 50, (10,), generator=generator)
    upstream = torch.randn(10, generator=generator)
    gemms, backward_mm = [], batching._head_backward_mm
    monkeypatch.setattr(batching, "_head_backward_mm",
                        lambda a, b, out: gemms.append(a.shape) or backward_mm(a, b, out))

    def gradients(head_trained: bool) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        leaf, head = hidden.clone().requires_grad_(), weight.clone().requires_grad_(head_trained)
        gemms.clear()
        (batching._ChosenTokenLogprob.apply(leaf, head, tokens, 0.7) * upstream).sum().backward()
        return leaf.grad, head.grad, len(gemms)

    trained_hidden, trained_weight, trained_gemms = gradients(True)
    frozen_hidden, frozen_weight, frozen_gemms = gradients(False)
    assert torch.equal(frozen_hidden, trained_hidden) and trained_hidden.abs().sum() > 0
    assert frozen_weight is None and trained_weight is not None and trained_weight.abs().sum() > 0
    assert (trained_gemms, frozen_gemms) == (4 + 4 * 8, 4)  # 10 rows: 4 chunks of 3; 50 ids: 8 slices of 7


def test_a_frozen_heads_backward_peak_is_lower_by_its_float32_gradient():
    """benchmarks/memory_estimate.py's head_backward_peak (the measurement a GPU check can repeat at real sizes):
    with a bf16 head of 5,000 x 64, the frozen head's backward peaks at least V x H x 4 B lower than the trained
    head's (measured: 1,280,000 B, exactly the float32 accumulator; the chunks' temporaries are the rest)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("memory_estimate", ROOT / "benchmarks" / "memory_estimate.py")
    estimate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(estimate)
    trained = estimate.head_backward_peak(300, 5000, 64, torch.bfloat16, head_trained=True)
    frozen = estimate.head_backward_peak(300, 5000, 64, torch.bfloat16, head_trained=False)
    assert trained - frozen >= 5000 * 64 * 4 and frozen > 3 * 256 * 5000 * 4  # three float32 chunk temporaries


def test_a_frozen_models_forward_order_stays_bounded_over_many_forwards(world_of_one):
    """FSDP2 records every unit's forward for the prefetches of a backward, and only a backward clears the record, so
    a frozen model (a reference, a teacher, a reward model) would grow it by one entry per unit and forward all run
    long. shard_model clears it after every forward of a frozen model: after 20 forwards both lists are empty. The
    same model trained (the control) holds 20 entries per unit until a backward, which clears them."""
    from torch.distributed.fsdp import FSDPModule

    from common.llm.models import forward_order_lengths, load_model
    from common.llm.run import LLMArgs

    path, args, device = str(ROOT / "assets" / "tiny-adder"), LLMArgs(), torch.device("cpu")
    frozen, trained = load_model(path, args, device, trainable=False), load_model(path, args, device)
    units = sum(isinstance(module, FSDPModule) for module in trained.modules())  # 4 blocks and the root
    ids = torch.tensor([[4, 5, 13, 6, 7, 14]])
    with torch.no_grad():
        for _ in range(20):
            frozen(input_ids=ids)
            trained(input_ids=ids)
    assert forward_order_lengths(frozen) == {"post_forward_order": 0, "post_forward_indices": 0}
    assert forward_order_lengths(trained) == {"post_forward_order": 20 * units, "post_forward_indices": 20 * units}
    trained(input_ids=ids).logits.sum().backward()
    assert forward_order_lengths(trained) == {"post_forward_order": 0, "post_forward_indices": 0}
