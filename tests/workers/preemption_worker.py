"""Two gloo ranks under torchrun meet where the scripts meet at a step's end: a stop signal that reached rank 1 only
stops both; a checkpoint whose part fails on rank 1 only fails on both, its partial directory removed; a failed log
write on rank 0 stops both with rank 0's message (exit 4). Each rank writes what it saw to SUMMARIES/rank{N}.json
before that end (a file each: two ranks printing to torchrun's one pipe at once can interleave their lines).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/workers/preemption_worker.py \
        CHECKPOINTS SUMMARIES
"""

import errno
import json
import os
import signal
import sys
from pathlib import Path

from common.checkpoint import CheckpointWriteFailed, save_checkpoint
from common.distributed import init_distributed
from common.preemption import DEFAULT_STOP_SIGNALS, catch_stop_signals, step_boundary

rank, world_size, _ = init_distributed()
catch_stop_signals(DEFAULT_STOP_SIGNALS)  # SIGTERM too: torchrun sends it to the rank still exiting
root = Path(sys.argv[1])
summary = {"before": step_boundary()}
if rank == 1:
    os.kill(os.getpid(), signal.SIGUSR1)
summary["after"] = step_boundary()


def write(directory: Path) -> None:
    (directory / f"part{rank}").write_bytes(b"half")
    if rank == 1:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / "part1"))


save_checkpoint(root, 1, lambda directory: (directory / f"part{rank}").write_bytes(b"whole"), keep_last=0)
try:
    save_checkpoint(root, 2, write, keep_last=0)
except CheckpointWriteFailed as error:
    summary["failed"] = str(error)
summary["left"] = sorted(p.name for p in root.iterdir())
(Path(sys.argv[2]) / f"rank{rank}.json").write_text(json.dumps(summary))
step_boundary("rank 0 could not write its log" if rank == 0 else None)
