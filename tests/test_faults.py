"""Faults a long run meets: a launcher killed alone (its workers must follow it), and a damaged checkpoint (a resume
must say which file of which checkpoint, and name the previous complete one, on every rank, with exit code 2)."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, SMALL_GRPO, only_run_dir, run_script, script_env

from common.llm.checkpoint import checkpoint_damage, resume_instead


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.2)


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running: a killed orphan stays a zombie until init reaps it, which counts as gone."""
    running = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
        except psutil.NoSuchProcess:
            pass
    return running


def checkpoint_names(run_root: Path) -> list[str]:
    """Every entry of the run's checkpoints/, the temporary directories of saves under way included."""
    checkpoints = only_run_dir(run_root) / "checkpoints"
    return sorted(p.name for p in checkpoints.iterdir()) if checkpoints.is_dir() else []


def test_workers_die_with_their_launcher(tmp_path: Path):
    """`kill -9` of torchrun alone (its workers run in sessions of their own, so they get no signal from the
    terminal or the process group): every worker is gone within 10 s and no checkpoint appears afterwards."""
    run_root, output = tmp_path / "runs", tmp_path / "output.txt"
    with open(output, "w") as sink:  # a file, not a pipe nobody reads, which would block
        launcher = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "grpo_llm.py",
             *SMALL_GRPO, "--total-steps", "400", "--save-every", "1", "--seed", "1", "--run-root", str(run_root)],
            cwd=ROOT, env=script_env(), stdout=sink, stderr=subprocess.STDOUT)
    descendants: list[psutil.Process] = []
    try:
        wait_until(lambda: "step 1/400" in output.read_text() or launcher.poll() is not None, 180, "training step")
        assert launcher.poll() is None, output.read_text()[-4000:]
        descendants = psutil.Process(launcher.pid).children(recursive=True)  # the workers and what they started
        assert len(descendants) >= 2, descendants
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 10
        while alive(descendants) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(descendants), f"outlived their launcher by 10 s: {alive(descendants)}"
        written = checkpoint_names(run_root)
        time.sleep(3)  # several steps, each of which would save a checkpoint (--save-every 1)
        assert checkpoint_names(run_root) == written
    finally:  # a failed run must not leave the workers training on this machine
        launcher.kill()
        for process in alive(descendants):
            process.kill()


def file_sizes(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*")) if p.is_file()}


def truncate_to_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def assert_every_rank_stopped_with(result: subprocess.CompletedProcess, *phrases: str) -> None:
    """Both ranks printed one `error:` line holding every phrase. torchrun itself exits 1 and terminates the other
    workers when the first one exits: that one's exit code is 2, the others' 2 or SIGTERM."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and len(errors) == 2, result.stderr[-4000:]
    assert all(phrase in error for error in errors for phrase in phrases), errors
    exit_codes = set(re.findall(r"exitcode\s*:\s*(-?\d+)", result.stderr))
    assert "2" in exit_codes and exit_codes <= {"2", str(-signal.SIGTERM)}, result.stderr[-4000:]


@pytest.fixture
def run_copy(grpo_reference_run: Path, tmp_path: Path) -> Path:
    """A copy of the reference run (checkpoints at steps 2 and 4) to damage."""
    return Path(shutil.copytree(grpo_reference_run, tmp_path / grpo_reference_run.name))


@pytest.mark.parametrize("damaged", ["trainer_state.pt", "trainer/__1_0.distcp"])
def test_resume_from_a_truncated_file_names_it_and_the_previous_checkpoint(run_copy: Path, tmp_path: Path,
                                                                          damaged: str):
    """A truncated file of the latest checkpoint: every rank stops with exit code 2 before loading any model, with one
    message naming the file, its checkpoint, and the previous complete checkpoint, and leaves the run as it was."""
    latest, previous = run_copy / "checkpoints" / "step_00000004", run_copy / "checkpoints" / "step_00000002"
    truncate_to_half(latest / damaged)
    before = file_sizes(run_copy)
    result = run_script("grpo_llm.py", [*SMALL_GRPO, "--total-steps", "6", "--seed", "1",
                                        "--run-root", str(tmp_path / "runs"), "--resume", str(latest)],
                        nproc=2, timeout=240)  # a hang fails; a busy machine can take minutes
    assert_every_rank_stopped_with(result, f"checkpoint {latest} is damaged: {damaged} is ",
                                   f"The previous complete checkpoint is {previous}: resume from it with --resume "
                                   f"{previous}")
    assert "PytorchStreamReader" not in result.stderr
    assert not re.search(r"^\[rank\d+\]: Traceback", result.stderr, re.MULTILINE), result.stderr[-4000:]
    assert file_sizes(run_copy) == before


def test_damage_that_passes_the_checks_still_names_the_checkpoint(run_copy: Path, tmp_path: Path):
    """A shard file overwritten with zeros keeps its size, so only the load itself finds it: still exit code 2 on
    every rank (no rank left waiting in the load's collectives), naming the checkpoint and the previous one."""
    latest, previous = run_copy / "checkpoints" / "step_00000004", run_copy / "checkpoints" / "step_00000002"
    shard = latest / "trainer" / "__1_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))
    assert checkpoint_damage(latest) is None
    result = run_script("grpo_llm.py", [*SMALL_GRPO, "--total-steps", "6", "--seed", "1",
                                        "--run-root", str(tmp_path / "runs"), "--resume", str(latest)],
                        nproc=2, timeout=240)  # a hang fails; a busy machine can take minutes
    assert_every_rank_stopped_with(result, f"checkpoint {latest}: its trainer/ shards do not load (",
                                   f"resume from it with --resume {previous}")
    assert "CheckpointException" not in result.stderr  # the load's own traceback (vLLM's at exit may follow)


@pytest.mark.parametrize("damage", ["truncate trainer_state.pt", "truncate trainer/.metadata",
                                    "delete trainer/.metadata", "delete trainer/__0_0.distcp",
                                    "truncate trainer/__0_0.distcp", "truncate model.safetensors",
                                    "delete model.safetensors"])
def test_checkpoint_damage_names_the_file(run_copy: Path, damage: str):
    """Each kind of damage is found without loading a model and named by its file; with the earlier checkpoint
    damaged too, there is nothing to resume from instead."""
    latest, previous = run_copy / "checkpoints" / "step_00000004", run_copy / "checkpoints" / "step_00000002"
    assert checkpoint_damage(latest) is None and checkpoint_damage(previous) is None
    action, name = damage.split()
    for checkpoint in (latest, previous):
        if action == "truncate":
            truncate_to_half(checkpoint / name)
        else:
            (checkpoint / name).unlink()
    assert checkpoint_damage(latest).startswith(f"{name} ")
    assert resume_instead(latest).startswith("There is no earlier complete checkpoint")
