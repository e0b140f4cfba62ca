"""benchmarks/first_gpu_check.py as the lent GPU machine runs it: torch and transformers, no tyro, no vLLM, none of
our other requirements. Here on the CPU with those made unimportable (a sitecustomize that every process of the run
loads), every torch-level part must run to its end and write its JSON; and a part that fails or hangs must not take
the others with it."""

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

from conftest import ROOT, script_env

SPEC = importlib.util.spec_from_file_location("first_gpu_check", ROOT / "benchmarks" / "first_gpu_check.py")
gpu_check = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(gpu_check)

# Our requirements that the lent machine lacks (it has torch, transformers and their dependencies)
MISSING_THERE = ("tyro", "vllm", "tensorboard", "datasets", "gguf", "gymnasium", "ale_py", "cv2", "matplotlib",
                 "math_verify", "reasoning_gym", "wandb", "peft", "trl")


def test_the_torch_level_parts_run_without_tyro_or_vllm(tmp_path: Path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(f"import sys\nsys.modules.update(dict.fromkeys({MISSING_THERE!r}))\n")
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, "benchmarks/first_gpu_check.py", "--quick", "--budget-s", "1500", "--out",
                           str(out)], cwd=ROOT, env={**script_env(), "PYTHONPATH": str(shim)}, capture_output=True,
                          text=True, timeout=1600)  # a budget for a loaded 2-core machine, not the GPU's 480 s
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["environment"]["tyro_installed"] is False and results["environment"]["vllm_installed"] is False
    for part in gpu_check.TORCH_PARTS:
        assert "error" not in results[part], (part, results[part])
    assert results["cublaslt"]["skipped"].startswith("no GPU")
    assert results["vllm_invariance"]["skipped"] == "vLLM is not installed here"
    head = results["head"]
    assert head["deterministic_algorithms"] and head["backward_twice"]["same_bits"]
    assert head["vocabulary"] > 2 * head["vocabulary_slice"]  # the slices are really compared with one slice
    assert {"same_bits", "max_abs_difference_weight"} <= set(head["sliced_vs_one_slice"])
    grpo = results["grpo_lora"]
    assert grpo["gradients_on_adapters_only"] and grpo["frozen_base_same_bits"] and grpo["adapters"] > 0
    assert all(step["engine_weights_changed_by_sync"] and step["grad_norm"] > 0 for step in grpo["steps"])
    distill = results["distill"]
    assert distill["reverse_kl_exactly_zero"] and len(distill["steps"]) == gpu_check.STEPS
    for step in distill["steps"]:  # recorded, not judged: issue 44's item 10 decides how long they may grow
        assert all(isinstance(length, int) for length in step["teacher_forward_order_lengths"].values())


def test_a_part_that_raises_becomes_its_result(tmp_path: Path, monkeypatch):
    def broken(device, quick):
        raise ValueError("a part that fails")

    monkeypatch.setitem(gpu_check.TORCH_PARTS, "head", (broken, 1))
    monkeypatch.setattr("common.determinism.seed_everything", lambda *args, **kwargs: {})
    result = tmp_path / "result.json"
    gpu_check.in_child(argparse.Namespace(part="head", gemms=None, trace=False, quick=True, result=result))
    recorded = json.loads(result.read_text())
    assert "ValueError: a part that fails" in recorded["error"] and "seconds_in_process" in recorded


def test_every_part_runs_after_one_that_failed(tmp_path: Path, monkeypatch):
    started = []

    def child(arguments, variables, limit_s, own_group=True):
        started.append(arguments[1])
        return {"error": "it broke"} if arguments[1] == "head" else {"fine": True}

    monkeypatch.setattr(gpu_check, "child", child)
    monkeypatch.setattr(gpu_check, "OTHER_PARTS", {"vllm_invariance": (lambda limit_s, quick: {"skipped": "no"}, 300)})
    monkeypatch.setattr(sys, "argv", ["first_gpu_check.py", "--out", str(tmp_path / "out.json")])
    gpu_check.main()
    results = json.loads((tmp_path / "out.json").read_text())
    assert started == list(gpu_check.TORCH_PARTS)
    assert results["head"]["error"] == "it broke" and results["distill"]["fine"]
    assert results["vllm_invariance"]["skipped"] == "no"


def test_a_part_past_its_limit_is_killed_with_what_it_started(tmp_path: Path):
    pid_file = tmp_path / "pid"
    started = time.perf_counter()
    done = gpu_check.run(["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], {}, 1)
    assert done["error"] == "timed out after 1 s" and time.perf_counter() - started < 10
    grandchild = Path(f"/proc/{pid_file.read_text().strip()}/stat")
    deadline = time.time() + 5
    while grandchild.exists() and grandchild.read_text().split()[2] != "Z" and time.time() < deadline:
        time.sleep(0.1)
    assert not grandchild.exists() or grandchild.read_text().split()[2] == "Z"  # killed (reaped, or not yet)


def test_a_spent_budget_skips_what_is_left(tmp_path: Path):
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, "benchmarks/first_gpu_check.py", "--budget-s", "0", "--out", str(out)],
                          cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())
    assert all(results[part]["skipped"] == "the run's 0 s budget is spent"
               for part in [*gpu_check.TORCH_PARTS, *gpu_check.OTHER_PARTS])
