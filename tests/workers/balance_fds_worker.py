"""Run under torchrun (8 gloo ranks): 200 steps of token balancing over rollouts of random lengths, the ranks taken
for nodes of argv[2] each (as torchrun's --nproc_per_node would make them); writes, per rank, the peers it exchanged
rows with and its open sockets before and after, to argv[1]/rank_R.json, for tests/test_balancing.py."""

import json
import os
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from common import distributed
from common.distributed import all_gather_rows, init_distributed
from common.llm import balancing
from common.llm.run import Rollout, Sample

STEPS, ROWS = 200, 8


def sockets() -> int:
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{name}").startswith("socket:")
        except OSError:
            continue
    return count


def main() -> None:
    out, node = Path(sys.argv[1]), int(sys.argv[2])
    distributed.LOCAL_WORLD_SIZE_AT_LAUNCH = node  # balancing's groups are the nodes
    rank, world_size, _ = init_distributed()
    run = SimpleNamespace(rank=rank, world_size=world_size)
    peers: set[int] = set()
    exchange = balancing.exchange

    def watched(outgoing: list, incoming_sizes: list, dtype: torch.dtype) -> list:
        peers.update(p for p, values in enumerate(outgoing) if values and p != rank)
        peers.update(p for p, size in enumerate(incoming_sizes) if size and p != rank)
        return exchange(outgoing, incoming_sizes, dtype)

    balancing.exchange = watched
    draw = random.Random(rank)
    before = None
    for step in range(STEPS):
        prompts = [[draw.randrange(3, 15) for _ in range(draw.randint(2, 5))] for _ in range(ROWS)]
        samples = [Sample(ids, [-0.5] * len(ids), False) for ids in
                   ([draw.randrange(3, 15) for _ in range(int(draw.paretovariate(1.2) * 4))] for _ in range(ROWS))]
        mine = torch.tensor([[len(p), len(s.completion_ids)] for p, s in zip(prompts, samples)])
        rollout = Rollout(prompts, [], samples, [s.completion_ids for s in samples], [], torch.empty(0),
                          torch.empty(0), all_gather_rows(mine), time.time(), 0.0, {}, step, 0, [])
        balancing.balance_tokens(rollout, run, torch.zeros(ROWS, 1), 1, 4, 0)
        if step == 0:
            before = sockets()
    (out / f"rank_{rank}.json").write_text(json.dumps({"peers": sorted(peers), "sockets_after_step_1": before,
                                                       "sockets_at_end": sockets()}))


if __name__ == "__main__":
    main()
