"""PPO for LLMs with a learned value model, a KL penalty to the reference, and an embedded vLLM engine.

Papers: Schulman et al., "Proximal Policy Optimization Algorithms", arXiv:1707.06347 (the clipped objective);
Schulman et al., "High-Dimensional Continuous Control Using Generalized Advantage Estimation", arXiv:1506.02438 (GAE);
Ziegler et al., "Fine-Tuning Language Models from Human Preferences", arXiv:1909.08593, and Ouyang et al., "Training
language models to follow instructions with human feedback", arXiv:2203.02155 (the KL-penalised reward); Huang et al.,
"The N+ Implementation Details of RLHF with PPO: A Case Study on TL;DR Summarization", arXiv:2403.17031 (the details).

What it is, in plain words: each completion is an episode whose actions are its tokens. The reward is the score of
the finished completion (a verifiable check or a reward model), paid at its last token, minus kl_coef times
log(pi_old / pi_ref) at every token, so drifting away from the starting model costs reward. A value model (the policy's
network with a scalar head, trained alongside) predicts at each token the return still to come; GAE turns rewards and
values into per-token advantages, whitened over the batch. Then --ppo-epochs passes over --num-minibatches minibatches
take one optimizer step each: after the first, the policy has moved, and the clipped ratio pi / pi_old keeps each step
near the policy that sampled (unlike GRPO's default of one update per batch, where the clip never acts).
As in GRPO, tokens are also weighted by min(pi_old / pi_rollout, cap) (TIS) for the engine's numerical mismatch.

Each torchrun rank holds one vLLM engine for rollouts and one FSDP2 shard of the policy and of the value model; after
every step the policy's weights stream into the engine. Same arguments + same machine + same world size = same bits.

    torchrun --nproc_per_node 2 ppo_llm.py --seed 1
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
    RewardModel,
    check_llm_args,
    check_scalar_head,
    completion_columns,
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
    exp_name: str = "ppo_llm"
    """the name of this experiment (the run directory is runs/{exp_name}__{seed}__{timestamp})"""
    seed: int = 1
    """seed of the experiment: prompt order, per-sample sampling seeds, minibatch order, torch/numpy/python RNGs"""
    deterministic: bool = True
    """deterministic kernels, batch-invariant vLLM on CUDA, TF32 off (`--no-deterministic` turns it off)"""
    track: bool = False
    """mirror the TensorBoard logs to Weights & Biases"""
    wandb_project_name: str = "rl-repro"
    """the Weights & Biases project, with --track"""
    run_root: str = "runs"
    """where run directories are created"""

    # --- models and task ---
    model_name_or_path: str = EMBEDDED_MODEL
    """the policy: any HF causal LM (hub id or local path); the default is the embedded tiny addition model"""
    critic_model: str | None = None
    """the value model's starting point: a causal LM or a one-label classifier (e.g. the reward model); the default
    is the policy's path, with a fresh scalar head"""
    reward_model: str | None = None
    """a one-label AutoModelForSequenceClassification that scores prompt + completion; the default is the task's
    verifiable reward"""
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

    # --- PPO ---
    total_steps: int = 300
    """number of PPO steps (rollout + ppo_epochs x num_minibatches updates)"""
    prompts_per_step: int = 64
    """prompts per step across all ranks"""
    num_generations: int = 4
    """completions sampled per prompt (PPO needs no group; several per prompt give the value model contrast)"""
    ppo_epochs: int = 1
    """passes over each batch of rollouts"""
    num_minibatches: int = 2
    """minibatches per pass, one optimizer step each (this rank's completions must divide evenly)"""
    micro_batch_size: int = 256
    """completions per forward/backward on each rank (gradient accumulation within a minibatch); sized for the
    embedded model: about 8 for Qwen2.5-0.5B at 1k completion tokens (benchmarks/README.md)"""
    reshard_after_forward: bool = False
    """FSDP2: free each block's gathered weights after forward and gather them again for backward (least memory: use
    `--reshard-after-forward` for billion-parameter models); off, one all-gather per block instead of two"""
    kl_coef: float = 0.05
    """beta: per-token KL penalty to the frozen reference folded into the rewards; 0 loads no reference model"""
    target_kl: float | None = None
    """adapt --kl-coef toward this KL per completion (Ziegler et al.'s controller); None keeps it fixed"""
    kl_horizon: int = 10_000
    """horizon of the adaptive KL controller, in completions"""
    missing_eos_penalty: float = 0.0
    """subtracted from the score of a completion that hit --max-completion-length without an EOS"""
    gamma: float = 1.0
    """discount over completion tokens"""
    lam: float = 0.95
    """GAE lambda"""
    cliprange: float = 0.2
    """clip range of the policy ratio"""
    cliprange_value: float = 0.2
    """clip range of the value prediction around the old value"""
    vf_coef: float = 0.1
    """weight of the value loss"""
    learning_rate: float = 3e-4
    """AdamW peak learning rate of the policy (the embedded model's; 1e-6 for Qwen2.5-0.5B-Instruct, see
    benchmarks/README.md)"""
    critic_learning_rate: float = 1e-3
    """AdamW peak learning rate of the value model (its scalar head starts from scratch; 1e-5 for
    Qwen2.5-0.5B-Instruct)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    warmup_steps: int = 5
    """linear warm-up, in optimizer steps"""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """the schedule after warm-up"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm (each model on its own)"""
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
    """Reject bad input on every rank, before any collective can hang (the shared checks, then PPO's own)."""
    check_llm_args(args, world_size)
    if args.ppo_epochs <= 0 or args.num_minibatches <= 0:
        fail(f"--ppo-epochs and --num-minibatches must be positive, got {args.ppo_epochs} and {args.num_minibatches}")
    per_rank = args.prompts_per_step // world_size * args.num_generations
    if per_rank % args.num_minibatches:
        fail(f"each rank's {per_rank} completions per step (--prompts-per-step / world size x --num-generations) "
             f"must be divisible by --num-minibatches {args.num_minibatches}")
    if not (0 <= args.gamma <= 1 and 0 <= args.lam <= 1):
        fail(f"--gamma and --lam must lie in [0, 1], got {args.gamma} and {args.lam}")
    if not (args.cliprange > 0 and args.cliprange_value > 0 and args.vf_coef > 0):
        fail("--cliprange, --cliprange-value and --vf-coef must be positive")
    if args.kl_coef < 0 or args.missing_eos_penalty < 0 or args.tis_cap < 0 or args.warmup_steps < 0:
        fail("--kl-coef, --missing-eos-penalty, --tis-cap and --warmup-steps must be non-negative")
    if args.target_kl is not None and not (args.target_kl > 0 and args.kl_coef > 0 and args.kl_horizon > 0):
        fail("--target-kl needs positive --target-kl, --kl-coef (the controller multiplies it) and --kl-horizon")
    if not args.critic_learning_rate > 0:
        fail(f"--critic-learning-rate must be positive, got {args.critic_learning_rate}")
    check_models(args)


