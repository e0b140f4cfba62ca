"""Online DPO for LLMs: preference pairs sampled by the policy itself on an embedded vLLM engine, judged every step.

Paper: Guo et al., "Direct Language Model Alignment from Online AI Feedback", arXiv:2402.04792 (OAIF, Algorithm 1),
with the DPO loss of Rafailov et al., arXiv:2305.18290 (eq. 7) or the IPO loss of Azar et al., arXiv:2310.12036.

What it is, in plain words: every step the current policy samples G completions per prompt; a judge scores them (the
task's verifiable reward, or a reward model); the best and the worst completion of each prompt become a (chosen,
rejected) pair, and one DPO step is taken on those pairs against the frozen starting model. A prompt whose G scores
are all equal has no preference: its pair is counted as tied and weighs nothing in the loss. Online, the pairs always
come from the current policy, which is what separates this from DPO on a fixed dataset.

Each torchrun rank holds one vLLM engine for rollouts and one FSDP2 shard of the policy and of the reference; after
every update the weights stream into the engine. Same arguments + same machine + same world size = same bits.
With `--rollout-ranks K` the last K ranks only generate (common/llm/layout.py); with `--max-staleness 1` the pairs come
from the policy one update back. DPO's loss needs no correction for that: it never uses the sampler's probabilities
(only the policy's and the reference's), so a stale pair is simply a slightly older preference.

    torchrun --nproc_per_node 2 dpo_online.py --seed 1
"""

import os
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
import tyro

from common.distributed import Totals, fail, reduce_stats
from common.llm.batching import micro_batches, mismatch_stats, split, token_logprobs
from common.llm.checks import check_llm_args
from common.llm.lifecycle import end_step, finish, prepare_run, start_training
from common.llm.lora import adapters_disabled, lora_spec
from common.llm.models import all_reduce_at_last, load_model, make_optimizer, optimizer_step
from common.llm.rollouts import generate, judge, sync_weights
from common.llm.run import LLMArgs
from common.llm.scoring import RewardModel, check_scalar_head


@dataclass
class Args(LLMArgs):
    """Online DPO's own flags. The shared ones (model, task, steps, prompts, G, optimizer, engine, FSDP, evaluation,
    checkpoints) and their defaults: LLMArgs in common/llm/run.py."""
    exp_name: str = "dpo_online"
    """the name of this experiment (the run directory is runs/{exp_name}__{seed}__{timestamp})"""
    reward_model: str | None = None
    """judge: a one-label AutoModelForSequenceClassification (hub id or path) scoring prompt + completion; by default
    the task's verifiable reward judges. Held-out evaluation always uses the task's reward."""
    beta: float = 0.1
    """DPO's beta, the strength of the (implicit) KL regularisation to the reference; IPO's tau"""
    loss_type: Literal["sigmoid", "ipo", "ipo_sum"] = "sigmoid"
    """sigmoid: DPO (Rafailov et al. eq. 7); ipo: IPO (Azar et al.), a squared loss toward a margin of 1 / (2 beta)
    on log-ratios averaged over each completion's tokens (as the IPO authors and TRL compute it); ipo_sum: the same
    on sequence sums, whose gaps grow with length (10-100 at 1k tokens against a target of 5 at beta 0.1)"""
    lr_schedule: Literal["constant", "linear", "cosine"] = "linear"
    """the schedule after warm-up, to 0 at the last step (linear: a constant rate left the last evaluations of the
    embedded task swinging by up to 10 points)"""


def check_args(args: Args, world_size: int) -> None:
    """Reject bad input on every rank, before any collective can hang (the shared checks, then online DPO's own)."""
    check_llm_args(args, world_size)
    if args.dynamic_sampling_rounds:
        fail("--dynamic-sampling-rounds is GRPO's (grpo_llm.py): online DPO is not tested with it yet")
    if args.num_generations < 2:
        fail(f"--num-generations must be at least 2 to form a (chosen, rejected) pair, got {args.num_generations}")
    if not args.beta > 0:
        fail(f"--beta must be positive, got {args.beta}")
    if args.reward_model is not None:
        check_scalar_head(args.reward_model, "--reward-model", must_be_classifier=True)


# ============================================================================================
# ALGORITHM: pairs from the judge's scores, and the DPO / IPO loss
# ============================================================================================


