"""GRPO: Group Relative Policy Optimization for LLMs with verifiable rewards, on an embedded vLLM engine.

Paper: Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
arXiv:2402.03300 (GRPO, section 4). Options, each a small function below chosen in one place: DAPO's clip-higher,
token-level loss, dynamic sampling and overlong shaping (arXiv:2503.14476), Dr. GRPO's normalisation (arXiv:2503.20783),
GSPO's sequence ratio (arXiv:2507.18071), CISPO (arXiv:2506.13585), RLOO and REINFORCE++ advantages.

In plain words: with one update per batch (the default mu = k = 1) the ratio is 1 and GRPO is token-level REINFORCE
with group-normalised advantages (score minus the group's mean, over its std); the clip (and GSPO's and CISPO's
ratio) acts only over mu passes of k minibatches. The one correction that always acts is truncated importance
sampling (TIS): the engine's probabilities differ slightly from the trainer's, so each token is reweighted by
min(pi_old / pi_rollout, cap).

Each torchrun rank holds one vLLM engine for rollouts and one FSDP2 shard of the policy for training; after every
update the weights stream into the engine. Same arguments + same machine + same world size = same bits. With
`--rollout-ranks K` the last K ranks only generate and the others only train (common/llm/layout.py), and with
`--max-staleness 1` batch t + 1 is sampled while batch t trains: pi_rollout is then the policy before the previous
update, TIS corrects for it, and `--seq-mask-cap` drops the completions that moved furthest. The schedule is fixed,
so the split layout keeps the same-bits promise (at the same K).

    torchrun --nproc_per_node 2 grpo_llm.py --seed 1
    torchrun --nproc_per_node 2 grpo_llm.py --seed 1 --rollout-ranks 1 --max-staleness 1
"""

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import torch.distributed as dist
import tyro

from common.distributed import Totals, fail, reduce_stats
from common.llm.attention import PACKED_ATTENTION, PADDED_ATTENTION
from common.llm.balancing import balance_tokens
from common.llm.batching import micro_batches, mismatch_stats, split, token_logprobs
from common.llm.checks import check_llm_args
from common.llm.lifecycle import end_step, finish, prepare_run, start_training
from common.llm.lora import adapters_disabled, lora_spec
from common.llm.models import all_reduce_at_last, load_model, make_optimizer, optimizer_step
from common.llm.rollouts import generate, sync_weights
from common.llm.run import LLMArgs
from common.tracking import get_logger