def check_models(args: Args) -> None:
    """The value model and the reward model must have scalar heads, and the value model must read every token the
    policy can sample. Reads only configs and stored head shapes, before any model is loaded."""
    from transformers import AutoConfig

    if args.critic_model is not None:
        check_scalar_head(args.critic_model, "--critic-model", must_be_classifier=False)
        try:
            policy_vocab = AutoConfig.from_pretrained(args.model_name_or_path).get_text_config().vocab_size
        except (OSError, ValueError) as error:
            fail(f"cannot load model {args.model_name_or_path!r}: {error}")
        critic_vocab = AutoConfig.from_pretrained(args.critic_model).get_text_config().vocab_size
        if critic_vocab < policy_vocab:
            fail(f"--critic-model {args.critic_model!r} has a vocabulary of {critic_vocab} tokens, the policy "
                 f"{policy_vocab}: the value model must read every token id the policy samples")
    if args.reward_model is not None:
        check_scalar_head(args.reward_model, "--reward-model", must_be_classifier=True)


class ValueModel:
    """Loads any checkpoint as AutoModelForTokenClassification with one label and no dropout on the head: one value
    per position. A causal LM gets a fresh `score` head drawn from torch's seeded RNG (the same on every rank)."""

    @staticmethod
    def from_pretrained(path: str, **kwargs: object) -> torch.nn.Module:
        from transformers import AutoConfig, AutoModelForTokenClassification

        config = AutoConfig.from_pretrained(path, num_labels=1)
        config.classifier_dropout = 0.0  # else 0.1: noisy values in every forward (from_pretrained drops the kwarg)
        return AutoModelForTokenClassification.from_pretrained(path, config=config, **kwargs)


