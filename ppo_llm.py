"""PPO for LLMs with a learned value model, a KL penalty to the reference, and an embedded vLLM engine.

Papers: Schulman et al., "Proximal Policy Optimization Algorithms", arXiv:1707.06347 (the clipped objective);
Schulman et al., "High-Dimensional Continuous Control Using Generalized Advantage Estimation", arXiv:1506.02438 (GAE);
Ziegler et al., "Fine-Tuning Language Models from Human Preferences", arXiv:1909.08593, and Ouyang et al., "Training
language models to follow instructions with human feedback", arXiv:2203.02155 (the KL-penalised reward); Huang et al.,
"The N+ Implementation Details of RLHF with PPO: A Case Study on TL;DR Summarization", arXiv:2403.17031 (the details).

What it is, in plain words: each completion is an episode whose actions are its tokens. The reward is the score of
the finished completion (a verifiable check or a reward model), paid at its last token, minus beta times
log(pi_old / pi_ref) at every token, so drifting away from the starting model costs reward. A value model (the policy's
network with a scalar head, trained alongside) predicts at each token the return still to come; GAE turns rewards and
values into per-token advantages, whitened over the batch. Then --ppo-epochs passes over --num-minibatches minibatches
take one optimizer step each: after the first, the policy has moved, and the clipped ratio pi / pi_old keeps each step
near the policy that sampled (unlike GRPO's default of one update per batch, where the clip never acts).
As in GRPO, tokens are also weighted by min(pi_old / pi_rollout, cap) (TIS) for the engine's numerical mismatch,
and for a sampler one update behind with `--rollout-ranks K --max-staleness 1` (the split layout, common/llm/layout.py),
where `--seq-mask-cap` also drops the completions whose geometric-mean ratio moved furthest.

Each torchrun rank holds one vLLM engine for rollouts and one FSDP2 shard of the policy and of the value model; after
every step the policy's weights stream into the engine. Same arguments + same machine + same world size = same bits.

    torchrun --nproc_per_node 2 ppo_llm.py --seed 1
"""

import math
import os
import time
from dataclasses import dataclass
from typing import Annotated

import torch
import tyro
from transformers import PreTrainedModel
from transformers.modeling_layers import GenericForTokenClassification

from common.distributed import Totals, fail, reduce_stats
from common.llm.batching import (
    completion_columns,
    micro_batches,
    mismatch_stats,
    pad_completions,
    split,
    token_logprobs,
)
from common.llm.checks import check_llm_args
from common.llm.engines import sample_seed
from common.llm.lifecycle import end_step, finish, prepare_run, start_training
from common.llm.lora import adapters_disabled, lora_spec, targets_problem
from common.llm.models import all_reduce_at_last, load_model, make_optimizer, optimizer_step
from common.llm.rollouts import generate, judge, sync_weights
from common.llm.run import LLMArgs
from common.llm.scoring import RewardModel, check_scalar_head