@dataclass
class Args(LLMArgs):
    """GRPO's own flags. The shared ones (model, task, steps, prompts, G, optimizer, engine, FSDP, evaluation,
    checkpoints) and their defaults: LLMArgs in common/llm/run.py."""
    exp_name: str = "grpo_llm"
    """the name of this experiment (the run directory is runs/{exp_name}__{seed}__{timestamp})"""
    loss_type: Literal["grpo", "dapo", "dr_grpo"] = "dapo"
    """grpo: mean over each sequence, then over sequences; dapo: mean over all tokens of the batch;
    dr_grpo: sum over tokens divided by (sequences x max_completion_length)"""
    advantage: Literal["group", "rloo", "reinforce_pp"] = "group"
    """group: GRPO's (score - group mean, scaled by --scale-advantages); rloo: score - the mean of the group's
    other G - 1; reinforce_pp: REINFORCE++'s group mean baseline, normalised over the batch"""
    scale_advantages: Annotated[Literal["group", "batch", "none"], tyro.conf.arg(aliases=("--scale-rewards",))] = \
        "group"
    """--advantage group: divide by the std of the group's scores, of the batch's, or not at all (Dr. GRPO); TRL's
    --scale-rewards"""
    policy_loss: Literal["clip", "cispo"] = "clip"
    """clip: PPO's clipped surrogate; cispo: REINFORCE weighted by the clipped ratio (clipped tokens keep gradient)"""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """token: pi / pi_old per token; sequence: GSPO's geometric mean over each completion (needs --loss-type grpo)"""
    clip_eps_low: float = 0.2
    """lower clip range of the importance ratio (1 - eps_low)"""
    clip_eps_high: float = 0.28
    """upper clip range (1 + eps_high); above eps_low is DAPO's clip-higher"""
    beta: float = 0.0
    """KL coefficient to the frozen reference model (k3 estimator, in the loss); 0 loads no reference model"""
    num_iterations: int = 1
    """mu: passes over each batch of rollouts (old logprobs come from the trainer before the first update)"""
    num_minibatches: int = 1
    """k: minibatches of whole groups per pass, one optimizer step each (this rank's prompts must divide evenly)"""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment over the last this many tokens of --max-completion-length; 0: off"""
    tis_cap: float = 2.0
    """truncated importance sampling: weight tokens by min(pi_old / pi_rollout, cap); 0 turns it off"""
    seq_mask_cap: float = 0.0
    """masked importance sampling: drop completions whose geometric-mean ratio pi_old / pi_rollout leaves
    [1/c, c] (for a stale sampler, --max-staleness 1); 0 turns it off"""
    balance_tokens: bool = False
    """after the advantages, move completions between ranks so that each trains on nearly the same number of tokens
    (FSDP's lock step makes every micro-batch cost the slowest rank's): for long-tailed completion lengths"""
    micro_batch_tokens: int = 0
    """with --balance-tokens: micro-batches of at most this many tokens, padding included (0: --micro-batch-size)"""
    share_prompts: bool = True
    """the G completions of a prompt share one forward of the prompt (one packed row, block attention mask): same
    values, fewer tokens. Attention then spans the whole packed row (FlexAttention's block-sparse kernel on GPUs),
    so it pays for short completions; measure before keeping it for long ones"""


def check_args(args: Args, world_size: int) -> None:
    """Reject bad input on every rank, before any collective can hang (the shared checks, then GRPO's own)."""
    check_llm_args(args, world_size)
    if args.num_iterations <= 0 or args.num_minibatches <= 0:
        fail(f"--num-iterations and --num-minibatches must be positive, got {args.num_iterations} and "
             f"{args.num_minibatches}")
    per_rank = args.prompts_per_step // (world_size - args.rollout_ranks)
    if per_rank % args.num_minibatches:
        fail(f"--num-minibatches {args.num_minibatches} must divide the {per_rank} prompts per trainer rank: each "
             "minibatch takes whole groups")
    if args.num_minibatches > 1 and args.balance_tokens:
        fail("--balance-tokens plans one batch: use it with --num-minibatches 1")
    if (args.scale_advantages == "group" or args.advantage != "group") and args.num_generations < 2:
        fail("--num-generations must be at least 2: a group's baseline (or std) needs its other samples")
    if args.advantage != "group" and args.scale_advantages != "group":
        fail("--scale-advantages belongs to --advantage group (rloo is unscaled, reinforce_pp uses the batch std)")
    if args.importance_sampling_level == "sequence" and args.loss_type != "grpo":
        fail(f"--importance-sampling-level sequence (GSPO) needs --loss-type grpo, got {args.loss_type}")
    if not 0 <= args.overlong_buffer <= args.max_completion_length:
        fail(f"--overlong-buffer must be in [0, --max-completion-length], got {args.overlong_buffer}")
    if args.micro_batch_tokens < 0 or (args.micro_batch_tokens and not args.balance_tokens):
        fail("--micro-batch-tokens must be non-negative and needs --balance-tokens")
    if args.clip_eps_low < 0 or args.clip_eps_high < 0 or args.beta < 0 or args.tis_cap < 0:
        fail("--clip-eps-low, --clip-eps-high, --beta and --tis-cap must be non-negative")
    if args.seq_mask_cap and args.seq_mask_cap <= 1:
        fail(f"--seq-mask-cap must be 0 (off) or above 1, got {args.seq_mask_cap}")


# ============================================================================================
# ALGORITHM: advantages, the importance ratio, the surrogate with TIS and KL, and its aggregation
# ============================================================================================


def group_advantages(scores: torch.Tensor, scale_advantages: str, eps: float = 1e-4) -> torch.Tensor:
    """scores: [num_prompts, G]. DeepSeekMath eq. in sec. 4.1.2 (outcome supervision):
    A_i = (r_i - mean(r_group)) / std(r_group), the same advantage for every token of completion i.
    `batch` divides by the std of the whole batch instead; `none` only centres (Dr. GRPO)."""
    centered = scores - scores.mean(dim=1, keepdim=True)
    if scale_advantages == "group":
        return centered / (scores.std(dim=1, keepdim=True) + eps)
    if scale_advantages == "batch":
        return centered / (scores.std() + eps)
    return centered


def rloo_advantages(scores: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al., arXiv:2402.14740): the baseline of
    completion i is the mean of its group's other G - 1 scores, A_i = r_i - (sum_j r_j - r_i) / (G - 1), which is
    G / (G - 1) times GRPO's unscaled advantage (--scale-advantages none). Unbiased: no r_i in its own baseline."""
    return scores - (scores.sum(dim=1, keepdim=True) - scores) / (scores.shape[1] - 1)


def reinforce_pp_advantages(scores: torch.Tensor, lengths: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """REINFORCE++ with a baseline (Hu et al., arXiv:2501.03262, the variant for outcome rewards): subtract the
    group's mean, then whiten over the batch's tokens (as its OpenRLHF code and verl do: each completion weighs its
    `lengths`, every token of an episode), A = (a - mean(a)) / std(a) with a_i = r_i - mean(r_group)."""
    centered = scores - scores.mean(dim=1, keepdim=True)
    mean = (centered * lengths).sum() / lengths.sum()
    return (centered - mean) / (((centered - mean) ** 2 * lengths).sum() / lengths.sum()).sqrt().add(eps)


def token_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The log of DeepSeekMath eq. 3's importance ratio, per token: log r_t = log pi(o_t) - log pi_old(o_t). [B, C]."""
    return logprobs - old_logprobs


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO (Zheng et al., arXiv:2507.18071, sec. 4): one ratio per completion, the geometric mean of its token
    ratios, s_i = exp((1/|o_i|) sum_t log(pi / pi_old)), as GSPO-token's s_it = sg[s_i] pi(o_it) / sg[pi(o_it)]: value
    s_i on every token, gradient s_i grad log pi(o_it), so with --loss-type grpo (and TIS off, --tis-cap 0) the
    gradient is GSPO's. With one update per batch s_i = 1, the clip never acts: GRPO with --loss-type grpo. [B, C]."""
    mean = ((logprobs - old_logprobs) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    return mean.detach() + logprobs - logprobs.detach()


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int) -> torch.Tensor:
    """DAPO eq. 13 (soft overlong punishment): 0 up to max_length - buffer tokens, then -(|o| - (max_length -
    buffer)) / buffer, down to -1 at max_length (longer ones cannot be sampled). Added to the score."""
    return -(lengths - (max_length - buffer)).clamp(min=0) / buffer


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """DeepSeekMath eq. 4 (Schulman's k3): KL ~ pi_ref/pi - log(pi_ref/pi) - 1, unbiased and always >= 0."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def clipped_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, clip_eps_low: float, clip_eps_high: float
                      ) -> torch.Tensor:
    """DeepSeekMath eq. 3 (PPO's clipped objective per token), negated to a loss; DAPO eq. 10 for the asymmetric
    clip range: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) for the importance ratio r (token or sequence)."""
    ratio = torch.exp(log_ratio)
    return -torch.min(ratio * advantages, torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * advantages)


def clip_active(log_ratio: torch.Tensor, advantages: torch.Tensor, clip_eps_low: float, clip_eps_high: float
                ) -> torch.Tensor:
    """1.0 where eq. 3's clipped term is the smaller one (the token then gives no gradient), else 0.0."""
    ratio = torch.exp(log_ratio)
    return (torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * advantages < ratio * advantages).float()


def cispo_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, clip_eps_low: float, clip_eps_high: float
                    ) -> torch.Tensor:
    """CISPO (MiniMax-M1, arXiv:2506.13585, sec. 3.1): -sg[clip(r, 1 - eps_low, 1 + eps_high)] A log pi, written with
    exp(log r - sg[log r]) (value 1) for log pi: gradient -clip(r) A grad log pi on every token, clipped ones too."""
    weight = torch.clamp(torch.exp(log_ratio), 1 - clip_eps_low, 1 + clip_eps_high).detach()
    return -weight * advantages * torch.exp(log_ratio - log_ratio.detach())


def weight_clipped(log_ratio: torch.Tensor, advantages: torch.Tensor, clip_eps_low: float, clip_eps_high: float
                   ) -> torch.Tensor:
    """1.0 where CISPO's weight clip(r) is not r (the token still gives gradient, with the clipped weight)."""
    ratio = torch.exp(log_ratio)
    return ((ratio < 1 - clip_eps_low) | (ratio > 1 + clip_eps_high)).float()


def truncated_importance_weight(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float
                                ) -> torch.Tensor:
    """TIS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"): the tokens were
    drawn from the engine's pi_rollout, so weight each by min(pi_old / pi_rollout, cap); a constant, no gradient.
    cap 0 turns it off (weight 1). [B, C], like the logprobs."""
    if cap <= 0:
        return torch.ones_like(old_logprobs)
    return torch.exp(old_logprobs - rollout_logprobs).clamp(max=cap).detach()


def sequence_mask(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, cap: float
                  ) -> torch.Tensor:
    """Masked importance sampling at the sequence level (verl's rollout correction, docs/algo/rollout_corr.md, and
    slime's MIS): completion i is judged by the geometric mean of its token ratios over its mask,
    rho_i = exp(mean_t log(pi_old / pi_rollout)), and dropped (weight 0) when rho_i leaves [1/cap, cap]; the others
    keep weight 1 (as does a completion with no masked-in token). [B, 1]. It does not reweight: a stale sampler's most
    off-policy completions give no gradient at all, and the batch's normalisers still count them."""
    mean_log_ratio = ((old_logprobs - rollout_logprobs) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True
                                                                                                  ).clamp(min=1)
    return (mean_log_ratio.abs() <= math.log(cap)).to(old_logprobs.dtype)


def rollout_correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                       tis_cap: float, seq_mask_cap: float) -> torch.Tensor:
    """Each token's weight for having been sampled by the engine (a step older in the split layout with
    --max-staleness 1, where pi_rollout is the policy before the previous update): TIS, times the sequence mask when
    --seq-mask-cap is on. [B, C], no gradient."""
    weight = truncated_importance_weight(old_logprobs, rollout_logprobs, tis_cap)
    return weight * sequence_mask(old_logprobs, rollout_logprobs, mask, seq_mask_cap) if seq_mask_cap else weight


def grpo_token_loss(log_ratio: torch.Tensor, correction: torch.Tensor, logprobs: torch.Tensor,
                    ref_logprobs: torch.Tensor | None, advantages: torch.Tensor, clip_eps_low: float,
                    clip_eps_high: float, beta: float, surrogate: Callable = clipped_surrogate) -> torch.Tensor:
    """The summand of DeepSeekMath eq. 3 as a loss, per token [B, C]: the surrogate (clipped, or CISPO's) of the
    importance ratio, weighted by the rollout correction `correction`, plus beta times the k3 KL to the reference
    (eq. 4) when there is one. advantages: [B, 1]."""
    per_token = surrogate(log_ratio, advantages, clip_eps_low, clip_eps_high) * correction
    if ref_logprobs is not None:
        per_token = per_token + beta * k3_kl(logprobs, ref_logprobs)
    return per_token


def aggregate_loss(per_token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str, num_sequences: int,
                   num_tokens: int, max_completion_length: int) -> torch.Tensor:
    """Reduce a micro-batch's per-token loss [B, C] to its share of the batch loss, so that summing over micro-batches
    and ranks gives the batch loss. `num_sequences` and `num_tokens` count the whole batch (all ranks).
    grpo: (1/N) sum_i (1/|o_i|) sum_t l_it (DeepSeekMath eq. 3); dapo: sum_it l_it / sum_i |o_i| (DAPO eq. 8);
    dr_grpo: sum_it l_it / (N * max_completion_length) (Dr. GRPO eq. 2)."""
    masked = per_token_loss * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / num_sequences
    if loss_type == "dapo":
        return masked.sum() / num_tokens
    return masked.sum() / (num_sequences * max_completion_length)


if __name__ == "__main__":
    args = tyro.cli(Args)
    check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    run = prepare_run(args)  # seeds, process group, tokenizer, prompts, the checkpoint to resume from (PLUMBING)
    rank, world_size, device = run.rank, run.world_size, run.device
    share_prompts = args.share_prompts and not run.family.packing_problem  # e.g. linear attention: padded rows
    if args.share_prompts and not share_prompts and rank == 0:
        get_logger(rank).warning(f"--share-prompts is off for this model: {run.family.packing_problem}")

    # --- models: the policy (with --lora-rank, adapters over a frozen base) and, with --beta > 0, the frozen
    # reference: the run's starting model (also on resume), with LoRA the policy with its adapters switched off
    # packed rows (--share-prompts) attend through FlexAttention's block mask on GPUs, through SDPA on CPU
    attention = PACKED_ATTENTION if share_prompts and device.type == "cuda" else PADDED_ATTENTION
    policy = load_model(args.model_name_or_path, args, device, attn_implementation=attention, lora=lora_spec(args))
    reference = None if args.beta == 0 else policy if args.lora_rank else load_model(
        args.model_name_or_path, args, device, trainable=False, attn_implementation=attention)
    updates = args.num_iterations * args.num_minibatches  # optimizer steps per batch of rollouts
    optimizer, scheduler = make_optimizer(policy, args, args.learning_rate, args.total_steps * updates)
    trained = {"policy": (policy, optimizer)}
    engine, tracker, start_step = start_training(run, trained, [scheduler], updates_per_step=updates)
    # the options, each a function above, chosen here once
    estimate_advantages = {"group": lambda scores, _: group_advantages(scores, args.scale_advantages),
                           "rloo": lambda scores, _: rloo_advantages(scores),
                           "reinforce_pp": reinforce_pp_advantages}[args.advantage]  # (scores, lengths) [P, G]
    importance_log_ratio = {"token": token_log_ratio, "sequence": sequence_log_ratio}[args.importance_sampling_level]
    surrogate, clip_statistic = {"clip": (clipped_surrogate, clip_active),
                                 "cispo": (cispo_surrogate, weight_clipped)}[args.policy_loss]

    for step in range(start_step + 1, args.total_steps + 1):
        # --- rollouts: G samples per prompt on this rank's engine, scored by the task (PLUMBING) ---
        rollout = generate(engine, run, step)  # --dynamic-sampling-rounds: groups of unequal scores, refilled
        scores, lengths = rollout.task_scores, rollout.lengths[:, :, 1].to(rollout.task_scores.dtype)  # all ranks'
        if args.overlong_buffer:
            scores = scores + overlong_penalty(lengths[rank], args.max_completion_length, args.overlong_buffer)

        # ================================ ALGORITHM ================================
        # What the loss receives, per micro-batch `batch` of B completions (common/llm/batching.py):
        #   logprobs      [B, C] log pi_theta(token | prompt, earlier tokens) after temperature, with gradient;
        #   old_logprobs  under the policy before this batch's first update (with one update: = logprobs);
        #   rollout_logprobs (batch.rollout_logprobs) under the engine that sampled them; ref_logprobs under the
        #   frozen reference. All four are exactly 0.0 where batch.mask [B, C] is 0 (padding, a tool's tokens).
        #   advantages [B, 1]: one per completion. The loss is the micro-batch's share of its minibatch's loss
        #   (counts over all ranks); FSDP averages gradients over ranks, hence the backward of loss * world_size.
        # --- advantages over the global batch ---
        all_scores = [torch.zeros_like(scores) for _ in range(world_size)]
        dist.all_gather(all_scores, scores)
        grouped = torch.cat(all_scores).view(args.prompts_per_step, args.num_generations)
        advantages = estimate_advantages(grouped, lengths.view(grouped.shape)).flatten().view(world_size, -1)[rank]
        # --- minibatches: consecutive whole groups of this rank's rows, each cut into micro-batches ---
        minibatches = split(range(len(rollout.samples)), len(rollout.samples) // args.num_minibatches)
        counts = reduce_stats({"tokens": sum(s.model_tokens() for s in rollout.samples),  # the model's, not the env's
                               "sequences": len(rollout.samples),
                               "truncated": sum(s.truncated for s in rollout.samples), "correct": sum(rollout.correct),
                               **{f"minibatch_tokens/{u}": sum(rollout.samples[r].model_tokens() for r in minibatch)
                                  for u, minibatch in enumerate(minibatches)}})
        num_tokens, num_sequences = int(counts["tokens"]), int(counts["sequences"])

        # --- update: mu passes over k minibatches, one optimizer step each, gradient accumulation over micro-batches
        train_start = time.time()
        policy.eval()  # dropout off, as in the engine and the reference: every forward sees one network
        micro_batch_rows = [rows for minibatch in minibatches for rows in split(minibatch, args.micro_batch_size)]
        if args.balance_tokens:  # (PLUMBING) equal tokens per rank; the advantages travel with their completions
            rollout, advantages, micro_batch_rows = balance_tokens(
                rollout, run, advantages[:, None], args.num_generations if share_prompts else 1,
                args.micro_batch_size, args.micro_batch_tokens)
            advantages = advantages[:, 0]
        # each minibatch's micro-batches, by index
        minibatch_micro_batches = split(range(len(micro_batch_rows)), len(micro_batch_rows) // args.num_minibatches)
        batches = micro_batches(rollout, micro_batch_rows, run, share_prompts)
        advantages = [advantages[list(rows), None].to(device) for rows in micro_batch_rows]  # no host sync in the loop
        with torch.no_grad():  # pi_old (with mu k > 1: before the first of the updates) and pi_ref, once per batch
            old_logprobs = [token_logprobs(policy, b, args.temperature) if updates > 1 else None for b in batches]
            with adapters_disabled(reference):
                ref_logprobs = [token_logprobs(reference, b, args.temperature) if reference else None for b in batches]
        totals, grad_norm = Totals(), 0.0  # the norm logged is the mean over the updates, as PPO's
        minibatch_sequences = num_sequences // args.num_minibatches
        for _ in range(args.num_iterations):  # mu passes over the batch
            for u, in_minibatch in enumerate(minibatch_micro_batches):
                minibatch_tokens = int(counts[f"minibatch_tokens/{u}"])
                for m in in_minibatch:
                    batch, advantage = batches[m], advantages[m]
                    logprobs = token_logprobs(policy, batch, args.temperature)
                    if old_logprobs[m] is None:  # one update: the policy before it is the one in this forward
                        old_logprobs[m] = logprobs.detach()
                    old, ref = old_logprobs[m], ref_logprobs[m]
                    log_ratio = importance_log_ratio(logprobs, old, batch.mask)
                    correction = rollout_correction(old, batch.rollout_logprobs, batch.mask, args.tis_cap,
                                                   args.seq_mask_cap)
                    per_token = grpo_token_loss(log_ratio, correction, logprobs, ref, advantage, args.clip_eps_low,
                                                args.clip_eps_high, args.beta, surrogate)
                    loss = aggregate_loss(per_token, batch.mask, args.loss_type, minibatch_sequences,
                                          minibatch_tokens, args.max_completion_length)
                    all_reduce_at_last(m == in_minibatch[-1], policy)  # HSDP: across nodes once per update
                    (loss * world_size).backward()
                    with torch.no_grad():  # --- diagnostics: shares of the minibatch's means, averaged over updates
                        clipped = clip_statistic(log_ratio, advantage, args.clip_eps_low, args.clip_eps_high)
                        kept = sequence_mask(old, batch.rollout_logprobs, batch.mask, args.seq_mask_cap) \
                            if args.seq_mask_cap else batch.mask.new_ones(())
                        totals.add({"train/loss": loss,
                                    "train/clip_fraction": (clipped * batch.mask).sum() / minibatch_tokens,
                                    "mismatch/tis_weight_mean": (correction * batch.mask).sum() / minibatch_tokens,
                                    "mismatch/masked_fraction": (1 - kept).sum() / minibatch_sequences,
                                    **({"train/kl": (k3_kl(logprobs, ref) * batch.mask).sum() / minibatch_tokens}
                                       if ref is not None else {})},
                                   {"mismatch/tis_weight_max": (correction * batch.mask).max()}, divisor=updates)
                norm, learning_rate = optimizer_step(policy, optimizer, scheduler, args.max_grad_norm, step)
                grad_norm += norm / updates
        for batch, old in zip(batches, old_logprobs):  # the engine's logprobs against the trainer's, before the update
            totals.add(*mismatch_stats(old, batch.rollout_logprobs, batch.mask, num_tokens))
        train_s = time.time() - train_start
        # ============================== END ALGORITHM ==============================

        # --- weight sync into the engine; the step's metrics, reduced by name; evaluation, logs, checkpoint ---
        sync_s = sync_weights(engine, policy, args.dtype, rollout)
        flat_scores = grouped.flatten()
        metrics = {
            "train/score": flat_scores.mean().item(),
            "train/score_std": flat_scores.std().item(),
            "train/accuracy": counts["correct"] / num_sequences,
            "train/completion_length": num_tokens / num_sequences,
            "train/truncated_fraction": counts["truncated"] / num_sequences,
            "train/grad_norm": grad_norm,
            "train/learning_rate": learning_rate,
            **totals.reduce(),
            "perf/rollout_tokens_per_s": num_tokens / rollout.seconds,
            "perf/train_tokens_per_s": num_tokens * args.num_iterations / train_s,
            "perf/train_s": train_s,
            "perf/weight_sync_s": sync_s,
        }
        end_step(run, engine, tracker, step, rollout, metrics, trained)

    finish(run, engine, tracker, policy, metrics)
