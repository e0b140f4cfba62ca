"""Cluster life (common/preemption.py): a stop signal sent to torchrun at a random moment ends the run after one
checkpoint with the line that resumes it, and the resumed run equals the uninterrupted one bit for bit; the decision
is collective; a full disk while writing a checkpoint or a log stops every rank with one message naming the file, the
free space and the last complete checkpoint, the partial directory removed. (DQN's: tests/test_dqn_atari.py; the
split layout's: tests/test_split.py.)"""

import errno
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import (
    ROOT,
    SMALL_GRPO,
    check,
    only_run_dir,
    preempt_at_random,
    read_metrics,
    run_resume_line,
    run_script,
    script_env,
)

from common import tracking
from common.checkpoint import CheckpointWriteFailed, save_checkpoint
from common.llm.checkpoint import checkpoint_damage
from common.preemption import stop_signals_problem
from common.tracking import RunTracker, resume_command


def test_only_signals_a_process_can_catch_are_accepted():
    assert stop_signals_problem(("SIGTERM", "SIGUSR1", "SIGINT", "SIGUSR2")) is None
    for name in ("SIGKILL", "SIGSTOP", "TERM", "SIGNOTHING"):
        assert f"{name!r} is not a signal a process can catch" in stop_signals_problem(("SIGTERM", name))


