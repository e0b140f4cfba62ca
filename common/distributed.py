"""One code path for `python X.py` and `torchrun --nproc_per_node N X.py`. The collective rule: the default group
carries gloo for CPU tensors and NCCL for CUDA tensors (`cpu:gloo,cuda:nccl`); training tensors (gradients, FSDP
shards) go through NCCL, bookkeeping (statistics, counts, flags, objects) stays on the CPU and goes through gloo, so
it never forces a device round trip and is valid on every backend."""

import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist

# Saving a checkpoint can keep one rank busy for minutes (a 7B export) while the others wait: their waits use a
# separate gloo group with this timeout instead of the default group's.
SAVE_TIMEOUT = datetime.timedelta(hours=2)
_save_group: dist.ProcessGroup | None = None
# The NCCL_* variables when the default group's communicator was created (eagerly, with device_id): NCCL reads most
# of them once, at the process's first communicator, so the trainer keeps these even after vLLM pins its own.
_nccl_env_at_init: dict[str, str] = {}


def init_distributed() -> tuple[int, int, torch.device]:
    """Join (or, under plain python, create: a world of one, so the same collectives run either way) the process
    group. Returns (rank, world_size, device)."""
    global _save_group, _nccl_env_at_init
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
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", device_id=device if cuda else None)
        _save_group = dist.new_group(backend="gloo", timeout=SAVE_TIMEOUT)
    return dist.get_rank(), dist.get_world_size(), device


def nccl_env() -> dict[str, str]:
    return {key: value for key, value in sorted(os.environ.items()) if key.startswith("NCCL_")}


def nccl_record() -> dict[str, object]:
    """For the manifest: the NCCL settings the trainer's communicator was created with, those in force now (after
    vLLM started and pinned its own for its communicators), and NCCL's version."""
    version = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    return {"trainer_communicator": _nccl_env_at_init, "after_engine_start": nccl_env(),
            "version": ".".join(map(str, version)) if isinstance(version, tuple) else version}


def save_group() -> dist.ProcessGroup:
    """The long-timeout gloo group for barriers and planning around checkpoint writes."""
    assert _save_group is not None, "init_distributed() first"
    return _save_group


def fail(message: str) -> None:
    """Stop with a clear message and exit code 2. Call it on every rank (checks are cheap and identical), so no rank
    is left waiting in a collective."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(2)


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