@dataclass
class Args(LLMArgs):
    """PPO's own flags. The shared ones (model, task, steps, prompts, G, optimizer, engine, FSDP, evaluation,
    checkpoints) and their defaults: LLMArgs in common/llm/run.py."""
    exp_name: str = "ppo_llm"
    """the name of this experiment (the run directory is runs/{exp_name}__{seed}__{timestamp})"""
    total_steps: int = 300
    """number of PPO steps (rollout + ppo_epochs x num_minibatches updates)"""
    num_generations: int = 4
    """G: completions sampled per prompt (PPO needs no group; several per prompt give the value model contrast)"""
    value_model: Annotated[str | None, tyro.conf.arg(aliases=("--critic-model",))] = None
    """the value model's starting point: a causal LM or a one-label classifier (e.g. the reward model); the default
    is the policy's path, with a fresh scalar head"""
    reward_model: str | None = None
    """a one-label AutoModelForSequenceClassification that scores prompt + completion; the default is the task's
    verifiable reward"""
    ppo_epochs: int = 1
    """passes over each batch of rollouts"""
    num_minibatches: int = 2
    """minibatches per pass, one optimizer step each (this rank's completions must divide evenly)"""
    beta: Annotated[float, tyro.conf.arg(aliases=("--kl-coef",))] = 0.05
    """KL coefficient: the per-token penalty -beta log(pi_old / pi_ref) folded into the rewards; 0 loads no reference"""
    target_kl: float | None = None
    """adapt --beta toward this KL per completion (Ziegler et al.'s controller); None keeps it fixed"""
    kl_horizon: int = 10_000
    """horizon of the adaptive KL controller, in completions"""
    missing_eos_penalty: float = 0.0
    """subtracted from the score of a completion that hit --max-completion-length without an EOS"""
    gamma: float = 1.0
    """discount over completion tokens"""
    lam: float = 0.95
    """GAE lambda"""
    clip_eps: Annotated[float, tyro.conf.arg(aliases=("--cliprange",))] = 0.2
    """clip range of the policy ratio: clip(r, 1 - eps, 1 + eps)"""
    clip_eps_value: Annotated[float, tyro.conf.arg(aliases=("--cliprange-value",))] = 0.2
    """clip range of the value prediction around the old value"""
    vf_coef: float = 0.1
    """weight of the value loss"""
    value_learning_rate: Annotated[float, tyro.conf.arg(aliases=("--critic-learning-rate",))] = 1e-3
    """AdamW peak learning rate of the value model (its scalar head starts from scratch; 1e-5 for
    Qwen2.5-0.5B-Instruct; --learning-rate is the policy's, 1e-6 there, see benchmarks/README.md)"""
    value_lora_rank: int = 0
    """r > 0: the value model trains LoRA adapters of this rank (--lora-alpha, --lora-target-modules) and its
    scalar head, over a frozen body; 0: all of it trains"""
    tis_cap: float = 2.0
    """truncated importance sampling: weight tokens by min(pi_old / pi_rollout, cap); 0 turns it off"""
    seq_mask_cap: float = 0.0
    """masked importance sampling: drop completions whose geometric-mean ratio pi_old / pi_rollout leaves
    [1/c, c] (for a stale sampler, --max-staleness 1); 0 turns it off"""

    def adapted_bases(self) -> dict[str, str]:
        """The policy's base (--lora-rank) and, with --value-lora-rank, the value model's."""
        bases = super().adapted_bases()
        if self.value_lora_rank:
            bases["value"] = self.value_model or self.model_name_or_path
        return bases


def check_args(args: Args, world_size: int) -> None:
    """Reject bad input on every rank, before any collective can hang (the shared checks, then PPO's own)."""
    check_llm_args(args, world_size)
    if args.dynamic_sampling_rounds:
        fail("--dynamic-sampling-rounds is GRPO's (grpo_llm.py): PPO's value baseline learns from every group")
    if args.ppo_epochs <= 0 or args.num_minibatches <= 0:
        fail(f"--ppo-epochs and --num-minibatches must be positive, got {args.ppo_epochs} and {args.num_minibatches}")
    per_rank = args.prompts_per_step // (world_size - args.rollout_ranks) * args.num_generations
    if per_rank % args.num_minibatches:
        fail(f"each rank's {per_rank} completions per step (--prompts-per-step / trainer ranks x --num-generations) "
             f"must be divisible by --num-minibatches {args.num_minibatches}")
    if not (0 <= args.gamma <= 1 and 0 <= args.lam <= 1):
        fail(f"--gamma and --lam must lie in [0, 1], got {args.gamma} and {args.lam}")
    if not (args.clip_eps > 0 and args.clip_eps_value > 0 and args.vf_coef > 0):
        fail("--clip-eps, --clip-eps-value and --vf-coef must be positive")
    if args.beta < 0 or args.missing_eos_penalty < 0 or args.tis_cap < 0:
        fail("--beta, --missing-eos-penalty and --tis-cap must be non-negative")
    if args.seq_mask_cap and args.seq_mask_cap <= 1:
        fail(f"--seq-mask-cap must be 0 (off) or above 1, got {args.seq_mask_cap}")
    if args.target_kl is not None and not (args.target_kl > 0 and args.beta > 0 and args.kl_horizon > 0):
        fail("--target-kl needs positive --target-kl, --beta (the controller multiplies it) and --kl-horizon")
    if not args.value_learning_rate > 0:
        fail(f"--value-learning-rate must be positive, got {args.value_learning_rate}")
    if args.value_lora_rank < 0:
        fail(f"--value-lora-rank must be non-negative, got {args.value_lora_rank}")
    check_models(args)