def critic_values(critic: torch.nn.Module, batch: object) -> torch.Tensor:
    """V(prompt + completion[:j]) for every completion position j, [B, C] float32: the output at the column just
    before completion token j, the state in which that token was chosen."""
    logits = critic(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids).logits
    return logits[:, completion_columns(batch), 0].float()


# ============================================================================================
# ALGORITHM: KL-penalised rewards, GAE, whitening, the clipped policy and value losses
# ============================================================================================


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Ziegler et al. eq. 2 / Ouyang et al. eq. 2, per token: r_t = -beta * log(pi_old / pi_ref)_t, plus the
    completion's score at its last token. kl: [B, C] per-token k1 estimates (0 on padding); scores: [B]."""
    rewards = -kl_coef * kl
    last = (mask.sum(1).long() - 1).clamp(min=0)
    rewards[torch.arange(len(scores), device=mask.device), last] += scores.to(rewards)
    return rewards * mask


def adaptive_kl_coef(kl_coef: float, kl: float, target_kl: float, batch_size: int, horizon: int) -> float:
    """Ziegler et al.'s adaptive KL controller: e_t = clip(KL_t / KL_target - 1, -0.2, 0.2) and
    beta_{t+1} = beta_t (1 + K_beta e_t), with K_beta = batch_size / horizon (this step's completions over the
    controller's horizon)."""
    error = min(max(kl / target_kl - 1, -0.2), 0.2)
    return kl_coef * (1 + error * batch_size / horizon)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016, eq. 16): A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t,
    over completion tokens [B, C], right-padded (mask). The state after the last token is terminal (V = 0), so a
    completion cut off at the length limit is scored as it stands. Returns advantages and returns A + V (0 on
    padding)."""
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(rewards)
    next_value = next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = delta + gamma * lam * next_advantage  # padding: delta 0 and next 0, so A stays 0
        advantages[:, t] = next_advantage
        next_value = values[:, t]
    return advantages, advantages + values


def moments(total: float, total_squares: float, count: float) -> tuple[float, float]:
    """Mean and unbiased variance from a sum, a sum of squares and a count (each summed over ranks)."""
    mean = total / count
    return mean, max(total_squares - count * mean**2, 0.0) / max(count - 1, 1)


def whiten(values: torch.Tensor, mask: torch.Tensor, mean: float, variance: float, eps: float = 1e-8) -> torch.Tensor:
    """Advantage whitening (N+ details): (A - mean) / sqrt(var + eps), with mean and var over every valid
    token of the global batch (world sizes 1 and 2 agree), so each minibatch sees advantages on the same scale."""
    return (values - mean) * (variance + eps) ** -0.5 * mask


def truncated_is_weight(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """TIS (Yao et al. 2025): the tokens came from the engine's pi_rollout, so weight them by min(pi_old / pi_rollout,
    cap); a constant, no gradient. cap 0 turns it off."""
    if cap <= 0:
        return torch.ones_like(old_logprobs)
    return torch.exp(old_logprobs - rollout_logprobs).clamp(max=cap).detach()


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, cliprange: float, tis_cap: float, num_tokens: float
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO eq. 7 as a loss per token, max(-A r, -A clip(r, 1 - eps, 1 + eps)) with r = pi / pi_old, weighted by TIS,
    summed over this micro-batch's tokens and divided by its minibatch's token count over all ranks (`num_tokens`),
    so shares add up to the minibatch mean. Also returns shares of the statistics (detached): where the clip acted,
    approx_kl = 0.5 (log r)^2 (N+ details), and the mean TIS weight."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
    tis_weight = truncated_is_weight(old_logprobs, rollout_logprobs, tis_cap)
    loss = (torch.max(unclipped, clipped) * tis_weight * mask).sum() / num_tokens
    stats = {"policy_loss": loss.detach(),
             "clip_fraction": ((clipped > unclipped).float() * mask).sum() / num_tokens,
             "approx_kl": (0.5 * log_ratio.detach() ** 2 * mask).sum() / num_tokens,
             "tis_weight": (tis_weight * mask).sum() / num_tokens}
    return loss, stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float, num_tokens: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (N+ details; OpenAI baselines): 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2),
    as a share of the minibatch mean like `policy_loss`, with the share of tokens where the clipped term won."""
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    loss = 0.5 * (torch.max(unclipped_error, clipped_error) * mask).sum() / num_tokens
    return loss, {"value_loss": loss.detach(),
                  "value_clip_fraction": ((clipped_error > unclipped_error).float() * mask).sum() / num_tokens}


