"""Atomic checkpoint directories: a kill during a save never leaves a corrupt latest checkpoint.

Layout: `{run_dir}/checkpoints/step_{N:08d}/` written as `.step_{N:08d}.tmp` and renamed when complete, and a `latest`
file naming the newest complete one, replaced atomically after the rename.
"""

import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch.distributed as dist


def save_checkpoint(root: Path, step: int, write: Callable[[Path], None], keep_last: int = 0) -> Path:
    """Call `write(tmp_dir)` to fill a fresh directory, then publish it as `root/step_{step}`.

    `keep_last` > 0 deletes older complete checkpoints beyond that many, only after the new one is published.
    """
    tmp = _fresh_tmp(root, step)
    write(tmp)
    return _publish(root, step, keep_last)


def save_checkpoint_all_ranks(root: Path, step: int, write: Callable[[Path], None], keep_last: int,
                              group: dist.ProcessGroup) -> Path:
    """The collective form of `save_checkpoint`: every rank calls it and `write(tmp_dir)` fills in its own part;
    rank 0 publishes once all parts are in. `group` should have a long timeout (a big rank-0 write)."""
    tmp = root / f".step_{step:08d}.tmp"
    if dist.get_rank() == 0:
        _fresh_tmp(root, step)
    dist.barrier(group=group)
    write(tmp)
    dist.barrier(group=group)
    if dist.get_rank() == 0:
        _publish(root, step, keep_last)
    dist.barrier(group=group)
    return root / f"step_{step:08d}"


def _fresh_tmp(root: Path, step: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".step_{step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted save
    tmp.mkdir()
    return tmp


def _publish(root: Path, step: int, keep_last: int) -> Path:
    final = root / f"step_{step:08d}"
    tmp = root / f".step_{step:08d}.tmp"
    for path in tmp.rglob("*"):  # flush file contents before the rename makes them visible
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    if final.exists():  # saving the same step twice (e.g. a resumed run's end) replaces it
        shutil.rmtree(final)
    os.rename(tmp, final)
    pointer_tmp = root / ".latest.tmp"
    pointer_tmp.write_text(final.name + "\n")
    os.replace(pointer_tmp, root / "latest")
    if keep_last > 0:
        complete = sorted(p for p in root.glob("step_*") if p.is_dir())
        for old in complete[:-keep_last]:
            shutil.rmtree(old)
    return final


def resolve_checkpoint(path: str) -> Path:
    """Accept a checkpoint directory, a `checkpoints/` root or its `latest` file, or a run directory (the last two
    mean the checkpoint `latest` names). Raises FileNotFoundError."""
    candidate = Path(path)
    if candidate.name == "latest" and candidate.is_file():
        candidate = candidate.parent / candidate.read_text().strip()
    elif (candidate / "latest").is_file():
        candidate = candidate / (candidate / "latest").read_text().strip()
    elif (candidate / "checkpoints" / "latest").is_file():
        candidate = candidate / "checkpoints" / (candidate / "checkpoints" / "latest").read_text().strip()
    if not (candidate / "trainer_state.pt").is_file():
        raise FileNotFoundError(f"no complete checkpoint at {path!r} (expected a trainer_state.pt inside)")
    return candidate


def check_resume_args(saved: dict[str, object], current: dict[str, object], may_change: Iterable[str]) -> list[str]:
    """Every argument that differs between a checkpoint's run and this one, except those in `may_change`, as one
    readable line each (empty when the resume is faithful). `total_steps`/`total_timesteps` may also grow: extending
    a run on purpose, never shrinking it below where the checkpoint stands (the caller checks that)."""
    allowed = set(may_change)
    problems = []
    for name in sorted(set(saved) | set(current)):
        before, now = saved.get(name, "<absent>"), current.get(name, "<absent>")
        if name in allowed or before == now:
            continue
        if name in ("total_steps", "total_timesteps") and isinstance(before, int) and isinstance(now, int) \
                and now > before:
            continue
        problems.append(f"--{name.replace('_', '-')}: checkpoint {before!r}, now {now!r}")
    return problems