def check_models(args: Args) -> None:
    """The value model and the reward model must have scalar heads. The value model reads the policy's token ids, so
    it must have the policy's tokenizer (the same token -> id map) and embed every id the policy can sample; the
    reward model re-tokenises the decoded text with its own tokenizer, so any tokenizer will do. With
    --value-lora-rank, the value model must have the targeted layers. Reads only configs, tokenizers and stored head
    shapes, before any model is loaded."""
    from transformers import AutoConfig, AutoTokenizer

    if args.value_model is not None:
        check_scalar_head(args.value_model, "--value-model", must_be_classifier=False)
        try:
            policy_vocab = AutoConfig.from_pretrained(args.model_name_or_path).get_text_config().vocab_size
            policy_tokens = AutoTokenizer.from_pretrained(args.model_name_or_path).get_vocab()
        except (OSError, ValueError) as error:
            fail(f"cannot load model {args.model_name_or_path!r}: {error}")
        value_tokens = AutoTokenizer.from_pretrained(args.value_model).get_vocab()
        if value_tokens != policy_tokens:
            fail(f"--value-model {args.value_model!r} has another tokenizer than the policy ({len(value_tokens)} "
                 f"tokens, the policy {len(policy_tokens)}, {len(value_tokens.items() ^ policy_tokens.items())} "
                 "(token, id) pairs not shared): it would read the policy's token ids as other tokens")
        value_vocab = AutoConfig.from_pretrained(args.value_model).get_text_config().vocab_size
        if value_vocab < policy_vocab:
            fail(f"--value-model {args.value_model!r} has a vocabulary of {value_vocab} tokens, the policy "
                 f"{policy_vocab}: the value model must read every token id the policy samples")
    if args.reward_model is not None:
        check_scalar_head(args.reward_model, "--reward-model", must_be_classifier=True)
    if args.value_lora_rank:  # its adapters' targets against its own layers (its head trains whole)
        path = args.value_model or args.model_name_or_path
        try:
            structure = ValueModel.on_meta(path)
        except (OSError, ValueError) as error:
            fail(f"cannot load the value model {path!r}: {error}")
        if problem := targets_problem(structure, tuple(args.lora_target_modules), trained_whole=("score",),
                                      flag="--lora-target-modules (with --value-lora-rank)"):
            fail(problem)


class TokenValueModel(GenericForTokenClassification, PreTrainedModel):
    """A one-label token classifier over any family's base model (`model`, transformers' AutoModel) with a `score`
    head, the layout of transformers' own XForTokenClassification, for the families that have none (Gemma 3, OLMo 2
    and 3, Qwen3.5). Which attention it may use is the base model's to say; FSDP wraps the base model's blocks."""
    _supports_sdpa = _supports_flex_attn = _supports_attention_backend = True

    def __init__(self, config: object) -> None:
        super().__init__(config)
        self._no_split_modules = self.model._no_split_modules