if __name__ == "__main__":
    args = tyro.cli(Args)
    check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    determinism = seed_everything(args.seed, args.deterministic)  # before any engine: sets CUDA/vLLM env flags
    rank, world_size, device = init_distributed()
    log = get_logger(rank)

    # --- setup: prompts, policy, value model, reference, reward model, optimizers, engine, resume (PLUMBING) ---
    setup = prepare_run(args, world_size)
    policy = load_model(args.model_name_or_path, args.dtype, device, world_size,
                        reshard_after_forward=args.reshard_after_forward)
    critic = load_model(args.critic_model or args.model_name_or_path, args.dtype, device, world_size,
                        reshard_after_forward=args.reshard_after_forward, model_class=ValueModel)
    # the frozen reference is the starting model of the whole run, also after a resume
    reference = load_model(args.model_name_or_path, args.dtype, device, world_size, trainable=False,
                           reshard_after_forward=args.reshard_after_forward) if args.kl_coef > 0 else None
    reward_model = RewardModel(args.reward_model, args.dtype, device, world_size, args.micro_batch_size) \
        if args.reward_model else None
    updates_per_step = args.ppo_epochs * args.num_minibatches
    optimizer, scheduler = make_optimizer(policy, args, args.learning_rate, args.total_steps * updates_per_step)
    critic_optimizer, critic_scheduler = make_optimizer(critic, args, args.critic_learning_rate,
                                                        args.total_steps * updates_per_step)
    engine = start_engine(args, setup, device)
    trained = {"policy": (policy, optimizer), "critic": (critic, critic_optimizer)}
    start_step = resume_training(setup, trained, [scheduler, critic_scheduler], updates_per_step, rank)
    tracker = start_tracking(args, engine, setup, determinism, start_step, rank, world_size, device)
    # the adaptive controller's state travels in the checkpoint, so a resumed run continues with the same coefficient
    kl_coef = setup.trainer_state["extra"]["kl_coef"] if start_step > 0 else args.kl_coef

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
        # --- prompts and rollouts: K samples per prompt, each with its own seed; scores (PLUMBING) ---
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
        truncated = torch.tensor([float(s.truncated) for s in samples])
        judged = judge(setup, reward_model, examples, completions)
        task_rewards = judged if reward_model is None else torch.tensor(  # accuracy is logged either way
            score(setup.task.reward, setup.tokenizer, examples, completions, setup.eos_ids))
        scores = judged - args.missing_eos_penalty * truncated

        # ================================ ALGORITHM ================================
        # --- one pass without gradients, in order: pi_old and its entropy, pi_ref, V_old ---
        train_start = time.time()
        policy.eval()  # dropout off (N+ details): pi_old, V_old and every update see the same deterministic network
        critic.eval()
        num_samples, chunk = len(samples), args.micro_batch_size
        like = torch.zeros(num_samples, max(1, max(map(len, completions))), device=device)
        mask = completion_values([[1.0] * len(c) for c in completions], like)
        rollout_logprobs = completion_values([s.logprobs for s in samples], like)
        old_logprobs, entropy, ref_logprobs, old_values = (torch.zeros_like(like) for _ in range(4))
        with torch.no_grad():
            for start in range(0, num_samples, chunk):
                rows = slice(start, start + chunk)
                batch = make_batch(prompts[rows], completions[rows], setup.pad_id, device)
                width = batch.completion_ids.shape[1]
                old_logprobs[rows, :width], entropy[rows, :width] = sequence_logprobs(
                    policy, batch, args.temperature, with_entropy=True)
                old_values[rows, :width] = critic_values(critic, batch)
                if reference is not None:
                    ref_logprobs[rows, :width] = sequence_logprobs(reference, batch, args.temperature)
        kl = (old_logprobs - ref_logprobs) * mask if reference is not None else torch.zeros_like(mask)  # k1

        # --- rewards, GAE, and this step's minibatches: the same shuffle on every rank ---
        rewards = token_rewards(scores, kl, mask, kl_coef)
        advantages, returns = gae(rewards, old_values, mask, args.gamma, args.lam)
        minibatch_size = num_samples // args.num_minibatches
        minibatches = []
        for epoch in range(args.ppo_epochs):
            generator = torch.Generator().manual_seed(sample_seed(args.seed, step, -1, epoch))  # -1: no sample's seed
            order = torch.randperm(num_samples, generator=generator)
            minibatches += list(order.split(minibatch_size))
        lengths = torch.tensor([float(len(c)) for c in completions])

        # --- one collective: whitening moments, explained variance, every minibatch's global token count ---
        totals = reduce_stats({
            "tokens": mask.sum(), "sequences": num_samples, "truncated": truncated.sum(), "score": scores.sum(),
            "correct": (task_rewards >= 1).sum(), "kl": kl.sum(), "entropy": (entropy * mask).sum(),
            "advantage": advantages.sum(), "advantage_sq": (advantages ** 2).sum(), "return": returns.sum(),
            "return_sq": (returns ** 2).sum(),
            **{f"minibatch_tokens/{u}": lengths[rows].sum() for u, rows in enumerate(minibatches)}})
        num_tokens, num_sequences = totals["tokens"], totals["sequences"]
        advantages = whiten(advantages, mask, *moments(totals["advantage"], totals["advantage_sq"], num_tokens))

        # how far the engine's logprobs are from the trainer's for the same tokens, before any update
        stats, abs_diff_max = mismatch_stats(old_logprobs, rollout_logprobs, mask, num_tokens)

        # --- update: one optimizer step per minibatch for each model, gradient accumulation over micro-batches ---
        norms = {"grad_norm": 0.0, "critic_grad_norm": 0.0}  # means over this step's updates
        for update, rows in enumerate(minibatches):
            minibatch_tokens = totals[f"minibatch_tokens/{update}"]
            for micro in rows.split(args.micro_batch_size):
                ids, index = micro.tolist(), micro.to(device)  # one host-to-device copy per micro-batch
                batch = make_batch([prompts[i] for i in ids], [completions[i] for i in ids], setup.pad_id, device)
                width = batch.completion_ids.shape[1]
                old, rollout, advantage, old_value, target = (
                    t[index, :width] for t in (old_logprobs, rollout_logprobs, advantages, old_values,
                                                          returns))
                pg_loss, pg_stats = policy_loss(sequence_logprobs(policy, batch, args.temperature), old, rollout,
                                                advantage, batch.completion_mask, args.cliprange, args.tis_cap,
                                                minibatch_tokens)
                vf_loss, vf_stats = value_loss(critic_values(critic, batch), old_value, target, batch.completion_mask,
                                               args.cliprange_value, minibatch_tokens)
                # FSDP averages gradients over ranks; the losses are already global means
                ((pg_loss + args.vf_coef * vf_loss) * world_size).backward()
                for name, value in {**pg_stats, **vf_stats}.items():
                    stats[name] = stats.get(name, 0) + value / updates_per_step
            grad_norm, learning_rate = optimizer_step(policy, optimizer, scheduler, args.max_grad_norm, step)
            critic_grad_norm, critic_learning_rate = optimizer_step(critic, critic_optimizer, critic_scheduler,
                                                                    args.max_grad_norm, step)
            norms["grad_norm"] += grad_norm / updates_per_step
            norms["critic_grad_norm"] += critic_grad_norm / updates_per_step
        train_s = time.time() - train_start
        # ============================== END ALGORITHM ==============================

        # --- weight sync: one tensor at a time from the FSDP shards into the rollout engine (PLUMBING) ---
        sync_start = time.time()
        engine.update_weights(stream_weights(policy, rollout_dtype))
        sync_s = time.time() - sync_start

        # --- logging: every rank's statistics, reduced by name; then the KL controller's next coefficient ---
        update_totals = reduce_stats(stats, {"logprob_abs_diff_max": abs_diff_max})
        # explained variance 1 - Var(R - V_old) / Var(R) over valid tokens, where R - V_old is GAE's advantage
        _, return_variance = moments(totals["return"], totals["return_sq"], num_tokens)
        _, error_variance = moments(totals["advantage"], totals["advantage_sq"], num_tokens)
        kl_per_completion = totals["kl"] / num_sequences
        metrics = {
            "train/score": totals["score"] / num_sequences,
            "train/accuracy": totals["correct"] / num_sequences,
            "train/non_score_reward": -kl_coef * kl_per_completion,
            "train/kl": kl_per_completion,
            "train/kl_coef": kl_coef,
            "train/completion_length": num_tokens / num_sequences,
            "train/truncated_fraction": totals["truncated"] / num_sequences,
            "train/entropy": totals["entropy"] / num_tokens,
            "train/explained_variance": 1 - error_variance / return_variance if return_variance > 0 else 0.0,
            **{f"train/{name}": update_totals[name] for name in ("policy_loss", "value_loss", "clip_fraction",
                                                          "value_clip_fraction", "approx_kl")},
            **{f"train/{name}": value for name, value in norms.items()},
            "train/learning_rate": learning_rate,
            "train/critic_learning_rate": critic_learning_rate,
            **{f"mismatch/{name}": update_totals[name]
               for name in ("logprob_abs_diff_mean", "logprob_abs_diff_max", "kl")},
            "mismatch/tis_weight_mean": update_totals["tis_weight"],
            "perf/rollout_tokens_per_s": num_tokens / rollout_s,
            "perf/train_tokens_per_s": num_tokens * args.ppo_epochs / train_s,
            "perf/weight_sync_s": sync_s,
            "perf/step_s": time.time() - step_start,
        }
        if not (math.isfinite(metrics["train/policy_loss"]) and math.isfinite(metrics["train/value_loss"])):
            fail(f"non-finite loss at step {step}; the last checkpoint is left as it was")
        if args.target_kl is not None:
            kl_coef = adaptive_kl_coef(kl_coef, kl_per_completion, args.target_kl, int(num_sequences),
                                       args.kl_horizon)
        if step == args.total_steps or (args.eval_every and step % args.eval_every == 0):
            metrics.update(evaluate(engine, setup, args.num_eval_prompts, args.max_completion_length, rank,
                                    world_size))
        tracker.log(step, metrics)
        tracker.progress(step, args.total_steps, {
            "score": metrics["train/score"], "acc": metrics["train/accuracy"], "kl": metrics["train/kl"],
            **({"eval_acc": metrics["eval/accuracy"]} if "eval/accuracy" in metrics else {}),
            "tok/s": metrics["perf/rollout_tokens_per_s"]}, first_step=start_step)

        # --- checkpoint: sharded policy + value model and their optimizers, exported policy, the KL coefficient ---
        if (args.save_every and step % args.save_every == 0) or step == args.total_steps:
            save_training_checkpoint(tracker.run_dir / "checkpoints", step, policy, setup.tokenizer, trained, args,
                                     args.keep_last, extra={"kl_coef": kl_coef})

    final_hash = parameter_hash(policy)
    tracker.write_json("final.json", {"step": args.total_steps, "parameter_sha256": final_hash, **metrics})
    log.info(f"done: held-out greedy accuracy {metrics.get('eval/accuracy', float('nan')):.4f}, "
             f"parameters sha256 {final_hash[:16]}")
    tracker.close()
    engine.close()
    if dist.is_initialized():  # vLLM's shutdown may already have taken the group down
        dist.destroy_process_group()
