"""One code path for `python X.py` and `torchrun --nproc_per_node N X.py`. The collective rule: the default group
carries gloo for CPU tensors and NCCL for CUDA tensors (`cpu:gloo,cuda:nccl`); training tensors (gradients, FSDP
shards) go through NCCL, bookkeeping (statistics, counts, flags, objects) stays on the CPU and goes through gloo, so
it never forces a device round trip and is valid on every backend."""

import contextlib
import datetime
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

# Saving a checkpoint can keep one rank busy for minutes (a 7B export) while the others wait: their waits use a
# separate gloo group with this timeout instead of the default group's.
SAVE_TIMEOUT = datetime.timedelta(hours=2)
_save_group: dist.ProcessGroup | None = None
# The NCCL_* variables when the default group's communicator was created (eagerly, with device_id): NCCL reads most
# of them once, at the process's first communicator, so the trainer keeps these even after vLLM pins its own.
_nccl_env_at_init: dict[str, str] = {}
T = TypeVar("T")
_open_file_limits: dict[str, int] = {}
# What the rollout engine's start set (vLLM's batch-invariant mode pins NCCL_PROTO, NCCL_MAX_NCHANNELS, ... for its own
# communicators, created while it starts) and was put back afterwards; None: the engine removed a variable.
_nccl_engine_pins: dict[str, str | None] = {}
# Ranks per node as torchrun started them, read at import: vLLM's CPU platform rewrites LOCAL_WORLD_SIZE when its
# engine starts. torchrun numbers ranks node by node, so node k holds ranks k * LOCAL_WORLD_SIZE ... + that - 1.
LOCAL_WORLD_SIZE_AT_LAUNCH = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


# The parent at import, as early as this process can know it: for die_with_launcher's check that it still lives.
LAUNCHER_PID = os.getppid()


def local_world_size() -> int:
    """Processes per node (torchrun's --nproc_per_node), as launched."""
    return LOCAL_WORLD_SIZE_AT_LAUNCH


def die_with_launcher() -> None:
    """Under torchrun on Linux, have the kernel SIGKILL this worker as soon as its launcher dies: torchrun starts
    workers in sessions of their own, so a launcher killed by `kill -9`, the OOM killer or a node agent would leave
    them training and writing checkpoints into a run believed dead. Elsewhere (plain python; macOS and Windows, which
    have no such signal) this does nothing."""
    import ctypes
    import signal

    if sys.platform != "linux" or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    # SIGKILL, since nothing may outlive the launcher and a kill is safe: checkpoints are written to a temporary
    # directory and renamed when complete. The kernel sends it when the *thread* that forked us exits; torchrun's
    # agent starts its workers from its main thread, whose exit is the launcher's.
    pr_set_pdeathsig = 1  # <linux/prctl.h>
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != LAUNCHER_PID:  # it died before the call, so no signal will come
        fail("the torchrun launcher of this worker has died")