class ValueModel:
    """Loads any checkpoint as a token classifier with one label and no dropout on the head: one value per position
    (AutoModelForTokenClassification, or TokenValueModel for a family transformers gives none). A causal LM gets a
    fresh `score` head drawn from torch's seeded RNG (the same on every rank)."""

    @staticmethod
    def model_class(config: object) -> type:
        from transformers import AutoModelForTokenClassification
        from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

        return AutoModelForTokenClassification if config.model_type in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES \
            else TokenValueModel

    @staticmethod
    def from_pretrained(path: str, **kwargs: object) -> torch.nn.Module:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, num_labels=1)
        config.classifier_dropout = 0.0  # else 0.1: noisy values in every forward (from_pretrained drops the kwarg)
        return ValueModel.model_class(config).from_pretrained(path, config=config, **kwargs)

    @staticmethod
    def on_meta(path: str) -> torch.nn.Module:
        """The value model's structure from its config on the meta device (no weights): what its adapters target."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, num_labels=1)
        model_class = ValueModel.model_class(config)
        with torch.device("meta"):
            return TokenValueModel(config) if model_class is TokenValueModel else model_class.from_config(config)


def predicted_values(value_model: torch.nn.Module, batch: object) -> torch.Tensor:
    """V(prompt + completion[:j]) for every completion position j, [B, C] float32: the output at the column just
    before completion token j, the state in which that token was chosen."""
    logits = value_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                         position_ids=batch.position_ids, use_cache=False).logits
    return logits[:, completion_columns(batch), 0].float()


# ============================================================================================
# ALGORITHM: KL-penalised rewards, GAE, whitening, the clipped policy and value losses
# ============================================================================================


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """Ziegler et al. eq. 2 / Ouyang et al. eq. 2, per token: r_t = -beta * log(pi_old / pi_ref)_t, plus the
    completion's score at its last token: the model's last (a multi-turn episode's reply tokens are mask 0).
    kl: [B, C] per-token k1 estimates (0 on padding); scores: [B]."""
    rewards = -beta * kl
    columns = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask > 0, columns, -1).max(1).values.clamp(min=0)
    rewards[torch.arange(len(scores), device=mask.device), last] += scores.to(rewards)
    return rewards * mask


def adaptive_kl_coef(beta: float, kl: float, target_kl: float, batch_size: int, horizon: int) -> float:
    """Ziegler et al.'s adaptive KL controller: e_t = clip(KL_t / KL_target - 1, -0.2, 0.2) and
    beta_{t+1} = beta_t (1 + K_beta e_t), with K_beta = batch_size / horizon (this step's completions over the
    controller's horizon)."""
    error = min(max(kl / target_kl - 1, -0.2), 0.2)
    return beta * (1 + error * batch_size / horizon)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016, eq. 16): A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t,
    over the model's tokens of each completion [B, C] (mask 1). The state after the last token is terminal (V = 0),
    so a completion cut off at the length limit is scored as it stands. A multi-turn episode's environment tokens
    (mask 0 between model tokens) are not actions: they are how the state changes between the model's turns, so
    they are skipped, not steps: t + 1 is the model's next token, gamma and lambda discount once per model token,
    and the reply's tokens get no advantage and no return. Returns advantages and returns A + V (0 off the mask)."""
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(rewards)
    next_value = next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        acts = mask[:, t] > 0  # padding and environment tokens carry the next model token's values through
        advantages[:, t] = torch.where(acts, advantage, 0.0)
        next_advantage = torch.where(acts, advantage, next_advantage)
        next_value = torch.where(acts, values[:, t], next_value)
    return advantages, advantages + values


def moments(total: float, total_squares: float, count: float) -> tuple[float, float]:
    """Mean and unbiased variance from a sum, a sum of squares and a count (each summed over ranks)."""
    mean = total / count
    return mean, max(total_squares - count * mean**2, 0.0) / max(count - 1, 1)


def whiten(values: torch.Tensor, mask: torch.Tensor, mean: float, variance: float, eps: float = 1e-8) -> torch.Tensor:
    """Advantage whitening (N+ details): (A - mean) / sqrt(var + eps), with mean and var over every valid
    token of the global batch (world sizes 1 and 2 agree), so each minibatch sees advantages on the same scale."""
    return (values - mean) * (variance + eps) ** -0.5 * mask


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


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_eps: float) -> torch.Tensor:
    """PPO eq. 7 per token, negated to a loss: -min(r A, clip(r, 1 - eps, 1 + eps) A) for the ratio r = pi / pi_old."""
    return -torch.min(ratio * advantages, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages)


def clip_active(ratio: torch.Tensor, advantages: torch.Tensor, clip_eps: float) -> torch.Tensor:
    """1.0 where eq. 7's clipped term is the smaller one (the token then gives no gradient), else 0.0."""
    return (torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages < ratio * advantages).float()


