"""GRPO: Group Relative Policy Optimization for LLMs with verifiable rewards, on an embedded vLLM engine.

Paper: Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
arXiv:2402.03300 (GRPO, section 4). Options from DAPO (Yu et al., arXiv:2503.14476: clip-higher, token-level loss) and
Dr. GRPO (Liu et al., arXiv:2503.20783: no length or std normalisation).

What it is, in plain words: with the default `--num-iterations 1` the policy that sampled is the policy being
updated, so the clipped ratio is 1 and GRPO is token-level REINFORCE with group-normalised advantages (each
completion's reward minus its group's mean, over the group's std). The clip matters only with `--num-iterations` > 1.
The one correction that always acts is truncated importance sampling (TIS): the rollout engine's probabilities differ
slightly from the trainer's (other kernels), and each token is reweighted by min(pi_trainer / pi_rollout, cap).

Each torchrun rank holds one vLLM engine for rollouts and one FSDP2 shard of the policy for training; after every
update the weights stream into the engine. Same arguments + same machine + same world size = same bits.

    torchrun --nproc_per_node 2 grpo_llm.py --seed 1
"""

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
import tyro

from common.determinism import parameter_hash, seed_everything
from common.distributed import fail, init_distributed, reduce_stats
from common.llm import (
    check_llm_args,
    completion_values,
    evaluate,
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
    exp_name: str = "grpo_llm"
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

    # --- model and task ---
    model_name_or_path: str = EMBEDDED_MODEL
    """any HF causal LM (hub id or local path); the default is the embedded tiny addition model"""
    task: str = "addition"
    """`addition` (embedded), `gsm8k` (openai/gsm8k), or a dataset name/path in GSM8K's format"""
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

    # --- GRPO ---
    total_steps: int = 400
    """number of GRPO steps (rollout + update)"""
    prompts_per_step: int = 64
    """prompts per step across all ranks"""
    num_generations: int = 8
    """G: completions sampled per prompt (the group)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """divide advantages by the group's reward std, the batch's, or not at all (Dr. GRPO)"""
    loss_type: Literal["grpo", "dapo", "dr_grpo"] = "dapo"
    """grpo: mean over each sequence, then over sequences; dapo: mean over all tokens of the batch;
    dr_grpo: sum over tokens divided by (sequences x max_completion_length)"""
    clip_eps_low: float = 0.2
    """lower clip range of the importance ratio (1 - eps_low)"""
    clip_eps_high: float = 0.28
    """upper clip range (1 + eps_high); above eps_low is DAPO's clip-higher"""
    beta: float = 0.0
    """KL coefficient to the frozen reference model (k3 estimator); 0 loads no reference model"""
    num_iterations: int = 1
    """mu: optimizer steps on each batch of rollouts (old logprobs come from the trainer before the first)"""
    micro_batch_size: int = 256
    """completions per forward/backward on each rank (gradient accumulation over the rest; the last may be smaller)"""
    share_prompts: bool = True
    """the G completions of a prompt share one forward of the prompt (one packed row, block attention mask): same
    values, fewer tokens. Attention then spans the whole packed row and cannot use FlashAttention, so turn it off
    (`--no-share-prompts`) for long completions on GPUs"""
    reshard_after_forward: bool = False
    """FSDP2: free each block's gathered weights after forward and gather them again for backward (least memory: use
    `--reshard-after-forward` for billion-parameter models); off, one all-gather per block instead of two"""
    learning_rate: float = 3e-4
    """AdamW peak learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    warmup_steps: int = 5
    """linear warm-up, in optimizer steps"""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """the schedule after warm-up"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    tis_cap: float = 2.0
    """truncated importance sampling: weight tokens by min(pi_trainer / pi_rollout, cap); 0 turns it off"""

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
    """Reject bad input on every rank, before any collective can hang (the shared checks, then GRPO's own)."""
    check_llm_args(args, world_size)
    if args.num_iterations <= 0:
        fail(f"--num-iterations must be positive, got {args.num_iterations}")
    if args.scale_rewards == "group" and args.num_generations < 2:
        fail("--num-generations must be at least 2 to compute a group's reward std")
    if args.clip_eps_low < 0 or args.clip_eps_high < 0 or args.beta < 0 or args.tis_cap < 0:
        fail("--clip-eps-low, --clip-eps-high, --beta and --tis-cap must be non-negative")
    if args.warmup_steps < 0:
        fail("--warmup-steps must be non-negative")


# ============================================================================================
# ALGORITHM: advantages, the clipped surrogate with TIS and KL, and its aggregation
# ============================================================================================


def group_advantages(rewards: torch.Tensor, scale_rewards: str, eps: float = 1e-4) -> torch.Tensor:
    """rewards: [num_prompts, G]. DeepSeekMath eq. in sec. 4.1.2 (outcome supervision):
    A_i = (r_i - mean(r_group)) / std(r_group), the same advantage for every token of completion i.
    `batch` divides by the std of the whole batch instead; `none` only centres (Dr. GRPO)."""
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if scale_rewards == "group":
        return centered / (rewards.std(dim=1, keepdim=True) + eps)
    if scale_rewards == "batch":
        return centered / (rewards.std() + eps)
    return centered


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """DeepSeekMath eq. 4 (Schulman's k3): KL ~ pi_ref/pi - log(pi_ref/pi) - 1, unbiased and always >= 0."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def clipped_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      clip_eps_low: float, clip_eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeekMath eq. 3 (PPO's clipped objective per token), negated to a loss; DAPO eq. 10 for the asymmetric
    clip range. Returns the per-token loss and where the clip was active."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * advantages
    return -torch.min(unclipped, clipped), (clipped < unclipped).float()


def truncated_is_weight(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """TIS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"): the tokens were
    drawn from the engine's pi_rollout, so weight them by min(pi_old / pi_rollout, cap); a constant, no gradient."""
    if cap <= 0:
        return torch.ones_like(old_logprobs)
    return torch.exp(old_logprobs - rollout_logprobs).clamp(max=cap).detach()


def aggregate_loss(per_token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str, num_sequences: int,
                   num_tokens: int, max_completion_length: int) -> torch.Tensor:
    """Reduce a micro-batch's per-token loss [B, T] to its share of the batch loss, so that summing over micro-batches
    and ranks gives the batch loss. `num_sequences` and `num_tokens` count the whole batch (all ranks).
    grpo: (1/N) sum_i (1/|o_i|) sum_t l_it (DeepSeekMath eq. 3); dapo: sum_it l_it / sum_i |o_i| (DAPO eq. 8);
    dr_grpo: sum_it l_it / (N * max_completion_length) (Dr. GRPO eq. 2)."""
    masked = per_token_loss * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / num_sequences
    if loss_type == "dapo":
        return masked.sum() / num_tokens
    return masked.sum() / (num_sequences * max_completion_length)


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
              ref_logprobs: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor, args: Args,
              num_sequences: int, num_tokens: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's share of the GRPO loss: the clipped surrogate (eq. 3) weighted by TIS, plus beta times the
    k3 KL to the reference (eq. 4), aggregated by `loss_type`. Also returns its shares of the batch statistics (sums
    over the batch's tokens, already divided by the global token count), detached, on the device."""
    surrogate, clipped = clipped_surrogate(logprobs, old_logprobs, advantages[:, None], args.clip_eps_low,
                                           args.clip_eps_high)
    tis_weight = truncated_is_weight(old_logprobs, rollout_logprobs, args.tis_cap)
    per_token = surrogate * tis_weight
    stats = {"clip_fraction": (clipped * mask).sum() / num_tokens, "tis_weight": (tis_weight * mask).sum() / num_tokens}
    if ref_logprobs is not None:
        kl = k3_kl(logprobs, ref_logprobs)
        per_token = per_token + args.beta * kl
        stats["ref_kl"] = (kl.detach() * mask).sum() / num_tokens  # not "kl": mismatch_stats has that name
    loss = aggregate_loss(per_token, mask, args.loss_type, num_sequences, num_tokens, args.max_completion_length)
    return loss, {"loss": loss.detach(), **stats}


if __name__ == "__main__":
    args = tyro.cli(Args)
    check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    determinism = seed_everything(args.seed, args.deterministic)  # before any engine: sets CUDA/vLLM env flags
    rank, world_size, device = init_distributed()
    log = get_logger(rank)

    # --- setup: prompts, policy, optimizer, rollout engine, resume (PLUMBING) ---
    setup = prepare_run(args, world_size)
    policy = load_model(args.model_name_or_path, args.dtype, device, world_size,
                        reshard_after_forward=args.reshard_after_forward)
    # the frozen reference is the starting model of the whole run, also after a resume
    reference = load_model(args.model_name_or_path, args.dtype, device, world_size, trainable=False,
                           reshard_after_forward=args.reshard_after_forward) if args.beta > 0 else None
    optimizer, scheduler = make_optimizer(policy, args, args.learning_rate, args.total_steps * args.num_iterations)
    engine = start_engine(args, setup, device)
    start_step = resume_training(setup, {"policy": (policy, optimizer)}, [scheduler], args.num_iterations, rank)
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

    for step in range(start_step + 1, args.total_steps + 1):
        step_start = time.time()
        # --- prompts and rollouts: G samples per prompt, each with its own seed (PLUMBING) ---
        my_prompts, first_prompt = step_prompts(step, args.seed, len(setup.prompts.train_ids), args.prompts_per_step,
                                                rank, world_size)
        prompts = [setup.prompts.train_ids[i] for i in my_prompts for _ in range(args.num_generations)]
        examples = [setup.prompts.train[i] for i in my_prompts for _ in range(args.num_generations)]
        seeds = [sample_seed(args.seed, step, first_prompt + p, g)
                 for p in range(len(my_prompts)) for g in range(args.num_generations)]
        samples = engine.generate(prompts, seeds, args.max_completion_length, args.temperature, setup.eos_ids)
        engine.sleep()
        rollout_s = time.time() - step_start
        completions = [s.completion_ids for s in samples]
        rewards = torch.tensor(score(setup.task.reward, setup.tokenizer, examples, completions, setup.eos_ids))

        # ================================ ALGORITHM ================================
        # --- advantages: group-relative, over the global batch ---
        all_rewards = [torch.zeros_like(rewards) for _ in range(world_size)]
        dist.all_gather(all_rewards, rewards)
        grouped = torch.cat(all_rewards).view(args.prompts_per_step, args.num_generations)
        advantages = group_advantages(grouped, args.scale_rewards).flatten().view(world_size, -1)[rank].to(device)
        counts = reduce_stats({"tokens": sum(map(len, completions)), "sequences": len(completions),
                               "truncated": sum(s.truncated for s in samples)})
        num_tokens, num_sequences = int(counts["tokens"]), int(counts["sequences"])

        # --- update: mu optimizer steps on this batch, gradient accumulation over micro-batches ---
        train_start = time.time()
        policy.train()
        micro_batches = [range(s, min(s + args.micro_batch_size, len(samples)))
                         for s in range(0, len(samples), args.micro_batch_size)]
        batches = [make_batch([prompts[r] for r in rows], [completions[r] for r in rows], setup.pad_id, device,
                              args.share_prompts) for rows in micro_batches]
        rollout_logprobs = [completion_values([samples[r].logprobs for r in rows], b.completion_mask)
                            for rows, b in zip(micro_batches, batches)]
        with torch.no_grad():  # pi_old (trainer's, before the first of mu updates) and pi_ref, once per batch
            old_logprobs = [sequence_logprobs(policy, b, args.temperature) if args.num_iterations > 1 else None
                            for b in batches]
            ref_logprobs = [sequence_logprobs(reference, b, args.temperature) if reference else None for b in batches]
        sums: dict[str, torch.Tensor] = {}
        maxima: dict[str, torch.Tensor] = {}
        for iteration in range(args.num_iterations):
            for m, (rows, batch) in enumerate(zip(micro_batches, batches)):
                logprobs = sequence_logprobs(policy, batch, args.temperature)
                old = old_logprobs[m] if old_logprobs[m] is not None else logprobs.detach()
                loss, stats = grpo_loss(logprobs, old, rollout_logprobs[m], ref_logprobs[m], advantages[rows.start:
                                        rows.stop], batch.completion_mask, args, num_sequences, num_tokens)
                (loss * world_size).backward()  # FSDP averages gradients over ranks; the loss is already a global sum
                for name, value in stats.items():
                    sums[name] = sums.get(name, 0) + value / args.num_iterations
                if iteration == 0:  # how far the engine's logprobs are from the trainer's, before any update
                    mismatch_sums, mismatch_max = mismatch_stats(old, rollout_logprobs[m], batch.completion_mask,
                                                                 num_tokens)
                    for name, value in mismatch_sums.items():
                        sums[name] = sums.get(name, 0) + value
                    maxima["logprob_abs_diff_max"] = torch.maximum(maxima.get("logprob_abs_diff_max", mismatch_max),
                                                                   mismatch_max)
            grad_norm, learning_rate = optimizer_step(policy, optimizer, scheduler, args.max_grad_norm, step)
        train_s = time.time() - train_start
        # ============================== END ALGORITHM ==============================

        # --- weight sync: one tensor at a time from the FSDP shards into the rollout engine (PLUMBING) ---
        sync_start = time.time()
        engine.update_weights(stream_weights(policy, rollout_dtype))
        sync_s = time.time() - sync_start

        # --- logging: every rank's statistics, reduced by name ---
        totals = reduce_stats(sums, maxima)
        flat_rewards = grouped.flatten()
        metrics = {
            "train/reward_mean": flat_rewards.mean().item(),
            "train/reward_std": flat_rewards.std().item(),
            "train/accuracy": (flat_rewards >= 1).float().mean().item(),
            "train/completion_length": num_tokens / num_sequences,
            "train/truncated_fraction": counts["truncated"] / num_sequences,
            "train/loss": totals["loss"],
            "train/clip_fraction": totals["clip_fraction"],
            "train/grad_norm": grad_norm,
            "train/learning_rate": learning_rate,
            **{f"mismatch/{name}": totals[name] for name in ("logprob_abs_diff_mean", "logprob_abs_diff_max", "kl")},
            "mismatch/tis_weight_mean": totals["tis_weight"],
            "perf/rollout_tokens_per_s": num_tokens / rollout_s,
            "perf/train_tokens_per_s": num_tokens * args.num_iterations / train_s,
            "perf/weight_sync_s": sync_s,
            "perf/step_s": time.time() - step_start,
        }
        if not math.isfinite(metrics["train/loss"]):
            fail(f"non-finite loss at step {step}; the last checkpoint is left as it was")
        if reference is not None:
            metrics["train/kl"] = totals["ref_kl"]
        if step == args.total_steps or (args.eval_every and step % args.eval_every == 0):
            metrics.update(evaluate(engine, setup, args.num_eval_prompts, args.max_completion_length, rank,
                                    world_size))
        tracker.log(step, metrics)
        tracker.progress(step, args.total_steps, {
            "reward": metrics["train/reward_mean"], "acc": metrics["train/accuracy"],
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
