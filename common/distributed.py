"""One code path for `python X.py` and `torchrun --nproc_per_node N X.py`."""

import os
import socket
import sys

import torch
import torch.distributed as dist


def init_distributed() -> tuple[int, int, torch.device]:
    """Join (or, under plain python, create) the process group. Returns (rank, world_size, device).

    Plain python becomes a world of one, so every script runs the same collectives either way.
    NCCL on GPUs, gloo on CPU.
    """
    if "RANK" not in os.environ:
        with socket.socket() as probe:  # a free port for the single-process group
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


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
    flag = torch.tensor([int(ok)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
