"""What creating process groups costs as the rollout ranks grow (issue 39, item 10): vLLM's external launcher, in the
split layout, builds its own groups over the K rollout ranks (world, TP, PP, DP, EP: about 5 of them, each made by
every rank). Times 5 x K `dist.new_group` calls (each over all K ranks, as world-sized groups are, and with
use_local_synchronization=False as vLLM calls it) on K gloo ranks, and prints one JSON line from rank 0.

    torchrun --nproc_per_node K benchmarks/new_group_cost.py
"""

import json
import os
import time

import torch.distributed as dist


def main() -> None:
    os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")  # as common/distributed.py starts gloo
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(5 * world):
        dist.new_group(list(range(world)), backend="gloo")
    dist.barrier()
    seconds = time.perf_counter() - started
    if dist.get_rank() == 0:
        print(json.dumps({"ranks": world, "groups": 5 * world, "seconds": round(seconds, 3),
                          "ms_per_group": round(1000 * seconds / (5 * world), 2)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
