"""Atomic checkpoint directories: a kill during a save never leaves a corrupt latest checkpoint.

Layout: `{run_dir}/checkpoints/step_{N:08d}/` written as `.step_{N:08d}.tmp` and renamed when complete, and a `latest`
file naming the newest complete one, replaced atomically after the rename.
"""

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def save_checkpoint(root: Path, step: int, write: Callable[[Path], None], keep_last: int = 0) -> Path:
    """Call `write(tmp_dir)` to fill a fresh directory, then publish it as `root/step_{step}`.

    `keep_last` > 0 deletes older complete checkpoints beyond that many, only after the new one is published.
    """
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".step_{step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted save
    tmp.mkdir()
    write(tmp)
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
    """Accept a checkpoint directory or a `checkpoints/` root (then its `latest`). Raises FileNotFoundError."""
    candidate = Path(path)
    if (candidate / "latest").is_file():
        candidate = candidate / (candidate / "latest").read_text().strip()
    elif (candidate / "checkpoints" / "latest").is_file():
        candidate = candidate / "checkpoints" / (candidate / "checkpoints" / "latest").read_text().strip()
    if not (candidate / "trainer_state.pt").is_file():
        raise FileNotFoundError(f"no complete checkpoint at {path!r} (expected a trainer_state.pt inside)")
    return candidate
