"""Rollout throughput of the rollout engines on the same model and prompts: vLLM vs the transformers fallback.

Each rank generates its share of `num_prompts x num_generations` samples (per-sample seeds, as in training); the
printed number is sampled tokens per second over all ranks, timed after a warm-up call.

    python benchmarks/rollout_throughput.py --engine hf
    torchrun --nproc_per_node 2 benchmarks/rollout_throughput.py --engine vllm
"""

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.determinism import seed_everything  # noqa: E402
from common.distributed import init_distributed  # noqa: E402
from common.llm.engines import make_engine, sample_seed  # noqa: E402
from tasks import AdditionTask  # noqa: E402


@dataclass
class Args:
    engine: Literal["vllm", "hf"] = "vllm"
    """the rollout engine to measure"""
    model_name_or_path: str = str(Path(__file__).resolve().parent.parent / "assets" / "tiny-adder")
    """the model (default: the embedded addition model)"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """the engine's dtype"""
    num_prompts: int = 64
    """prompts per call, across all ranks"""
    num_generations: int = 8
    """samples per prompt"""
    max_tokens: int = 8
    """tokens sampled per completion at most"""
    repeats: int = 5
    """timed calls (after one warm-up call)"""


if __name__ == "__main__":
    args = tyro.cli(Args)
    seed_everything(1)
    rank, world_size, device = init_distributed()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    task = AdditionTask(num_train=args.num_prompts)
    per_rank = args.num_prompts // world_size
    prompts = [tokenizer(e.prompt).input_ids for e in task.train[rank * per_rank:(rank + 1) * per_rank]]
    engine = make_engine(args.engine, args.model_name_or_path, args.dtype, 1, 64, device, 64 * 2**20, 0.5)
    batch = [p for p in prompts for _ in range(args.num_generations)]
    tokens, seconds = torch.zeros(1, dtype=torch.float64), 0.0
    for call in range(args.repeats + 1):
        seeds = [sample_seed(1, call, rank * per_rank + i // args.num_generations, i % args.num_generations)
                 for i in range(len(batch))]
        dist.barrier()
        start = time.time()
        samples = engine.generate(batch, seeds, args.max_tokens, 1.0, [tokenizer.eos_token_id])
        dist.barrier()
        if call > 0:  # the first call is the warm-up
            seconds += time.time() - start
            tokens += sum(len(s.completion_ids) for s in samples)
    dist.all_reduce(tokens)
    if rank == 0:
        threads = os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads()))
        launcher = f"torchrun --nproc_per_node {world_size} " if world_size > 1 else "python "
        print(f"command: {launcher}{' '.join(sys.argv)}")
        print(f"engine={args.engine} world_size={world_size} threads_per_rank={threads} "
              f"samples_per_call={args.num_prompts * args.num_generations} max_tokens={args.max_tokens}: "
              f"{tokens.item() / seconds:,.0f} sampled tokens/s")
    engine.close()
    dist.destroy_process_group()
