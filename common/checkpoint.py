"""Checkpoints: `{run_dir}/checkpoints/step_{N:08d}/`, written as `.step_{N:08d}.tmp` and renamed when complete, and a
`latest` file naming the newest complete one, so a kill during a save never corrupts the latest checkpoint. For the
LLM scripts: every rank's own shards of the training state, and a `transformers`-loadable export of the policy."""

import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from common.determinism import rng_states
from common.distributed import fail, save_group
from common.models import export_pretrained


def save_checkpoint(root: Path, step: int, write: Callable[[Path], None], keep_last: int,
                    group: dist.ProcessGroup | None = None) -> Path:
    """Every rank fills a fresh `root/.step_N.tmp` with its own part (`write(tmp)`); then rank 0 flushes it to disk,
    renames it `root/step_N`, points `latest` at it, and only then deletes checkpoints beyond `keep_last` (> 0). A
    collective when a process group exists: its waits use `group` (a long timeout, for a big rank-0 write)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp, final = root / f".step_{step:08d}.tmp", root / f"step_{step:08d}"

    def everyone_here() -> None:
        if dist.is_initialized():
            dist.barrier(group=group)

    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted save
        tmp.mkdir()
    everyone_here()
    write(tmp)
    everyone_here()
    if rank == 0:
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
            shutil.rmtree(old)
    everyone_here()
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


def read_training_state(args: object, world_size: int, may_change: Iterable[str]) -> tuple[Path, dict]:
    """The checkpoint `args.resume` names and its trainer_state.pt, refused with one message (on every rank alike,
    before any collective) when it was written at another world size, with other arguments than `args` (except
    `may_change`), or has nothing left to run."""
    try:
        directory = resolve_checkpoint(args.resume)
    except FileNotFoundError as error:
        fail(str(error))
    state = torch.load(directory / "trainer_state.pt", weights_only=False)
    if state.get("world_size") != world_size:
        fail(f"checkpoint was written with world size {state.get('world_size')}, this run has {world_size}; resume "
             "needs the same")
    problems = check_resume_args(state["args"], asdict(args), may_change)
    if problems:
        fail(f"{directory} was written with other arguments; resuming would silently change the run:\n  "
             + "\n  ".join(problems) + f"\n(arguments a resume may change: {', '.join(may_change)}; "
             "--total-steps may grow)")
    if args.total_steps <= state["step"]:
        fail(f"the checkpoint is at step {state['step']}, --total-steps is {args.total_steps}: nothing left to run "
             "(a larger --total-steps extends the run)")
    return directory, state


def save_training_checkpoint(root: Path, step: int, trained: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]],
                             tokenizer: object, args: object, extra: dict | None = None) -> Path:
    """A collective: every rank writes its shard of each trained model and optimizer (`trained`, e.g. {"policy":
    (model, optimizer)}) with torch.distributed.checkpoint; the policy is exported loadable by transformers and vLLM;
    rank 0 adds trainer_state.pt (step, arguments, world size, every rank's RNG states, and `extra`: state the
    algorithm carries between steps, e.g. an adaptive coefficient)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    all_rng: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(all_rng, rng_states(), group=save_group())

    def write(directory: Path) -> None:
        state = {name: {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
                 for name, (model, optimizer) in trained.items()}
        dcp.save(state, checkpoint_id=str(directory / "trainer"), process_group=save_group())
        export_pretrained(trained["policy"][0], tokenizer, directory)
        if dist.get_rank() == 0:
            torch.save({"step": step, "args": asdict(args), "world_size": dist.get_world_size(), "rng": all_rng,
                        "extra": extra or {}}, directory / "trainer_state.pt")

    return save_checkpoint(root, step, write, args.keep_last, save_group())


def load_training_checkpoint(directory: Path, trained: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]
                             ) -> None:
    """Read each rank's shards back into the (already sharded) models and optimizers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = {name: {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
             for name, (model, optimizer) in trained.items()}
    dcp.load(state, checkpoint_id=str(directory / "trainer"), process_group=save_group())
    for name, (model, optimizer) in trained.items():
        set_model_state_dict(model, state[name]["model"])
        set_optimizer_state_dict(model, optimizer, state[name]["optimizer"])
