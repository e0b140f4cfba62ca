"""Online DPO for LLMs: preference pairs sampled by the policy itself on an embedded vLLM engine, judged every step.

Paper: Guo et al., "Direct Language Model Alignment from Online AI Feedback", arXiv:2402.04792 (OAIF, Algorithm 1),
with the DPO loss of Rafailov et al., arXiv:2305.18290 (eq. 7) or the IPO loss of Azar et al., arXiv:2310.12036.

What it is, in plain words: every step the current policy samples K completions per prompt; a judge scores them (the
task's verifiable reward, or a reward model); the best and the worst completion of each prompt become a (chosen,
rejected) pair, and one DPO step is taken on those pairs against the frozen starting model. A prompt whose K scores
are all equal has no preference: its pair is counted as tied and weighs nothing in the loss. Online, the pairs always
come from the current policy, which is what separates this from DPO on a fixed dataset.

Each torchrun rank holds one vLLM engine for rollouts and one FSDP2 shard of the policy and of the reference; after
every update the weights stream into the engine. Same arguments + same machine + same world size = same bits.

    torchrun --nproc_per_node 2 dpo_online.py --seed 1
"""

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro

from common.determinism import parameter_hash, seed_everything
from common.distributed import fail, init_distributed, reduce_stats
from common.llm import (
    RewardModel,
    check_llm_args,
    check_scalar_head,
    completion_values,
    evaluate,
    judge,
    load_model,
    make_batch,
    make_optimizer,
    mismatch_stats,
    optimizer_step,
    prepare_run,
    resume_training,
    save_training_checkpoint,
    score,
    sequence_logprobs,
    start_engine,
    start_tracking,
    step_prompts,
    stream_weights,
)
from common.rollout import sample_seed
from common.tracking import get_logger

EMBEDDED_MODEL = str(Path(__file__).resolve().parent / "assets" / "tiny-adder")