def test_the_resume_command_is_the_launch_with_the_checkpoint_in_place_of_any_resume(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(sys, "argv", ["grpo_llm.py", "--seed", "1", "--resume", "old", "--task", "gsm8k",
                                      "--resume=older"])
    monkeypatch.setitem(tracking.LAUNCH, "launcher", "torchrun --nnodes 2 --nproc_per_node 8")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000007"
    assert resume_command(checkpoint) == "torchrun --nnodes 2 --nproc_per_node 8 grpo_llm.py --seed 1 --task gsm8k " \
                                         f"--resume {checkpoint}"


def test_a_checkpoint_that_fills_the_disk_is_removed_and_the_last_complete_one_named(tmp_path: Path):
    save_checkpoint(tmp_path, 1, lambda directory: torch.save({"step": 1}, directory / "trainer_state.pt"), 0)
    before = (tmp_path / "step_00000001" / "trainer_state.pt").read_bytes()

    def fills_the_disk(directory: Path) -> None:
        (directory / "trainer_state.pt").write_bytes(b"the first half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / "model.safetensors"))

    with pytest.raises(CheckpointWriteFailed) as failure:
        save_checkpoint(tmp_path, 2, fills_the_disk, 0)
    message = str(failure.value)
    assert "checkpoint step_00000002 could not be written (rank 0: " in message
    assert "OSError: [Errno 28] No space left on device: '" in message
    assert ".step_00000002.tmp/model.safetensors'" in message
    assert re.search(r"[\d.]+ [MG]iB free of [\d.]+ [MG]iB", message) and "its partial .step_00000002.tmp was removed" \
        in message
    assert f"The last complete checkpoint is {tmp_path / 'step_00000001'}: resume with " in message
    assert message.endswith(f"--resume {tmp_path / 'step_00000001'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]
    assert (tmp_path / "latest").read_text() == "step_00000001\n"
    assert (tmp_path / "step_00000001" / "trainer_state.pt").read_bytes() == before


@dataclass
class TrackerArgs:
    exp_name: str = "logs"
    seed: int = 1
    run_root: str = ""
    track: bool = False
    wandb_project_name: str = ""


def test_a_log_line_that_fills_the_disk_is_cut_back_and_later_writes_wait(tmp_path: Path, monkeypatch):
    tracker = RunTracker(TrackerArgs(run_root=str(tmp_path)), 0, 1, {})
    tracker.log(1, {"train/loss": 0.5, "perf/step_s": 1.0})
    metrics, perf = tracker.run_dir / "metrics.jsonl", tracker.run_dir / "perf.jsonl"
    before = metrics.read_bytes()
    real_write, calls = os.write, []

    def half_then_full(fd: int, data: bytes) -> int:  # a short write, then no space: what a filling disk does
        if fd != tracker.metrics_file.fileno():
            return real_write(fd, data)
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half_then_full)
    tracker.log(2, {"train/loss": 0.25, "perf/step_s": 1.0})
    monkeypatch.setattr(os, "write", real_write)
    assert len(calls) == 2 and metrics.read_bytes() == before  # the half line is gone
    assert tracker.write_failure.startswith(f"cannot write {metrics} (OSError: [Errno 28] No space left on device); ")
    assert "free of" in tracker.write_failure and "There is no complete checkpoint yet" in tracker.write_failure
    perf_before = perf.read_bytes()
    tracker.log(3, {"train/loss": 0.125, "perf/step_s": 1.0})  # nothing more is written once a write failed
    tracker.write_json("final.json", {"step": 3})
    assert metrics.read_bytes() == before and perf.read_bytes() == perf_before
    assert not (tracker.run_dir / "final.json").exists()
    tracker.close()


def test_the_ranks_decide_together(tmp_path: Path):
    """A signal that reached rank 1 alone stops rank 0 too; a checkpoint part that failed on rank 1 alone fails the
    checkpoint on both (the partial directory gone, `latest` unchanged); rank 0's failed log write ends both ranks
    with its message and exit status 4."""
    result = run_script("tests/workers/preemption_worker.py", [str(tmp_path / "checkpoints"), str(tmp_path)], nproc=2,
                        timeout=120)
    summaries = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]
    assert len(summaries) == 2, result.stdout[-3000:] + result.stderr[-3000:]
    for summary in summaries:
        assert summary["before"] is None and summary["after"] == "SIGUSR1"
        assert "could not be written (rank 1: OSError: [Errno 28]" in summary["failed"] and "part1" in \
            summary["failed"]
        assert summary["left"] == ["latest", "step_00000001"]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: rank 0 could not write its log"] * 2, result.stderr[-3000:]
    assert set(re.findall(r"exitcode\s*:\s*(-?\d+)", result.stderr)) == {"4"}, result.stderr[-3000:]


def test_grpo_stopped_by_sigterm_to_torchrun_at_a_random_moment_resumes_bit_for_bit(grpo_reference_run: Path,
                                                                                      tmp_path: Path):
    """SIGTERM to the launcher during steps 1-3 of the reference run's arguments: torchrun forwards it, every rank
    finishes its step, one checkpoint is written (none extra when the step saved one), rank 0 prints the resume line
    and records it in stopped.json. That command continues in the same run directory to the reference's bytes."""
    step_s = statistics.median(p["perf/step_s"] for p in read_metrics(grpo_reference_run, "perf.jsonl") if p["step"])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "--shutdown-timeout", "300", "grpo_llm.py", *SMALL_GRPO, "--seed", "1",
               "--run-root", str(tmp_path / "runs")]
    status, text, delay = preempt_at_random(command, tmp_path / "output.txt", "step 1/4", 1.5 * step_s)
    context = f"SIGTERM {delay:.2f} s after step 1's line\n{text[-4000:]}"
    assert status != 0, context  # torchrun, signalled itself, ends with its own SignalException
    run_dir = only_run_dir(tmp_path / "runs")
    stopped = json.loads((run_dir / "stopped.json").read_text())
    assert stopped["exit_status"] == 3 and stopped["signal"] == "SIGTERM" and 1 <= stopped["step"] <= 3, context
    checkpoint = Path(stopped["checkpoint"])
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == checkpoint.name, context
    assert checkpoint_damage(checkpoint) is None and read_metrics(run_dir)[-1]["step"] == stopped["step"]
    assert f"preempted by SIGTERM after step {stopped['step']}, checkpoint written; resume with: " \
           f"{stopped['resume_command']}" in text
    check(run_resume_line(text))
    assert not (run_dir / "stopped.json").exists()
    assert (run_dir / "metrics.jsonl").read_bytes() == (grpo_reference_run / "metrics.jsonl").read_bytes(), context
    assert json.loads((run_dir / "final.json").read_text())["parameter_sha256"] == \
        json.loads((grpo_reference_run / "final.json").read_text())["parameter_sha256"]
    assert [r["step"] for r in read_metrics(run_dir, "perf.jsonl")] == [1, 2, 3, 4]
    assert len(json.loads((run_dir / "manifest.json").read_text())["resumed"]) == 1