def preference_pairs(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """scores: [num_prompts, G]. OAIF Algorithm 1 with the judge's scores: the best completion is chosen, the worst
    rejected (the first of equal scores, so the choice is deterministic). Returns their indices within each group and
    a float mask that is 0 where all G scores tie (no preference, no gradient)."""
    chosen, rejected = scores.argmax(dim=1), scores.argmin(dim=1)
    preferred = (scores.max(dim=1).values > scores.min(dim=1).values).float()
    return chosen, rejected, preferred


def implicit_rewards(policy_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, beta: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO's implicit reward beta * log pi(y) / pi_ref(y) (sec. 5) of the chosen and of the rejected completions.
    policy_logprobs, ref_logprobs: [2n] sequence logprobs (sums over completion tokens), the n chosen first."""
    return (beta * (policy_logprobs - ref_logprobs)).chunk(2)


def sequence_logprobs(logprobs: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """log pi(y) as the loss compares it, from token logprobs [2n, C] (0.0 on padding): the sum over the completion's
    tokens, or for ipo their mean (the IPO authors' and TRL's form: h then stays near 1 / (2 beta) at any length)."""
    total = logprobs.sum(-1)
    return total / mask.sum(-1).clamp(min=1) if loss_type == "ipo" else total


def dpo_loss(policy_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, preferred: torch.Tensor, beta: float,
             loss_type: str, num_preferred: int) -> torch.Tensor:
    """A micro-batch's share of the mean loss over the batch's preferred pairs (all ranks: `num_preferred`).
    policy_logprobs, ref_logprobs: [2n] sequence logprobs, the n chosen then the n rejected; preferred: [n], 0 for a
    tied pair, which then adds nothing to the loss or its gradient. With
    h = log pi(y_w)/pi_ref(y_w) - log pi(y_l)/pi_ref(y_l), each pair's loss is
    sigmoid: -log sigmoid(beta * h)  (DPO, Rafailov et al. eq. 7);
    ipo, ipo_sum: (h - 1 / (2 beta))^2  (IPO, Azar et al., the sampled-IPO loss with tau = beta)."""
    chosen_log_ratio, rejected_log_ratio = (policy_logprobs - ref_logprobs).chunk(2)
    h = chosen_log_ratio - rejected_log_ratio
    losses = -F.logsigmoid(beta * h) if loss_type == "sigmoid" else (h - 1 / (2 * beta)) ** 2  # ipo, ipo_sum
    return (losses * preferred).sum() / num_preferred


if __name__ == "__main__":
    args = tyro.cli(Args)
    check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    run = prepare_run(args)  # seeds, process group, tokenizer, prompts, the checkpoint to resume from (PLUMBING)
    rank, world_size, device = run.rank, run.world_size, run.device

    # --- models: the policy (with --lora-rank, adapters over a frozen base), the frozen reference (the run's starting
    # model, also on resume; with LoRA the policy with its adapters switched off), the judge ---
    policy = load_model(args.model_name_or_path, args, device, lora=lora_spec(args))
    reference = policy if args.lora_rank else load_model(args.model_name_or_path, args, device, trainable=False)
    reward_model = RewardModel(args.reward_model, args, device) if args.reward_model else None
    optimizer, scheduler = make_optimizer(policy, args, args.learning_rate, args.total_steps)
    trained = {"policy": (policy, optimizer)}
    engine, tracker, start_step = start_training(run, trained, [scheduler], updates_per_step=1)

    for step in range(start_step + 1, args.total_steps + 1):
        # --- rollouts: G samples per prompt on this rank's engine, scored by the judge (PLUMBING) ---
        rollout = generate(engine, run, step)
        scores = judge(reward_model, rollout)

        # ================================ ALGORITHM ================================
        # What the loss receives, per micro-batch of n pairs (common/llm/batching.py):
        #   policy_logprobs [2n] sum over each completion's tokens of log pi_theta(token | prompt, earlier tokens)
        #   at temperature 1 (where DPO's implicit reward is defined, whatever --temperature sampled), with gradient,
        #   the n chosen completions first (ipo: the mean over its tokens, sequence_logprobs); ref_logprobs [2n] the
        #   same under the frozen reference (token logprobs are exactly 0.0 on padding, so sums cover real tokens);
        #   preferred [n] 1.0 for a pair, 0.0 for a tie. The loss is the micro-batch's share of the mean over the
        #   preferred pairs of all ranks; FSDP averages gradients over ranks, hence the backward of loss * world_size.
        # --- pairs: best and worst of each prompt's G samples; ties weigh nothing ---
        by_prompt = scores.view(-1, args.num_generations)
        chosen, rejected, preferred = preference_pairs(by_prompt)
        first_rows = torch.arange(len(by_prompt)) * args.num_generations
        chosen_rows, rejected_rows = (first_rows + chosen).tolist(), (first_rows + rejected).tolist()
        counts = reduce_stats({
            "pairs": len(by_prompt), "preferred": preferred.sum(),
            "tokens": sum(s.model_tokens() for s in rollout.samples),  # the model's: never an environment's
            "truncated": sum(s.truncated for s in rollout.samples), "score": scores.sum(),
            "correct": rollout.correct.sum(), "chosen_score": by_prompt.max(dim=1).values.sum(),
            "rejected_score": by_prompt.min(dim=1).values.sum(),
            "chosen_tokens": float(sum(rollout.samples[r].model_tokens() for r in chosen_rows)),
            "rejected_tokens": float(sum(rollout.samples[r].model_tokens() for r in rejected_rows))})
        num_pairs, num_preferred = int(counts["pairs"]), int(counts["preferred"])
        num_sequences, num_tokens = num_pairs * args.num_generations, counts["tokens"]
        num_pair_tokens = int(counts["chosen_tokens"] + counts["rejected_tokens"])

        # --- update: one optimizer step on this batch's pairs, gradient accumulation over micro-batches ---
        train_start = time.time()
        policy.eval()  # dropout off, as in the engine and the reference: every forward sees one network
        # every rank runs as many forwards (FSDP collectives): tied pairs go through too, with weight 0. Everything
        # goes to the device first, so no host-to-device copy in the loop waits on a backward.
        micro_batch_prompts = split(range(len(by_prompt)), max(1, args.micro_batch_size // 2)) if num_preferred else []
        batches = micro_batches(rollout, [[chosen_rows[p] for p in pairs] + [rejected_rows[p] for p in pairs]
                                          for pairs in micro_batch_prompts], run)
        totals = Totals()
        for m, (batch, micro_preferred) in enumerate(zip(batches, preferred.to(device).split(
                max(1, args.micro_batch_size // 2)))):
            with torch.no_grad(), adapters_disabled(reference):  # the reference, no graph
                ref_logprobs = token_logprobs(reference, batch, 1.0)
            logprobs = token_logprobs(policy, batch, 1.0)
            loss = dpo_loss(sequence_logprobs(logprobs, batch.mask, args.loss_type),
                            sequence_logprobs(ref_logprobs, batch.mask, args.loss_type), micro_preferred, args.beta,
                            args.loss_type, num_preferred)
            all_reduce_at_last(m == len(batches) - 1, policy)  # HSDP: across nodes once per update
            (loss * world_size).backward()
            with torch.no_grad():  # --- diagnostics: implicit rewards over preferred pairs; engine vs trainer ---
                chosen_reward, rejected_reward = implicit_rewards(logprobs.sum(-1), ref_logprobs.sum(-1), args.beta)
                totals.add({"train/loss": loss, "rewards/chosen": (chosen_reward * micro_preferred).sum(),
                            "rewards/rejected": (rejected_reward * micro_preferred).sum(),
                            "rewards/preference_accuracy": ((chosen_reward > rejected_reward).float()
                                                            * micro_preferred).sum()})
                sampled = logprobs if args.temperature == 1 else token_logprobs(policy, batch, args.temperature)
                totals.add(*mismatch_stats(sampled, batch.rollout_logprobs, batch.mask, num_pair_tokens))
        if num_preferred:
            grad_norm, learning_rate = optimizer_step(policy, optimizer, scheduler, args.max_grad_norm, step)
        else:  # every prompt tied: no gradient at all, and Adam's momentum alone would still move the weights
            grad_norm, learning_rate = 0.0, scheduler.get_last_lr()[0]
            scheduler.step()
        train_s = time.time() - train_start
        # ============================== END ALGORITHM ==============================

        # --- weight sync into the engine; the step's metrics, reduced by name; evaluation, logs, checkpoint ---
        sync_s = sync_weights(engine, policy, args.dtype, rollout)
        update = totals.reduce()
        metrics = {
            "train/score": counts["score"] / num_sequences,
            "train/accuracy": counts["correct"] / num_sequences,
            "train/chosen_score": counts["chosen_score"] / num_pairs,
            "train/rejected_score": counts["rejected_score"] / num_pairs,
            "train/tied_fraction": 1 - num_preferred / num_pairs,
            "train/completion_length": num_tokens / num_sequences,
            "train/chosen_length": counts["chosen_tokens"] / num_pairs,
            "train/rejected_length": counts["rejected_tokens"] / num_pairs,
            "train/truncated_fraction": counts["truncated"] / num_sequences,
            "train/grad_norm": grad_norm,
            "train/learning_rate": learning_rate,
            "perf/rollout_tokens_per_s": num_tokens / rollout.seconds,
            "perf/train_tokens_per_s": num_pair_tokens / train_s,
            "perf/train_s": train_s,
            "perf/weight_sync_s": sync_s,
        }
        if num_preferred:  # implicit rewards over the preferred pairs, and the engine/trainer mismatch
            metrics.update({
                **update, **{name: update[name] / num_preferred for name in ("rewards/chosen", "rewards/rejected",
                                                                              "rewards/preference_accuracy")},
                "rewards/margin": (update["rewards/chosen"] - update["rewards/rejected"]) / num_preferred})
        end_step(run, engine, tracker, step, rollout, metrics, trained)

    finish(run, engine, tracker, policy, metrics)