@dataclass
class Args:
    # --- run ---
    exp_name: str = "dpo_online"
    """the name of this experiment (the run directory is runs/{exp_name}__{seed}__{timestamp})"""
    seed: int = 1
    """seed of the experiment: prompt order, per-sample sampling seeds, torch/numpy/python RNGs"""
    deterministic: bool = True
    """deterministic kernels, batch-invariant vLLM on CUDA, TF32 off (`--no-deterministic` turns it off)"""
    track: bool = False
    """mirror the TensorBoard logs to Weights & Biases"""
    wandb_project_name: str = "rl-repro"
    """the Weights & Biases project, with --track"""
    run_root: str = "runs"
    """where run directories are created"""

    # --- model, task and judge ---
    model_name_or_path: str = EMBEDDED_MODEL
    """any HF causal LM (hub id or local path); the default is the embedded tiny addition model"""
    task: str = "addition"
    """`addition` (embedded), `gsm8k` (openai/gsm8k), or a dataset name/path in GSM8K's format"""
    reward_model: str | None = None
    """judge: a one-label AutoModelForSequenceClassification (hub id or path) scoring prompt + completion; by default
    the task's verifiable reward judges. Held-out evaluation always uses the task's reward."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """compute dtype of rollouts and training; master weights and optimizer state stay float32"""

    # --- rollouts ---
    rollout_engine: Literal["auto", "vllm", "hf"] = "auto"
    """`auto` = vLLM when installed, else the transformers fallback"""
    vllm_tp: int = 1
    """tensor-parallel size of each vLLM engine (groups of contiguous ranks)"""
    vllm_kv_cache_memory_bytes: int = 64 * 2**20
    """KV-cache size of the vLLM engine on CPU"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory vLLM may take on CUDA (the trainer needs the rest)"""
    max_prompt_length: int = 512
    """prompts longer than this (in tokens) are dropped from the dataset"""
    max_completion_length: int = 8
    """maximum tokens sampled per completion"""
    temperature: float = 1.0
    """sampling temperature; logprobs (rollout and trainer) are taken after it"""

    # --- online DPO ---
    total_steps: int = 400
    """number of steps (rollout + judge + one update on the pairs)"""
    prompts_per_step: int = 64
    """prompts per step across all ranks (one pair each)"""
    num_generations: int = 8
    """K: completions sampled per prompt; the best and the worst form its pair"""
    beta: float = 0.1
    """DPO's beta (the strength of the implicit KL to the reference); IPO's tau"""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO (Rafailov et al. eq. 7); ipo: IPO (Azar et al.), a squared loss toward a margin of 1 / (2 beta)"""
    micro_batch_size: int = 256
    """sequences (chosen + rejected) per forward/backward on each rank (gradient accumulation over the rest)"""
    reshard_after_forward: bool = False
    """FSDP2: free each block's gathered weights after forward (least memory, for billion-parameter models)"""
    learning_rate: float = 3e-4
    """AdamW peak learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    warmup_steps: int = 5
    """linear warm-up, in optimizer steps"""
    lr_schedule: Literal["constant", "linear", "cosine"] = "linear"
    """the schedule after warm-up, to 0 at the last step (linear: a constant rate left the last evaluations of the
    embedded task swinging by up to 10 points)"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""

    # --- evaluation and checkpoints ---
    eval_every: int = 20
    """held-out greedy evaluation every this many steps (and before the first and after the last)"""
    num_eval_prompts: int = 500
    """held-out prompts per evaluation (0 = the whole test split)"""
    save_every: int = 0
    """checkpoint every this many steps (0 = only at the end)"""
    keep_last: int = 2
    """checkpoints kept (older ones are deleted after a newer one is complete); 0 keeps all"""
    resume: str | None = None
    """a checkpoint directory (or a run's checkpoints/ directory) to continue from, in that run's directory; every
    argument must match the checkpoint's except where and how the run reports (common/llm.py MAY_CHANGE_ON_RESUME),
    and --total-steps may grow"""


def check_args(args: Args, world_size: int) -> None:
    """Reject bad input on every rank, before any collective can hang (the shared checks, then online DPO's own)."""
    check_llm_args(args, world_size)
    if args.num_generations < 2:
        fail(f"--num-generations must be at least 2 to form a (chosen, rejected) pair, got {args.num_generations}")
    if not args.beta > 0:
        fail(f"--beta must be positive, got {args.beta}")
    if args.warmup_steps < 0:
        fail("--warmup-steps must be non-negative")
    if args.reward_model is not None:
        check_scalar_head(args.reward_model, "--reward-model", must_be_classifier=True)


# ============================================================================================
# ALGORITHM: pairs from the judge's scores, and the DPO / IPO loss
# ============================================================================================