def policy_loss(ratio: torch.Tensor, correction: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_eps: float, num_tokens: float) -> torch.Tensor:
    """The clipped surrogate of the ratio pi / pi_old, weighted by the rollout correction `correction`, summed over
    this micro-batch's tokens and divided by its minibatch's token count over all ranks (`num_tokens`), so the shares
    add up to the minibatch mean."""
    per_token = clipped_surrogate(ratio, advantages, clip_eps) * correction
    return (per_token * mask).sum() / num_tokens


def value_clip_active(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip_eps_value: float
                      ) -> torch.Tensor:
    """1.0 where the value loss's clipped term is the larger one (the token then gives the value model no gradient)."""
    clipped_values = old_values + torch.clamp(values - old_values, -clip_eps_value, clip_eps_value)
    return ((clipped_values - returns) ** 2 > (values - returns) ** 2).float()


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip_eps_value: float, num_tokens: float) -> torch.Tensor:
    """Clipped value loss (N+ details; OpenAI baselines): 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2),
    as a share of the minibatch mean like `policy_loss`."""
    clipped_values = old_values + torch.clamp(values - old_values, -clip_eps_value, clip_eps_value)
    return 0.5 * (torch.max((values - returns) ** 2, (clipped_values - returns) ** 2) * mask).sum() / num_tokens


