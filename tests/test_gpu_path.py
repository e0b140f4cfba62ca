"""The GPU path's third read (issue 26), reproduced on CPU where the mechanism allows: the LM head's bf16 backward
GEMMs, HSDP's one all-reduce per optimizer step (counted on a fake process group), the environment set before vLLM
and Triton start, no NaN fill of uninitialised memory, and no host sync inside any script's micro-batch loop. Token
balancing's point-to-point exchange between the pairs that move rows only: tests/test_balancing.py."""

import collections
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT, check, run_script, script_env

from common.determinism import engine_environment
from common.llm import models
from common.llm.batching import _ChosenTokenLogprob
from common.llm.kernels import engine_kernels_without_engine


def _head_gradients(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, grad_out: torch.Tensor,
                    temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    _ChosenTokenLogprob.apply(hidden, weight, tokens, temperature).backward(grad_out)
    return hidden.grad, weight.grad


def _exact_gradients(hidden, weight, tokens, grad_out, temperature):
    hidden, weight = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logprobs = torch.log_softmax(hidden @ weight.t() / temperature, -1).gather(-1, tokens[:, None])[:, 0]
    logprobs.backward(grad_out.double())
    return hidden.grad, weight.grad


def _relative_error(approximate: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approximate.double() - exact).norm() / exact.norm())


def test_bf16_head_backward_stays_within_the_bf16_gradient_it_returns():
    """A bf16 head's backward GEMMs take grad_logits rounded to bf16 (on CUDA: one bf16 tensor-core GEMM with float32
    output). Against float64: the gradients it returns, which are bf16 anyway, carry at most twice the error of the
    float32 GEMMs' (measured: 2.3e-3 against 1.7e-3 relative, for both), and a float32 head keeps float32's."""
    generator = torch.Generator().manual_seed(0)
    rows, hidden_size, vocabulary, temperature = 300, 64, 500, 0.7  # two chunks of CHUNK_ROWS
    hidden = torch.randn(rows, hidden_size, generator=generator)
    weight = torch.randn(vocabulary, hidden_size, generator=generator) * 0.3
    tokens = torch.randint(vocabulary, (rows,), generator=generator)
    grad_out = torch.randn(rows, generator=generator)
    exact_hidden, exact_weight = _exact_gradients(hidden.bfloat16(), weight.bfloat16(), tokens, grad_out, temperature)
    bf16_hidden, bf16_weight = _head_gradients(hidden.bfloat16(), weight.bfloat16(), tokens, grad_out, temperature)
    assert bf16_hidden.dtype == bf16_weight.dtype == torch.bfloat16
    # the float32 GEMMs of before, on the same bf16 inputs: the float32 head's path, rounded to bf16 at the end
    f32_hidden, f32_weight = _head_gradients(hidden.bfloat16().float(), weight.bfloat16().float(), tokens, grad_out,
                                             temperature)
    for new, old, exact in ((bf16_hidden, f32_hidden.bfloat16(), exact_hidden),
                            (bf16_weight, f32_weight.bfloat16(), exact_weight)):
        assert _relative_error(new, exact) <= 2 * _relative_error(old, exact)
        assert _relative_error(new, exact) < 1e-2
        assert not torch.equal(new, old)  # the bf16 route really ran
    # float32 head: the float32 GEMMs, within float32 rounding of float64
    assert _relative_error(f32_hidden, exact_hidden) < 1e-5 and _relative_error(f32_weight, exact_weight) < 1e-5


@pytest.mark.parametrize("fake_world", [(4, 0)], indirect=True)
def test_hsdp_all_reduces_across_nodes_once_per_optimizer_step(fake_world, monkeypatch):
    """2 nodes x 2 ranks (HSDP), three micro-batches: FSDP2's default all-reduces every unit's gradient shards after
    each backward (3 x units), all_reduce_at_last only after the last (1 x units)."""
    model = models.load_model(str(ROOT / "assets" / "tiny-adder"), SimpleNamespace(
        dtype="float32", gradient_checkpointing=False, reshard_after_forward=False, fsdp_shard_size=2),
        torch.device("cpu"))
    assert next(model.parameters()).device_mesh.shape == (2, 2)
    all_reduces = collections.Counter()
    real_all_reduce = dist.all_reduce

    replicas = next(model.parameters()).device_mesh.get_group("replicate")

    def counting_all_reduce(tensor, *args, group=None, **kwargs):
        all_reduces["across nodes" if group is replicas else "elsewhere"] += 1
        return real_all_reduce(tensor, *args, group=group, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counting_all_reduce)
    units = sum(isinstance(module, torch.distributed.fsdp.FSDPModule) for module in model.modules())
    input_ids = torch.randint(3, 15, (2, 6))
    counts = {}
    for with_fix in (False, True):
        all_reduces.clear()
        for micro_batch in range(3):
            if with_fix:
                models.all_reduce_at_last(micro_batch == 2, model)
            model(input_ids=input_ids).logits.sum().backward()
        counts[with_fix] = dict(all_reduces)
        model.zero_grad(set_to_none=True)
    assert counts == {False: {"across nodes": 3 * units}, True: {"across nodes": units}}