def preference_pairs(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """scores: [num_prompts, K]. OAIF Algorithm 1 with the judge's scores: the best completion is chosen, the worst
    rejected (the first of equal scores, so the choice is deterministic). Returns their indices within each group and
    a float mask that is 0 where all K scores tie (no preference, no gradient)."""
    chosen, rejected = scores.argmax(dim=1), scores.argmin(dim=1)
    preferred = (scores.max(dim=1).values > scores.min(dim=1).values).float()
    return chosen, rejected, preferred


def dpo_loss(policy_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, preferred: torch.Tensor, beta: float,
             loss_type: str, num_preferred: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A micro-batch's share of the mean loss over the batch's preferred pairs (all ranks: `num_preferred`).
    policy_logprobs, ref_logprobs: [2n] sequence logprobs (sums over completion tokens), the n chosen then the n
    rejected; preferred: [n], 0 for a tied pair, which then adds nothing to the loss or its gradient. With
    h = log pi(y_w)/pi_ref(y_w) - log pi(y_l)/pi_ref(y_l), each pair's loss is
    sigmoid: -log sigmoid(beta * h)  (DPO, Rafailov et al. eq. 7);
    ipo: (h - 1 / (2 beta))^2  (IPO, Azar et al., the sampled-IPO loss with tau = beta).
    Also returns its shares of the sums of DPO's implicit rewards beta * log pi/pi_ref (sec. 5) over preferred pairs,
    and of how many of them the policy already ranks right, detached."""
    log_ratio = policy_logprobs - ref_logprobs
    chosen_log_ratio, rejected_log_ratio = log_ratio.chunk(2)
    h = chosen_log_ratio - rejected_log_ratio
    losses = -F.logsigmoid(beta * h) if loss_type == "sigmoid" else (h - 1 / (2 * beta)) ** 2
    loss = (losses * preferred).sum() / num_preferred
    chosen_reward, rejected_reward = beta * chosen_log_ratio.detach(), beta * rejected_log_ratio.detach()
    return loss, {"loss": loss.detach(), "chosen_reward": (chosen_reward * preferred).sum(),
                  "rejected_reward": (rejected_reward * preferred).sum(),
                  "preference_accuracy": ((chosen_reward > rejected_reward).float() * preferred).sum()}


if __name__ == "__main__":
    args = tyro.cli(Args)
    check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    determinism = seed_everything(args.seed, args.deterministic)  # before any engine: sets CUDA/vLLM env flags
    rank, world_size, device = init_distributed()
    log = get_logger(rank)

    # --- setup: prompts, policy, reference, judge, optimizer, rollout engine, resume (PLUMBING) ---
    setup = prepare_run(args, world_size)
    policy = load_model(args.model_name_or_path, args.dtype, device, world_size,
                        reshard_after_forward=args.reshard_after_forward)
    # the frozen reference is the starting model of the whole run, also after a resume
    reference = load_model(args.model_name_or_path, args.dtype, device, world_size, trainable=False,
                           reshard_after_forward=args.reshard_after_forward)
    reward_model = RewardModel(args.reward_model, args.dtype, device, world_size, args.micro_batch_size) \
        if args.reward_model else None
    optimizer, scheduler = make_optimizer(policy, args, args.learning_rate, args.total_steps)
    engine = start_engine(args, setup, device)
    start_step = resume_training(setup, {"policy": (policy, optimizer)}, [scheduler], 1, rank)
    tracker = start_tracking(args, engine, setup, determinism, start_step, rank, world_size, device)

    rollout_dtype = getattr(torch, args.dtype)
    metrics: dict[str, float] = {}
    if start_step > 0:  # the same weight path into the engine as the uninterrupted run took
        engine.update_weights(stream_weights(policy, rollout_dtype))
    else:
        metrics = evaluate(engine, setup, args.num_eval_prompts, args.max_completion_length, rank, world_size)
        tracker.log(0, metrics)
        tracker.write_json("eval_before.json", metrics)
        log.info(f"held-out greedy accuracy before training: {metrics['eval/accuracy']:.4f}")

    group = args.num_generations
    pairs_per_micro_batch = max(1, args.micro_batch_size // 2)
    for step in range(start_step + 1, args.total_steps + 1):
        step_start = time.time()
        # --- prompts and rollouts: K samples per prompt, each with its own seed (PLUMBING) ---
        my_prompts, first_prompt = step_prompts(step, args.seed, len(setup.prompts.train_ids), args.prompts_per_step,
                                                rank, world_size)
        prompts = [setup.prompts.train_ids[i] for i in my_prompts for _ in range(group)]
        examples = [setup.prompts.train[i] for i in my_prompts for _ in range(group)]
        seeds = [sample_seed(args.seed, step, first_prompt + p, k)
                 for p in range(len(my_prompts)) for k in range(group)]
        samples = engine.generate(prompts, seeds, args.max_completion_length, args.temperature, setup.eos_ids)
        engine.sleep()
        rollout_s = time.time() - step_start
        completions = [s.completion_ids for s in samples]
        scores = judge(setup, reward_model, examples, completions)
        task_rewards = scores if reward_model is None else torch.tensor(
            score(setup.task.reward, setup.tokenizer, examples, completions, setup.eos_ids))

        # ================================ ALGORITHM ================================
        # --- pairs: best and worst of each prompt's K samples; ties weigh nothing ---
        chosen, rejected, preferred = preference_pairs(scores.view(-1, group))
        chosen_rows = (torch.arange(len(my_prompts)) * group + chosen).tolist()
        rejected_rows = (torch.arange(len(my_prompts)) * group + rejected).tolist()
        pair_tokens = sum(len(completions[r]) for r in chosen_rows + rejected_rows)
        counts = reduce_stats({"pairs": len(my_prompts), "preferred": preferred.sum(), "pair_tokens": pair_tokens,
                               "tokens": sum(map(len, completions)), "truncated": sum(s.truncated for s in samples)})
        num_preferred, num_pair_tokens = int(counts["preferred"]), int(counts["pair_tokens"])

        # --- update: one optimizer step on this batch's pairs, gradient accumulation over micro-batches ---
        train_start = time.time()
        policy.train()
        sums: dict[str, torch.Tensor] = {}
        maxima: dict[str, torch.Tensor] = {}
        # every rank runs as many forwards (FSDP collectives): tied pairs go through too, with weight 0. All
        # micro-batches go to the device first, so no host-to-device copy waits on a backward in the loop below.
        micro_batches = []
        for start in range(0, len(my_prompts), pairs_per_micro_batch) if num_preferred else []:
            pairs = range(start, min(start + pairs_per_micro_batch, len(my_prompts)))
            rows = [chosen_rows[p] for p in pairs] + [rejected_rows[p] for p in pairs]
            batch = make_batch([prompts[r] for r in rows], [completions[r] for r in rows], setup.pad_id, device)
            micro_batches.append((batch, completion_values([samples[r].logprobs for r in rows], batch.completion_mask),
                                  preferred[pairs.start:pairs.stop].to(device)))
        for batch, rollout_logprobs, micro_preferred in micro_batches:
            with torch.no_grad():  # the reference once per batch, no graph
                ref_sums = (sequence_logprobs(reference, batch, args.temperature) * batch.completion_mask).sum(-1)
            logprobs = sequence_logprobs(policy, batch, args.temperature)
            loss, stats = dpo_loss((logprobs * batch.completion_mask).sum(-1), ref_sums, micro_preferred, args.beta,
                                   args.loss_type, num_preferred)
            (loss * world_size).backward()  # FSDP averages gradients over ranks; the loss is already a global sum
            for name, value in stats.items():
                sums[name] = sums.get(name, 0) + value
            # how far the engine's logprobs are from the trainer's (before the update) on the trained tokens
            mismatch_sums, mismatch_max = mismatch_stats(logprobs.detach(), rollout_logprobs, batch.completion_mask,
                                                         num_pair_tokens)
            for name, value in mismatch_sums.items():
                sums[name] = sums.get(name, 0) + value
            maxima["logprob_abs_diff_max"] = torch.maximum(maxima.get("logprob_abs_diff_max", mismatch_max),
                                                           mismatch_max)
        if num_preferred:
            grad_norm, learning_rate = optimizer_step(policy, optimizer, scheduler, args.max_grad_norm, step)
        else:  # every prompt tied: no gradient at all, and Adam's momentum alone would still move the weights
            grad_norm, learning_rate = 0.0, scheduler.get_last_lr()[0]
            scheduler.step()
        train_s = time.time() - train_start
        # ============================== END ALGORITHM ==============================

        # --- weight sync: one tensor at a time from the FSDP shards into the rollout engine (PLUMBING) ---
        sync_start = time.time()
        engine.update_weights(stream_weights(policy, rollout_dtype))
        sync_s = time.time() - sync_start

        # --- logging: every rank's statistics, reduced by name ---
        score_sums = {"score": scores.sum(), "accuracy": (task_rewards >= 1).float().sum(),
                      "chosen_score": scores.view(-1, group).max(dim=1).values.sum(),
                      "rejected_score": scores.view(-1, group).min(dim=1).values.sum(),
                      "chosen_length": float(sum(len(completions[r]) for r in chosen_rows)),
                      "rejected_length": float(sum(len(completions[r]) for r in rejected_rows))}
        totals = reduce_stats({**sums, **score_sums} if num_preferred else score_sums, maxima)
        num_samples, num_pairs = int(counts["pairs"]) * group, int(counts["pairs"])
        metrics = {
            "train/score_mean": totals["score"] / num_samples,
            "train/accuracy": totals["accuracy"] / num_samples,
            "train/chosen_score": totals["chosen_score"] / num_pairs,
            "train/rejected_score": totals["rejected_score"] / num_pairs,
            "train/tied_fraction": 1 - num_preferred / num_pairs,
            "train/completion_length": counts["tokens"] / num_samples,
            "train/chosen_length": totals["chosen_length"] / num_pairs,
            "train/rejected_length": totals["rejected_length"] / num_pairs,
            "train/truncated_fraction": counts["truncated"] / num_samples,
            "train/grad_norm": grad_norm,
            "train/learning_rate": learning_rate,
            "perf/rollout_tokens_per_s": counts["tokens"] / rollout_s,
            "perf/train_tokens_per_s": num_pair_tokens / train_s,
            "perf/weight_sync_s": sync_s,
            "perf/step_s": time.time() - step_start,
        }
        if num_preferred:  # implicit rewards beta * log pi/pi_ref (DPO sec. 5), over the preferred pairs
            metrics.update({
                "train/loss": totals["loss"],
                "rewards/chosen": totals["chosen_reward"] / num_preferred,
                "rewards/rejected": totals["rejected_reward"] / num_preferred,
                "rewards/margin": (totals["chosen_reward"] - totals["rejected_reward"]) / num_preferred,
                "rewards/preference_accuracy": totals["preference_accuracy"] / num_preferred,
                **{f"mismatch/{name}": totals[name] for name in ("logprob_abs_diff_mean", "logprob_abs_diff_max",
                                                                 "kl")},
            })
            if not math.isfinite(metrics["train/loss"]):
                fail(f"non-finite loss at step {step}; the last checkpoint is left as it was")
        if step == args.total_steps or (args.eval_every and step % args.eval_every == 0):
            metrics.update(evaluate(engine, setup, args.num_eval_prompts, args.max_completion_length, rank,
                                    world_size))
        tracker.log(step, metrics)
        tracker.progress(step, args.total_steps, {
            "score": metrics["train/score_mean"], "tied": metrics["train/tied_fraction"],
            **({"eval_acc": metrics["eval/accuracy"]} if "eval/accuracy" in metrics else {}),
            "tok/s": metrics["perf/rollout_tokens_per_s"]}, first_step=start_step)

        # --- checkpoint: sharded training state + exported policy, published atomically ---
        if (args.save_every and step % args.save_every == 0) or step == args.total_steps:
            save_training_checkpoint(tracker.run_dir / "checkpoints", step, policy, setup.tokenizer,
                                     {"policy": (policy, optimizer)}, args, args.keep_last)

    final_hash = parameter_hash(policy)
    tracker.write_json("final.json", {"step": args.total_steps, "parameter_sha256": final_hash, **metrics})
    log.info(f"done: held-out greedy accuracy {metrics.get('eval/accuracy', float('nan')):.4f}, "
             f"parameters sha256 {final_hash[:16]}")
    tracker.close()
    engine.close()
    if dist.is_initialized():  # vLLM's shutdown may already have taken the group down
        dist.destroy_process_group()