if __name__ == "__main__":
    args = tyro.cli(Args)
    check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    run = prepare_run(args)  # seeds, process group, tokenizer, prompts, the checkpoint to resume from (PLUMBING)
    rank, world_size, device = run.rank, run.world_size, run.device

    # --- models: policy, value model (each with --lora-rank / --value-lora-rank adapters over a frozen base; the value
    # head always trains), frozen reference (the run's starting model, also on resume; with LoRA the policy with its
    # adapters switched off), judge ---
    policy = load_model(args.model_name_or_path, args, device, lora=lora_spec(args))
    value_model = load_model(args.value_model or args.model_name_or_path, args, device, model_class=ValueModel,
                             lora=lora_spec(args, args.value_lora_rank, "value"), keep_trainable=("score",))
    reference = None if args.beta == 0 else policy if args.lora_rank else load_model(
        args.model_name_or_path, args, device, trainable=False)
    reward_model = RewardModel(args.reward_model, args, device) if args.reward_model else None
    updates_per_step = args.ppo_epochs * args.num_minibatches
    optimizer, scheduler = make_optimizer(policy, args, args.learning_rate, args.total_steps * updates_per_step)
    value_optimizer, value_scheduler = make_optimizer(value_model, args, args.value_learning_rate,
                                                      args.total_steps * updates_per_step)
    trained = {"policy": (policy, optimizer), "value_model": (value_model, value_optimizer)}
    engine, tracker, start_step = start_training(run, trained, [scheduler, value_scheduler], updates_per_step)
    # the adaptive controller's state travels in the checkpoint, so a resumed run continues with the same coefficient
    beta = run.resume_state["extra"]["beta"] if start_step > 0 else args.beta

    for step in range(start_step + 1, args.total_steps + 1):
        # --- rollouts: G samples per prompt on this rank's engine, scored by the judge (PLUMBING) ---
        rollout = generate(engine, run, step)
        truncated = torch.tensor([float(s.truncated) for s in rollout.samples])
        scores = judge(reward_model, rollout) - args.missing_eos_penalty * truncated

        # ================================ ALGORITHM ================================
        # What the losses receive, per micro-batch `batch` of B completions (common/llm/batching.py):
        #   logprobs      [B, C] log pi_theta(token | prompt, earlier tokens) after temperature, with gradient;
        #   old_logprobs  the same tokens under the policy before this step's updates (the pass below), and
        #   rollout_logprobs (batch.rollout_logprobs) under the engine that sampled them; all three exactly 0.0 where
        #   batch.mask [B, C] is 0 (padding). advantages, returns: [B, C], 0.0 there too; values (with gradient) and
        #   old_values [B, C] from the value model, not zeroed on padding (the losses mask them). Each loss is the
        #   micro-batch's share of its minibatch's token mean over all ranks; FSDP averages gradients over ranks,
        #   hence the backward of loss * world_size.
        # --- one pass without gradients, in order: pi_old and its entropy, pi_ref, V_old ---
        train_start = time.time()
        policy.eval()  # dropout off, as in the engine and the reference: every forward sees one network (N+ details)
        value_model.eval()
        num_samples, completions = len(rollout.samples), rollout.completions
        width = max(1, max(map(len, completions)))
        mask = pad_completions([s.model_mask() for s in rollout.samples], width, device)  # 0: padding, env tokens
        rollout_logprobs = pad_completions([s.logprobs for s in rollout.samples], width, device)
        old_logprobs, entropy, ref_logprobs, old_values = (torch.zeros_like(mask) for _ in range(4))
        micro_batch_rows = split(range(num_samples), args.micro_batch_size)
        with torch.no_grad():
            for rows, batch in zip(micro_batch_rows, micro_batches(rollout, micro_batch_rows, run)):
                at = (slice(rows.start, rows.stop), slice(0, batch.mask.shape[1]))
                old_logprobs[at], entropy[at] = token_logprobs(policy, batch, args.temperature, with_entropy=True)
                old_values[at] = predicted_values(value_model, batch)
                if reference is not None:
                    with adapters_disabled(reference):
                        ref_logprobs[at] = token_logprobs(reference, batch, args.temperature)
        kl = (old_logprobs - ref_logprobs) * mask if reference is not None else torch.zeros_like(mask)  # k1

        # --- rewards, GAE, and this step's minibatches: the same shuffle on every rank ---
        rewards = token_rewards(scores, kl, mask, beta)
        advantages, returns = gae(rewards, old_values, mask, args.gamma, args.lam)
        minibatch_size = num_samples // args.num_minibatches
        minibatches = []
        for epoch in range(args.ppo_epochs):
            generator = torch.Generator().manual_seed(sample_seed(args.seed, step, -1, epoch))  # -1: no sample's seed
            minibatches += list(torch.randperm(num_samples, generator=generator).split(minibatch_size))
        lengths = torch.tensor([float(s.model_tokens()) for s in rollout.samples])

        # --- one collective: whitening moments, explained variance, every minibatch's global token count ---
        counts = reduce_stats({
            "tokens": mask.sum(), "sequences": num_samples, "truncated": truncated.sum(), "score": scores.sum(),
            "correct": rollout.correct.sum(), "kl": kl.sum(), "entropy": (entropy * mask).sum(),
            "advantage": advantages.sum(), "advantage_sq": (advantages ** 2).sum(), "return": returns.sum(),
            "return_sq": (returns ** 2).sum(),
            **{f"minibatch_tokens/{u}": lengths[rows].sum() for u, rows in enumerate(minibatches)}})
        num_tokens, num_sequences = counts["tokens"], counts["sequences"]
        advantages = whiten(advantages, mask, *moments(counts["advantage"], counts["advantage_sq"], num_tokens))
        totals = Totals()
        totals.add(*mismatch_stats(old_logprobs, rollout_logprobs, mask, num_tokens))  # engine vs trainer, before

        # --- update: one optimizer step per minibatch for each model, gradient accumulation over micro-batches ---
        norms = {"train/grad_norm": 0.0, "train/value_grad_norm": 0.0}  # means over this step's updates
        on_device = [minibatch.to(device) for minibatch in minibatches]  # before the loop: no copy waits on a backward
        for update, minibatch in enumerate(minibatches):
            minibatch_tokens = counts[f"minibatch_tokens/{update}"]
            indices = on_device[update].split(args.micro_batch_size)
            micro_batch_rows = [rows.tolist() for rows in minibatch.split(args.micro_batch_size)]
            for m, (index, batch) in enumerate(zip(indices, micro_batches(rollout, micro_batch_rows, run))):
                width = batch.mask.shape[1]
                old, advantage, old_value, target = (t[index, :width] for t in (old_logprobs, advantages, old_values,
                                                                                returns))
                logprobs, values = token_logprobs(policy, batch, args.temperature), predicted_values(value_model, batch)
                correction = rollout_correction(old, batch.rollout_logprobs, batch.mask, args.tis_cap,
                                               args.seq_mask_cap)
                ratio = torch.exp(logprobs - old)  # pi / pi_old per token
                pg_loss = policy_loss(ratio, correction, advantage, batch.mask, args.clip_eps, minibatch_tokens)
                vf_loss = value_loss(values, old_value, target, batch.mask, args.clip_eps_value, minibatch_tokens)
                all_reduce_at_last(m == len(micro_batch_rows) - 1, policy, value_model)  # HSDP: once per update
                ((pg_loss + args.vf_coef * vf_loss) * world_size).backward()
                with torch.no_grad():  # --- diagnostics: shares of the minibatch's token means, averaged over updates
                    totals.add({name: (value * batch.mask).sum() / minibatch_tokens for name, value in {
                        "train/clip_fraction": clip_active(ratio, advantage, args.clip_eps),
                        "train/value_clip_fraction": value_clip_active(values, old_value, target, args.clip_eps_value),
                        "train/approx_kl": 0.5 * (logprobs - old) ** 2,  # N+ details
                        "mismatch/tis_weight_mean": correction,
                    }.items()}, {"mismatch/tis_weight_max": (correction * batch.mask).max()}, divisor=updates_per_step)
                    kept = sequence_mask(old, batch.rollout_logprobs, batch.mask, args.seq_mask_cap) \
                        if args.seq_mask_cap else batch.mask.new_ones(())
                    totals.add({"mismatch/masked_fraction": (1 - kept).sum() / num_sequences},
                               divisor=args.ppo_epochs)  # each epoch visits every completion once
                    totals.add({"train/loss": pg_loss, "train/value_loss": vf_loss}, divisor=updates_per_step)
            grad_norm, learning_rate = optimizer_step(policy, optimizer, scheduler, args.max_grad_norm, step)
            value_grad_norm, value_learning_rate = optimizer_step(value_model, value_optimizer, value_scheduler,
                                                                  args.max_grad_norm, step)
            norms["train/grad_norm"] += grad_norm / updates_per_step
            norms["train/value_grad_norm"] += value_grad_norm / updates_per_step
        train_s = time.time() - train_start
        # ============================== END ALGORITHM ==============================

        # --- weight sync into the engine; the step's metrics, reduced by name; evaluation, logs, checkpoint ---
        sync_s = sync_weights(engine, policy, args.dtype, rollout)
        # explained variance 1 - Var(R - V_old) / Var(R) over valid tokens, where R - V_old is GAE's advantage
        _, return_variance = moments(counts["return"], counts["return_sq"], num_tokens)
        _, error_variance = moments(counts["advantage"], counts["advantage_sq"], num_tokens)
        sequence_kl = counts["kl"] / num_sequences
        metrics = {
            "train/score": counts["score"] / num_sequences,
            "train/accuracy": counts["correct"] / num_sequences,
            "train/non_score_reward": -beta * sequence_kl,
            "train/kl": counts["kl"] / num_tokens,
            "train/sequence_kl": sequence_kl,
            "train/beta": beta,
            "train/completion_length": num_tokens / num_sequences,
            "train/truncated_fraction": counts["truncated"] / num_sequences,
            "train/entropy": counts["entropy"] / num_tokens,
            "train/explained_variance": 1 - error_variance / return_variance if return_variance > 0 else 0.0,
            **norms,
            "train/learning_rate": learning_rate,
            "train/value_learning_rate": value_learning_rate,
            **totals.reduce(),
            "perf/rollout_tokens_per_s": num_tokens / rollout.seconds,
            "perf/train_tokens_per_s": num_tokens * args.ppo_epochs / train_s,
            "perf/train_s": train_s,
            "perf/weight_sync_s": sync_s,
        }
        if args.target_kl is not None:  # the next step's coefficient
            beta = adaptive_kl_coef(beta, sequence_kl, args.target_kl, int(num_sequences), args.kl_horizon)
        end_step(run, engine, tracker, step, rollout, metrics, trained, extra={"beta": beta})

    finish(run, engine, tracker, policy, metrics)
