"""How a run ends before its last step without losing what it wrote: a preemption signal becomes one checkpoint, a
clean exit and the command that resumes it; a failed write (a full disk, a quota) becomes one message on every rank
that names the file, the free space and the checkpoint to resume from.

Exit statuses, the same in every script and on every rank:
    0  the run finished
    1  an unexpected error: Python's traceback says where
    2  refused: bad input, a checkpoint that is damaged or from another run, a non-finite loss
    3  preempted: a stop signal came, a checkpoint was written, the line printed last resumes it
    4  a write failed (no space left, a quota, an I/O error): the checkpoints before it are complete, and named
torchrun exits 1 whenever a worker exits with anything but 0 (its failure table lists each worker's status) and when
it was signalled itself, so rank 0 also records a preemption in `{run_dir}/stopped.json` (status, signal, step,
checkpoint, resume command) for a batch script to read (docs/scaling.md, "Running under SLURM").

Signals (`--stop-signals`, default SIGTERM, which torchrun forwards, and SIGUSR1, which SLURM's `--signal` can send)
only set a flag. The loop reads it where its ranks meet anyway, at the end of a step: `step_boundary`, one all-reduce
of two integers over every rank (a CPU tensor: gloo, valid beside NCCL; at 1,024 ranks about 2 x 1,023 hops of a ring,
tens of milliseconds per step, as the step's other bookkeeping collectives). So a signal that reached some ranks only,
or at different moments, stops every rank after the same step, and no rank waits alone in a collective. The step under
way finishes first, then one checkpoint is written: the bound is one step plus one save (perf/step_s, and each save's
seconds in the log), which the grace period before SIGKILL must cover (SLURM: the `--signal` lead time; torchrun:
`--shutdown-timeout`, 30 s by default). A worker that crashes alone makes torchrun send SIGTERM to the others too: they
then end at their next collective with the dead rank (gloo raises at once; NCCL at its timeout, or torchrun's SIGKILL
after --shutdown-timeout)."""

import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from common.distributed import STOP_SIGNALS_CAUGHT, end, fail
from common.tracking import resume_command

EXIT_PREEMPTED = 3
EXIT_WRITE_FAILED = 4
DEFAULT_STOP_SIGNALS = ("SIGTERM", "SIGUSR1")
_received = 0  # the first stop signal's number, set by the handler; 0: none yet


def stop_signals_problem(names: Sequence[str]) -> str | None:
    """Why `names` (--stop-signals) cannot be caught, or None."""
    for name in names:
        number = getattr(signal.Signals, name, None)
        if number is None or number in (signal.SIGKILL, signal.SIGSTOP):
            return f"--stop-signals: {name!r} is not a signal a process can catch (e.g. SIGTERM, SIGUSR1, SIGINT)"
    return None


def catch_stop_signals(names: Sequence[str]) -> None:
    """From now on each signal of `names` only records that it came; `step_boundary` reads the record."""
    def note(number: int, frame: object) -> None:
        global _received
        _received = _received or number

    for name in names:
        number = signal.Signals[name]
        signal.signal(number, note)
        signal.siginterrupt(number, False)  # interrupted system calls (gloo's, the engine's) restart, not fail
        STOP_SIGNALS_CAUGHT.append(number)


def step_boundary(failure: str | None = None, group: dist.ProcessGroup | None = None,
                  before_exit: Callable[[], None] | None = None) -> str | None:
    """A collective of every rank of `group` (default: the default group) at the end of a step. When a write failed
    on any rank (`failure`: this rank's message, or None), every rank stops with that message (exit 4), after
    `before_exit` (e.g. the engine's close, which needs the process group). Otherwise returns the name of the stop
    signal any rank has received, or None."""
    flags = torch.tensor([_received, int(failure is not None)])
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    if flags[1]:
        messages = [None] * dist.get_world_size(group) if dist.is_initialized() else [failure]
        if dist.is_initialized():
            dist.all_gather_object(messages, failure, group=group)
        if before_exit is not None:
            before_exit()
        fail(next(message for message in messages if message is not None), EXIT_WRITE_FAILED)
    return signal.Signals(int(flags[0])).name if flags[0] else None


def preempted(signal_name: str, step: int, checkpoint: Path, rank: int, record: Callable[[str, dict], None],
              shut_down: Callable[[], None]) -> None:
    """End a run stopped by `signal_name` after `step`, once `checkpoint` is written (on every rank): rank 0 records
    it in stopped.json (`record`: the tracker's write_json) and prints the line that resumes it; then `shut_down`
    (logs, engine, process group) and exit 3."""
    command = resume_command(checkpoint)
    if rank == 0:
        record("stopped.json", {"exit_status": EXIT_PREEMPTED, "signal": signal_name, "step": step,
                                "checkpoint": os.path.abspath(checkpoint), "resume_command": command})
        print(f"preempted by {signal_name} after step {step}, checkpoint written; resume with: {command}", flush=True)
    shut_down()
    end(EXIT_PREEMPTED)