def test_environment_before_the_engine_starts(monkeypatch):
    """On CUDA: batch-invariant vLLM, vLLM's groups by split_group, Triton's float32 dots in IEEE; the determinism
    variables only when deterministic; on CPU no split_group (vLLM refuses it without a device-bound group)."""
    cuda = engine_environment(deterministic=True, cuda=True)
    assert cuda["VLLM_BATCH_INVARIANT"] == "1" and cuda["VLLM_DISTRIBUTED_USE_SPLIT_GROUP"] == "1"
    assert cuda["TRITON_F32_DEFAULT"] == "ieee" and cuda["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert engine_environment(deterministic=False, cuda=True) == {"VLLM_DISTRIBUTED_USE_SPLIT_GROUP": "1"}
    split = engine_environment(deterministic=True, cuda=True, colocated=False)  # the rollout side's own group
    assert "VLLM_DISTRIBUTED_USE_SPLIT_GROUP" not in split and split["VLLM_BATCH_INVARIANT"] == "1"
    cpu = engine_environment(deterministic=True, cuda=False)
    assert "VLLM_DISTRIBUTED_USE_SPLIT_GROUP" not in cpu and "VLLM_BATCH_INVARIANT" not in cpu
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")  # split trainers take vLLM's kernels for vLLM rollouts only
    assert not engine_kernels_without_engine("cuda", "hf") and not engine_kernels_without_engine("cpu", "vllm")


def test_triton_and_vllm_read_the_environment_and_empty_memory_is_not_filled():
    """In a fresh process: after seed_everything, Triton's default float32 dot precision is IEEE (deterministic) or
    Triton's own (not); vLLM reads the split-group switch; torch.empty is not NaN-filled, while torch's default fill,
    switched back on, is (the mechanism it turns off)."""
    probe = """
import json, os, sys
import torch
from common.determinism import seed_everything
deterministic = sys.argv[1] == "1"
os.environ["VLLM_DISTRIBUTED_USE_SPLIT_GROUP"] = "1"  # as seed_everything sets it on CUDA
settings = seed_everything(1, deterministic)
import triton
import vllm.envs
found = {"fp32_default": triton.knobs.language.fp32_default, "split_group": vllm.envs.VLLM_DISTRIBUTED_USE_SPLIT_GROUP,
         "fill": torch.utils.deterministic.fill_uninitialized_memory, "recorded": settings.get("TRITON_F32_DEFAULT")}
torch.utils.deterministic.fill_uninitialized_memory = True
found["filled_when_on"] = bool(torch.empty(64).isnan().all()) if deterministic else None
print(json.dumps(found))
"""
    results = {}
    for deterministic in ("1", "0"):
        result = subprocess.run([sys.executable, "-c", probe, deterministic], cwd=ROOT, capture_output=True,
                                text=True, timeout=120, env=script_env())
        check(result)
        results[deterministic] = json.loads(result.stdout.strip().splitlines()[-1])
    assert results["1"] == {"fp32_default": "ieee", "split_group": True, "fill": False, "recorded": "ieee",
                            "filled_when_on": True}
    assert results["0"]["fp32_default"] is None and results["0"]["fill"] is False


def test_the_watcher_sees_a_host_sync_between_two_backwards():
    """The negative control of the next test: the pattern fixed in GRPO (indexing with a Python list between two
    backwards) and a .item() are recorded; the same calls after the last backward of a step are not."""
    from workers.host_sync_worker import HostSyncWatch

    monitor, weight = HostSyncWatch(), torch.ones(3, requires_grad=True)
    advantages = torch.arange(6.0)
    with monitor:
        for micro_batch in range(2):
            monitor.backward_called()
            (weight * advantages[[micro_batch, micro_batch + 1], None]).sum().backward()
        weight.grad.norm().item()  # after the last backward: the clip's read
        monitor.step_ended()
    assert sum(count for call, count in monitor.found.items() if call.startswith("index with a list")) == 1
    assert not any(call.startswith("item") for call in monitor.found)


@pytest.mark.parametrize("script,extra", [
    ("grpo_llm.py", ["--num-minibatches", "2", "--num-iterations", "2"]),
    ("ppo_llm.py", ["--num-minibatches", "2"]),
    ("dpo_online.py", []),
])
def test_no_host_sync_inside_a_micro_batch_loop(tmp_path: Path, script: str, extra: list[str]):
    """One step of each LLM script with several micro-batches per optimizer step: between two backwards of one
    step, nothing reads a tensor on the host, builds one from host data, or indexes with a Python list."""
    output = tmp_path / "found.json"
    check(run_script("tests/workers/host_sync_worker.py", [script, str(output), "--total-steps", "1",
                                                            "--prompts-per-step", "8", "--num-generations", "4",
                                                            "--micro-batch-size", "4", "--num-eval-prompts", "8",
                                                            "--eval-every", "0", "--run-root",
                                                            str(tmp_path / "runs"), *extra]))
    watched = json.loads(output.read_text())
    assert watched["backwards"] >= 4 and watched["found"] == {}


def test_a_resume_state_rank_0_cannot_read_stops_every_rank_with_a_message(grpo_reference_run: Path, tmp_path: Path,
                                                                            world_of_one, capsys):
    """Rank 0 alone reads trainer_state.pt and sends its verdict: a file without the fields a resume needs ends in
    that verdict (exit 2, the file named, the previous checkpoint offered), not in an exception on rank 0 that would
    leave the other ranks waiting for its broadcast."""
    import shutil

    from common.llm.checkpoint import read_training_state
    from common.llm.run import MAY_CHANGE_ON_RESUME, LLMArgs

    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(grpo_reference_run / "checkpoints", checkpoints)
    damaged = checkpoints / "step_00000004"
    torch.save({"step": 4, "world_size": 1}, damaged / "trainer_state.pt")  # no arguments, no RNG states
    with pytest.raises(SystemExit) as stopped:
        read_training_state(LLMArgs(resume=str(damaged), total_steps=8), 1, MAY_CHANGE_ON_RESUME)
    assert stopped.value.code == 2
    message = capsys.readouterr().err
    assert f"cannot resume from {damaged}" in message and "KeyError" in message
    assert f"--resume {checkpoints / 'step_00000002'}" in message
