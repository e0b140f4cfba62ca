"""Run under torchrun (2 ranks, gloo): hand-skewed rollouts (rank 0 long completions, rank 1 short ones, each row with
MoE routes as --routing-replay gives them), GRPO's loss and gradient over them as the script computes them, without
and with `balance_tokens`; writes a JSON summary to argv[1] for tests/test_balancing.py."""

import json
import random
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from common.determinism import parameter_hash
from common.distributed import all_gather_rows, init_distributed
from common.llm.balancing import balance_tokens
from common.llm.batching import micro_batches, split
from common.llm.models import load_model
from common.llm.run import LLMRun, Rollout, Sample
from grpo_llm import aggregate_loss, grpo_token_loss, truncated_importance_weight

TINY = "assets/tiny-adder"
GROUPS, G, MICRO_BATCH_SIZE = 4, 2, 4


def skewed_rollout(rank: int, world_size: int) -> tuple[Rollout, torch.Tensor]:
    draw = random.Random(rank)
    prompts = [[draw.randrange(3, 15) for _ in range(draw.randint(3, 7))] for _ in range(GROUPS) for _ in range(G)]
    for row in range(1, len(prompts), 2):  # each group's G rows share their prompt
        prompts[row] = prompts[row - 1]
    longest = 40 if rank == 0 else 6  # the skew: rank 0 drew the long completions
    samples = []
    for prompt in prompts:
        ids = [draw.randrange(3, 15) for _ in range(draw.randint(longest // 2, longest))]
        routes = torch.tensor([draw.randrange(4) for _ in range((len(prompt) + len(ids)) * 4)], dtype=torch.int16)
        samples.append(Sample(ids, [-draw.random() for _ in ids], truncated=draw.random() < 0.3,
                              routes=routes.view(-1, 2, 2)))  # a MoE model's routes (--routing-replay) travel too
    mine = torch.tensor([[len(p), len(s.completion_ids)] for p, s in zip(prompts, samples)])
    rollout = Rollout(prompts, [], samples, [s.completion_ids for s in samples], [], torch.empty(0), torch.empty(0),
                      all_gather_rows(mine), time.time(), 0.0, {}, 1, 0, [])
    advantages = torch.tensor([draw.gauss(0, 1) for _ in prompts])
    return rollout, advantages


def loss_and_gradient(policy: torch.nn.Module, run: LLMRun, rollout: Rollout, advantages: torch.Tensor,
                      micro_batch_rows: list, share_prompts: bool, num_tokens: int, num_sequences: int) -> dict:
    from common.llm.batching import token_logprobs

    total = torch.zeros(())
    for batch, rows in zip(micro_batches(rollout, micro_batch_rows, run, share_prompts), micro_batch_rows):
        logprobs = token_logprobs(policy, batch, 1.0)
        old = batch.rollout_logprobs - 0.1
        per_token = grpo_token_loss(logprobs - old, truncated_importance_weight(old, batch.rollout_logprobs, 2.0),
                                    logprobs, None, advantages[list(rows), None], 0.2, 0.28, 0.0)
        loss = aggregate_loss(per_token, batch.mask, "dapo", num_sequences, num_tokens, 40)
        (loss * dist.get_world_size()).backward()
        total += loss.detach()
    dist.all_reduce(total)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), 1e9).full_tensor())
    gradient_hash = parameter_hash({name: p.grad for name, p in policy.named_parameters()})
    policy.zero_grad(set_to_none=True)
    return {"loss": float(total), "grad_norm": grad_norm, "gradient_sha256": gradient_hash}


def main() -> None:
    rank, world_size, device = init_distributed()
    args = SimpleNamespace(dtype="float32", gradient_checkpointing=False, reshard_after_forward=False,
                           fsdp_shard_size=0)
    run = SimpleNamespace(rank=rank, world_size=world_size, device=device, pad_id=0)
    policy = load_model(TINY, args, device)
    summary: dict[str, object] = {}
    for share_prompts in (False, True):
        rollout, advantages = skewed_rollout(rank, world_size)
        counts = torch.tensor([sum(map(len, rollout.completions)), len(rollout.samples)])
        dist.all_reduce(counts)
        num_tokens, num_sequences = counts.tolist()
        micro_batch_rows = split(range(len(rollout.samples)), MICRO_BATCH_SIZE)
        results = {"unbalanced": loss_and_gradient(policy, run, rollout, advantages, micro_batch_rows, share_prompts,
                                                   num_tokens, num_sequences)}
        for attempt in ("balanced", "balanced_again"):
            moved, moved_advantages, moved_pieces = balance_tokens(rollout, run, advantages[:, None],
                                                                   G if share_prompts else 1, MICRO_BATCH_SIZE, 0)
            results[attempt] = loss_and_gradient(policy, run, moved, moved_advantages[:, 0], moved_pieces,
                                                 share_prompts, num_tokens, num_sequences)
        rows_before = sorted((tuple(p), tuple(s.completion_ids), tuple(s.logprobs), s.truncated, float(a),
                              tuple(s.routes.flatten().tolist()))
                             for p, s, a in zip(rollout.prompts, rollout.samples, advantages))
        rows_after = sorted((tuple(p), tuple(s.completion_ids), tuple(s.logprobs), s.truncated, float(a),
                             tuple(s.routes.flatten().tolist()))
                            for p, s, a in zip(moved.prompts, moved.samples, moved_advantages[:, 0]))
        every_before: list = [None] * world_size
        every_after: list = [None] * world_size
        dist.all_gather_object(every_before, rows_before)
        dist.all_gather_object(every_after, rows_after)
        tokens = torch.tensor([sum(len(p) + len(c) for p, c in zip(rollout.prompts, rollout.completions)),
                               sum(len(p) + len(c) for p, c in zip(moved.prompts, moved.completions))])
        results["tokens_per_rank"] = all_gather_rows(tokens).tolist()  # [rank][before, after]
        results["micro_batches_per_rank"] = all_gather_rows(torch.tensor([len(moved_pieces)])).flatten().tolist()
        results["same_rows"] = sorted(r for part in every_before for r in part) == \
            sorted(r for part in every_after for r in part)
        summary["shared" if share_prompts else "padded"] = results
    if rank == 0:
        with open(sys.argv[1], "w") as handle:
            json.dump(summary, handle, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
