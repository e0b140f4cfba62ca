"""Checkpoints: `{run_dir}/checkpoints/step_{N:08d}/`, written as `.step_{N:08d}.tmp` and renamed when complete, and a
`latest` file naming the newest complete one, so a kill during a save never corrupts the latest checkpoint. For the
LLM scripts: every rank's own shards of the training state, and a `transformers`-loadable export of the policy."""

import io
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from common.distributed import in_brief
from common.tracking import free_space, last_complete


def save_object(value: object, path: Path) -> None:
    """torch.save through memory, so that a full disk raises an OSError naming the file (torch's own file writer
    raises a RuntimeError naming neither the file nor the cause)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    try:
        path.write_bytes(buffer.getbuffer())
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(path)) from error


class CheckpointWriteFailed(Exception):
    """A checkpoint could not be written (raised on every rank of the save alike); its message names the file, the
    error, the free space and the checkpoint to resume from. The partial directory is already removed."""


def save_checkpoint(root: Path, step: int, write: Callable[[Path], None], keep_last: int,
                    group: dist.ProcessGroup | None = None) -> Path:
    """Every rank fills a fresh `root/.step_N.tmp` with its own part (`write(tmp)`); then rank 0 flushes it to disk,
    renames it `root/step_N`, points `latest` at it, and only then deletes checkpoints beyond `keep_last` (> 0). A
    collective when a process group exists: its waits use `group` (a long timeout, for a big rank-0 write). A rank
    whose part fails (a full disk) tells the others at the next wait, where all would have met anyway: rank 0 then
    removes the partial directory and every rank raises CheckpointWriteFailed, so `latest` still names the last
    complete checkpoint and no rank is left waiting."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp, final = root / f".step_{step:08d}.tmp", root / f"step_{step:08d}"

    def everyone_here(failure: str | None) -> None:
        """The wait of all ranks, which also agrees whether some rank's part failed (`failure`: its message)."""
        failures = [failure]
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            flag = torch.tensor([int(failure is not None)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            if flag.item():
                failures = [None] * dist.get_world_size(group)
                dist.all_gather_object(failures, failure, group=group)
        ranks_by_reason: dict[str, list[str]] = {}
        for r, message in enumerate(failures):
            if message is not None:
                ranks_by_reason.setdefault(message, []).append(str(r))
        if ranks_by_reason:
            reasons = "; ".join(f"{'ranks' if len(ranks) > 1 else 'rank'} {', '.join(ranks)}: {message}"
                                for message, ranks in ranks_by_reason.items())
            message = f"checkpoint {final.name} could not be written ({reasons}); {free_space(root)} on the file " \
                      f"system of {root}; its partial {tmp.name} was removed. "
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                (root / ".latest.tmp").unlink(missing_ok=True)
            if dist.is_initialized():
                dist.barrier(group=group)  # the partial directory is gone before any rank reports
            raise CheckpointWriteFailed(message + last_complete(root))

    def attempt(action: Callable[[], None]) -> str | None:
        try:
            action()
        except (Exception, CheckpointException) as error:  # OSError; safetensors, torch.save and dcp wrap a full
            # disk in their own types, dcp's with every rank's exception in it
            cause = next(iter(error.failures.values()))[0] if isinstance(error, CheckpointException) else error
            if isinstance(cause, OSError):  # its message names the file, when it has one
                return in_brief(cause) if cause.filename else f"{tmp}: {in_brief(cause)}"
            # torch's zip writer (inside dcp too) reports a full disk without its errno: say what the disk says
            full = ", no space left on the device" if shutil.disk_usage(root).free < 2**20 else ""
            return f"{tmp}: {type(cause).__name__}: {str(cause).strip().splitlines()[0]}{full}"
        return None

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted save
        tmp.mkdir()

    def publish() -> None:
        for path in tmp.rglob("*"):  # flush file contents before the rename makes them visible
            if path.is_file():
                with open(path, "rb") as handle:
                    os.fsync(handle.fileno())
        if final.exists():  # saving the same step twice (e.g. a resumed run's end) replaces it
            shutil.rmtree(final)
        os.rename(tmp, final)
        (root / ".latest.tmp").write_text(final.name + "\n")
        os.replace(root / ".latest.tmp", root / "latest")
        complete = sorted(p for p in root.glob("step_*") if p.is_dir())
        for old in complete[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)

    everyone_here(attempt(prepare) if rank == 0 else None)
    everyone_here(attempt(lambda: write(tmp)))
    everyone_here(attempt(publish) if rank == 0 else None)
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


