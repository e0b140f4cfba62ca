"""The headline: same arguments, same machine, same world size -> the same bits (a resume equals the uninterrupted run:
tests/test_preemption.py resumes a run stopped at a random moment)."""

import filecmp
import json
import shutil
from pathlib import Path

from conftest import (
    SMALL_GRPO,
    assert_two_node_manifest,
    check,
    dropout_model,
    only_run_dir,
    read_metrics,
    run_agents,
    run_script,
)


def final_hash(run_dir: Path) -> str:
    return json.loads((run_dir / "final.json").read_text())["parameter_sha256"]


def test_same_seed_gives_identical_metrics_and_weights_on_two_nodes(grpo_reference_run: Path, tmp_path: Path):
    """The same run again, launched as two nodes would launch it (two torchrun agents of one process each, meeting by
    c10d rendezvous), equals the one-agent run with two processes bit for bit; its manifest records the launch."""
    for agent in run_agents("grpo_llm.py", [*SMALL_GRPO, "--seed", "1", "--run-root", str(tmp_path)]):
        check(agent)
    again = only_run_dir(tmp_path)
    assert filecmp.cmp(again / "metrics.jsonl", grpo_reference_run / "metrics.jsonl", shallow=False)
    assert final_hash(again) == final_hash(grpo_reference_run)
    assert_two_node_manifest(again)


def test_different_seed_gives_different_results(grpo_reference_run: Path, tmp_path: Path):
    check(run_script("grpo_llm.py", [*SMALL_GRPO, "--seed", "2", "--run-root", str(tmp_path)], nproc=2))
    other = only_run_dir(tmp_path)
    assert final_hash(other) != final_hash(grpo_reference_run)
    assert read_metrics(other)[1:] != read_metrics(grpo_reference_run)[1:]


def test_resume_refuses_changed_arguments(grpo_reference_run: Path, tmp_path: Path):
    checkpoint = grpo_reference_run / "checkpoints" / "step_00000002"
    before = sorted(p.name for p in grpo_reference_run.rglob("*"))
    result = run_script("grpo_llm.py", [*SMALL_GRPO, "--seed", "3", "--learning-rate", "1e-3", "--rollout-engine",
                                        "hf", "--resume", str(checkpoint), "--run-root", str(tmp_path)], nproc=2,
                        timeout=180)
    assert result.returncode != 0
    assert "--seed: checkpoint 1, now 3" in result.stderr
    assert "--learning-rate: checkpoint 0.0003, now 0.001" in result.stderr
    assert "--rollout-engine: checkpoint 'vllm', now 'hf'" in result.stderr  # another engine draws other samples
    assert sorted(p.name for p in grpo_reference_run.rglob("*")) == before  # nothing touched


def test_model_with_dropout_trains_without_it_and_resumes_exactly(tmp_path: Path):
    """Every policy forward runs in eval mode, as the engine's and the reference's do: with mu = 1 the trainer's
    logprobs then differ from the engine's by kernel rounding only (about 1e-6; in train mode, with dropout, they
    differed by 2.8 nats on average and up to 11.7), and the resumed run still matches the uninterrupted one."""
    model_dir = dropout_model(tmp_path / "dropout-adder")
    args = [*SMALL_GRPO, "--model-name-or-path", str(model_dir), "--total-steps", "3", "--eval-every", "0",
            "--num-eval-prompts", "16"]
    check(run_script("grpo_llm.py", [*args, "--run-root", str(tmp_path / "full")]))
    full = only_run_dir(tmp_path / "full")
    copy = tmp_path / "copy"
    shutil.copytree(full, copy)
    check(run_script("grpo_llm.py", [*args, "--resume", str(copy / "checkpoints" / "step_00000002"),
                                     "--run-root", str(tmp_path / "unused")]))
    assert final_hash(copy) == final_hash(full)
    assert filecmp.cmp(copy / "metrics.jsonl", full / "metrics.jsonl", shallow=False)
    assert all(m["mismatch/logprob_abs_diff_max"] < 1e-4 for m in read_metrics(full)[1:])