def namespaces_work() -> bool:
    """Whether this machine lets an unprivileged process mount a tmpfs in a user namespace of its own."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


def assert_every_rank_stopped_for_a_full_disk(result: subprocess.CompletedProcess, written: Path, failed: str,
                                              checkpoints: Path) -> None:
    """Both ranks printed one message naming what failed (`failed`: a regular expression), the free space and the last
    complete checkpoint, and exited 4 (torchrun's table); no partial directory is left, `latest` names that
    checkpoint, and every log line is whole. `written`: the run directory as the run saw it (the names in the
    messages); `checkpoints`: where its checkpoints are now."""
    output = result.stdout[-3000:] + result.stderr[-5000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and len(errors) == 2, output
    assert set(re.findall(r"exitcode\s*:\s*(-?\d+)", result.stderr)) == {"4"}, output
    first = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step_"))[0]
    for error in errors:
        assert re.search(failed, error, re.IGNORECASE), error
        assert re.search(r"[\d.]+ [MG]iB free of [\d.]+ [MG]iB", error), error
        assert f"The last complete checkpoint is {written / 'checkpoints' / first}: resume with " in error, error
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", first]
    assert (checkpoints / "latest").read_text().strip() == first
    assert all(json.loads(line) for line in (checkpoints.parent / "metrics.jsonl").read_text().splitlines())


LLM_SMALL = ["--task", "tests/small_addition_task.py:SmallAdditionTask", "--prompts-per-step", "16",
             "--num-generations", "4", "--micro-batch-size", "16", "--num-eval-prompts", "32", "--eval-every", "0",
             "--save-every", "1", "--total-steps", "2"]
DQN_SMALL = ["--total-timesteps", "900", "--learning-starts", "200", "--buffer-size", "600", "--batch-size", "8",
             "--target-network-frequency", "200", "--save-every", "300"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
CHECKPOINT_FAILED = r"checkpoint step_\d+ could not be written \(ranks? [\d, ]+: .*no space left.*\); .* its partial " \
                    r"\.step_\d+\.tmp was removed"


@pytest.mark.skipif(not namespaces_work(), reason="no user namespaces here: the unit tests above inject the fault")
@pytest.mark.parametrize("script, args", [
    ("grpo_llm.py", [*LLM_SMALL, "--rollout-ranks", "1", "--max-staleness", "1"]), ("dqn_atari.py", DQN_SMALL),
], ids=["grpo-split", "dqn"])
def test_a_checkpoint_on_a_full_disk_stops_every_rank_with_one_message(script: str, args: list[str], tmp_path: Path):
    """On a 64 MiB tmpfs of its own, filled to 1 MiB once the first checkpoint is complete: the next one cannot be
    written. (GRPO in the split layout, where the rollout rank must hear it too; DPO and PPO save through the same
    common/llm/lifecycle.end_step.)"""
    mount = tmp_path / "fs"
    mount.mkdir()
    result = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", sys.executable,
                             "tests/workers/small_disk.py", str(mount), "64", "*/checkpoints/latest", "1024",
                             str(tmp_path / "copy"), "--", *TORCHRUN, script, *args, "--run-root", str(mount)],
                            cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=600)
    run_dir = only_run_dir(tmp_path / "copy")
    assert_every_rank_stopped_for_a_full_disk(result, mount / run_dir.name, CHECKPOINT_FAILED, run_dir / "checkpoints")
    if script != "dqn_atari.py":
        first = (run_dir / "checkpoints" / "latest").read_text().strip()
        assert checkpoint_damage(run_dir / "checkpoints" / first) is None


@pytest.mark.parametrize("script, args, after", [("dpo_online.py", LLM_SMALL, 1), ("dqn_atari.py", DQN_SMALL, 300)],
                         ids=["dpo", "dqn"])
def test_a_log_line_on_a_full_disk_stops_every_rank_with_one_message(script: str, args: list[str], after: int,
                                                                     tmp_path: Path):
    """The disk is full for every log line after the first checkpoint's step (a fault injected at the write,
    tests/workers/full_log.py): the ranks stop at the step's end, the failed file named, before the next checkpoint."""
    result = run_script("tests/workers/full_log.py", [str(after), script, *args, "--run-root", str(tmp_path)], nproc=2)
    run_dir = only_run_dir(tmp_path)
    assert_every_rank_stopped_for_a_full_disk(
        result, run_dir, r"cannot write \S+\.jsonl \(OSError: \[Errno 28\] No space left on device\)",
        run_dir / "checkpoints")