def raise_open_file_limit() -> None:
    """The soft limit of open files raised to the hard one (often 1,024 of 1,048,576): every gloo pair a rank has
    exchanged with keeps a socket open for the run (token balancing's partners, over many steps, tend towards N - 1
    of them), next to vLLM's and the data's files. The limits are kept for the manifest (`open_file_limits`)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:  # an unlimited hard limit is capped by the kernel's nr_open: setrlimit refuses to go past it
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
    _open_file_limits.update(soft_at_start=soft, soft=resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard=hard)


def open_file_limits() -> dict[str, int]:
    """RLIMIT_NOFILE as this process found it and as it runs (after raise_open_file_limit)."""
    return dict(_open_file_limits)


def init_distributed() -> tuple[int, int, torch.device]:
    """Join (or, under plain python, create: a world of one, so the same collectives run either way) the process
    group. Returns (rank, world_size, device)."""
    global _save_group, _nccl_env_at_init
    die_with_launcher()
    raise_open_file_limit()
    if "RANK" not in os.environ:
        with socket.socket() as probe:  # a free port for the single-process group
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        _nccl_env_at_init = nccl_env()
        # gloo connects a pair of ranks when they first exchange data, not every pair at start-up: three world-sized
        # gloo groups (the default group's CPU side, the save group, vLLM's own) would hold 3 x (N - 1) sockets per
        # process, past common `ulimit -n` values at N = 1,024; the ring and tree collectives used touch a few peers
        os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", device_id=device if cuda else None)
        _save_group = dist.new_group(backend="gloo", timeout=SAVE_TIMEOUT)
    return dist.get_rank(), dist.get_world_size(), device


def nccl_env() -> dict[str, str]:
    return {key: value for key, value in sorted(os.environ.items()) if key.startswith("NCCL_")}


def keeping_trainer_nccl_env(start: Callable[[], T]) -> T:
    """`start()` (the rollout engine's start), then the NCCL_* variables as they were before it: the engine's pins
    (one channel, the Simple protocol, ...) are for the communicators it creates while starting, and would otherwise
    apply to any group the trainer creates later. What it changed is kept for the manifest."""
    before = nccl_env()
    try:
        return start()
    finally:
        after = nccl_env()
        _nccl_engine_pins.update({key: after.get(key) for key in before.keys() | after.keys()
                                  if before.get(key) != after.get(key)})
        for key in after.keys() - before.keys():
            del os.environ[key]
        os.environ.update(before)


def nccl_record() -> dict[str, object]:
    """For the manifest: the NCCL settings the trainer's communicator was created with, what the engine's start
    pinned for its own communicators (and was put back after it), those in force now, and NCCL's version."""
    version = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    return {"trainer_communicator": _nccl_env_at_init, "engine_pins": dict(_nccl_engine_pins), "now": nccl_env(),
            "version": ".".join(map(str, version)) if isinstance(version, tuple) else version}


def renew_save_group() -> None:
    """The save group again, over the default group as it is now (the split layout narrows it to one side)."""
    global _save_group
    _save_group = dist.new_group(backend="gloo", timeout=SAVE_TIMEOUT)


def save_group() -> dist.ProcessGroup:
    """The long-timeout gloo group for barriers and planning around checkpoint writes."""
    assert _save_group is not None, "init_distributed() first"
    return _save_group


# What must run while the process group still exists when `fail` leaves it: an embedded vLLM engine's shutdown
# destroys its own groups, and left to its exit handler, after the group is gone, it prints a traceback on every rank
# below the message that says why the run stopped.
_before_leaving: list[Callable[[], None]] = []


def run_before_leaving(action: Callable[[], None]) -> None:
    """Have `fail` run `action` (e.g. an engine's close) before it leaves the process group."""
    _before_leaving.append(action)


def fail(message: str, status: int = 2) -> None:
    """Stop with a clear message and exit code `status` (2: refused; the others: common/preemption.py). Call it on
    every rank (checks are cheap and identical), so no rank is left waiting in a collective."""
    sys.stderr.write(f"error: {message}\n")  # one write: ranks sharing a pipe (torchrun's) do not interleave lines
    sys.stderr.flush()
    while _before_leaving:
        with contextlib.suppress(Exception):  # the run stops for the reason above whatever a shutdown says
            _before_leaving.pop()()
    if dist.is_initialized():
        dist.destroy_process_group()
    end(status)


# The signals common.preemption catches. A process that is ending ignores them: Python gives a caught signal its
# default action back for its last moments, and torchrun sends SIGTERM to the ranks still exiting once one has
# exited, which would turn their status into -15.
STOP_SIGNALS_CAUGHT: list[int] = []


def end(status: int) -> None:
    """Exit with `status`, ignoring the stop signals from here on."""
    for number in STOP_SIGNALS_CAUGHT:
        signal.signal(number, signal.SIG_IGN)
    sys.exit(status)


def in_brief(error: BaseException) -> str:
    """An exception as its type and the first sentence of its message, not torch's paragraphs of advice."""
    message = str(error).strip().splitlines()[0].split(". ")[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def all_ranks_ok(ok: bool) -> bool:
    """True only when `ok` holds on every rank; use before a step that some rank might fail."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def reduce_stats(sums: dict[str, float | torch.Tensor], maxima: dict[str, float | torch.Tensor] | None = None
                 ) -> dict[str, float]:
    """Sum `sums` and take the max of `maxima` over ranks, by name: one all-reduce each, in float64 on the CPU.
    Call it once per step with everything accumulated (device tensors are fine), never per micro-batch."""
    result: dict[str, float] = {}
    for values, op in ((sums, dist.ReduceOp.SUM), (maxima or {}, dist.ReduceOp.MAX)):
        if values:
            names = sorted(values)
            packed = torch.stack([torch.as_tensor(values[name]).detach().to("cpu", torch.float64).reshape(())
                                  for name in names])
            dist.all_reduce(packed, op=op)
            result.update(zip(names, packed.tolist()))
    return result


class Totals:
    """A step's statistics by name, accumulated on the device as they come (micro-batch after micro-batch) and
    reduced over ranks once, when the step logs them: sums (shares of batch means, counts) and maxima."""

    def __init__(self) -> None:
        self.sums, self.maxima = {}, {}  # name -> a float or a (device) tensor

    def add(self, sums: dict[str, float | torch.Tensor], maxima: dict[str, torch.Tensor] | None = None,
            divisor: float = 1) -> None:
        """Add `sums`, each divided by `divisor` (to average over passes), and keep the running max of `maxima`."""
        for name, value in sums.items():
            self.sums[name] = self.sums.get(name, 0) + value / divisor
        for name, value in (maxima or {}).items():
            self.maxima[name] = torch.maximum(self.maxima[name], value) if name in self.maxima else value

    def reduce(self) -> dict[str, float]:
        """Every rank's totals, by name: one all-reduce for the sums and one for the maxima."""
        return reduce_stats(self.sums, self.maxima)


def all_gather_rows(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's `tensor` (the same shape everywhere), stacked: [group size, *tensor.shape], in one collective."""
    size = dist.get_world_size(group)
    out = torch.empty(size * tensor.shape[0] if tensor.dim() else size, *tensor.shape[1:], dtype=tensor.dtype,
                      device=tensor.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(out, tensor.contiguous(), group=group)  # the concatenated form: gloo accepts no other
    return out.view(size, *tensor.shape)


def check_shared_filesystem(path: Path, create: bool) -> None:
    """Every rank must see what rank 0 writes at `path` (all ranks write checkpoint shards into the run directory and
    read them back on resume): rank 0 writes a fresh token file into `path` (created when `create`, else its nearest
    existing directory, as rank 0 sees it), every rank looks for it under the same relative name (for up to 5 s: NFS
    may cache a directory's listing for a few seconds), and all stop with one message (exit 2) unless all found it.
    A collective; nothing to do in a world of one."""
    if dist.get_world_size() == 1:
        return
    box = [None, None]
    if dist.get_rank() == 0:
        if create:
            path.mkdir(parents=True, exist_ok=True)
        box = [secrets.token_hex(8), str(next(d for d in (path, *path.parents) if d.is_dir()))]
    dist.broadcast_object_list(box, src=0)
    directory = Path(box[1])
    token_file = directory / f".shared-fs-check-{box[0]}"
    if dist.get_rank() == 0:
        token_file.write_text(box[0])
    dist.barrier()
    deadline = time.time() + 5
    while not (seen := token_file.is_file() and token_file.read_text() == box[0]) and time.time() < deadline:
        time.sleep(0.5)
    blind = [rank for rank, ok in enumerate(all_gather_rows(torch.tensor([int(seen)])).flatten().tolist()) if not ok]
    if dist.get_rank() == 0:
        token_file.unlink()
    if blind:
        fail(f"{directory.resolve()} is not one shared file system for all ranks: rank(s) {blind} do not see the "
             f"file rank 0 wrote there (this is rank {dist.get_rank()} on {socket.gethostname()}). Every node must see "
             "the same path (NFS, Lustre, ...: every rank writes its checkpoint shards there and reads them on "
             "resume), and every agent must start in the same directory when the path is relative")
