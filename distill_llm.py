"""On-policy distillation for LLMs: the student samples on an embedded vLLM engine, a frozen teacher grades every
token of the student's own completions, and the student follows a policy gradient on those grades.

Papers: Agarwal et al., "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes" (GKD),
ICLR 2024, arXiv:2306.13649; Lu et al. (Thinking Machines), "On-Policy Distillation", 2025; the Qwen3 technical
report, arXiv:2505.09388 (sec. 4.5, on-policy distillation of the smaller models from the larger ones).

In plain words: every step the student samples G completions per prompt, exactly as GRPO does. The teacher computes
the log-probability of each token the student chose. Each token's reward is how much more likely the teacher found it
than the student, r_t = -(log pi_student(x_t) - log pi_teacher(x_t)): a one-sample estimate of the negative reverse
KL at that token. Each token's advantage is its own reward (Thinking Machines' discount factor of zero: no sum over
later tokens, no baseline), and the student takes one REINFORCE step on it. Where the teacher agrees with the student
the reward is 0; the teacher pulls probability towards what it would say, on the states the student actually visits
(its own mistakes included), which is what separates this from distillation on a fixed dataset. With
`--task-reward-weight w` the task's verifiable reward joins in: w times the completion's score minus its group's mean
is added to every token's advantage (distillation and RL in one run).

Each torchrun rank holds one vLLM engine for the student's rollouts, one FSDP2 shard of the student and one of the
teacher (frozen, in --dtype, like a reference model); after every update the student's weights stream into the
engine. Same arguments + same machine + same world size = same bits. With `--rollout-ranks K --max-staleness 1` the
completions come from the student one update back: truncated importance sampling (TIS, as in GRPO) reweights each
token by min(pi_old / pi_rollout, cap). The teacher must share the student's tokenizer (checked before anything
loads); an output layer padded to more rows than the student's (Qwen2.5-7B's 152,064 against Qwen2.5-1.5B's 151,936)
is graded over the student's rows, so both distributions are over the same ids.

Both models are graded at --temperature: log softmax(z / T) of each, so the reward is 0 where their logits z agree and
the student is pulled towards the teacher's logits at any T (TRL's GKDTrainer scales both logits by its temperature
too). Grading the teacher at 1 while the student samples at T (tinker-cookbook's on-policy distillation, whose
teacher log-probabilities take no temperature) would pull the student's logits towards T times the teacher's. At the
default T = 1 the two are the same.

    torchrun --nproc_per_node 2 distill_llm.py --seed 1
    torchrun --nproc_per_node 8 distill_llm.py --seed 1 --model-name-or-path Qwen/Qwen3-8B-Base \
        --teacher-model Qwen/Qwen3-32B --dtype bfloat16
"""

import os
import time
from dataclasses import dataclass

import torch
import tyro

from common.distributed import Totals, fail, reduce_stats
from common.llm.batching import micro_batches, mismatch_stats, split, token_logprobs
from common.llm.checks import check_llm_args
from common.llm.lifecycle import end_step, finish, prepare_run, start_training
from common.llm.lora import lora_spec
from common.llm.models import all_reduce_at_last, load_model, make_optimizer, optimizer_step
from common.llm.rollouts import generate, sync_weights
from common.llm.run import LLMArgs
from common.llm.scoring import check_teacher


@dataclass
class Args(LLMArgs):
    """On-policy distillation's own flags. The shared ones (model = the student, task, steps, prompts, G, optimizer,
    engine, FSDP, evaluation, checkpoints) and their defaults: LLMArgs in common/llm/run.py."""
    exp_name: str = "distill_llm"
    """the name of this experiment (the run directory is runs/{exp_name}__{seed}__{timestamp})"""
    teacher_model: str = "assets/tiny-adder-teacher"
    """the frozen teacher (hub id or path): a causal LM with the student's tokenizer, of any size. The default is the
    embedded adder after 400 steps of our GRPO (assets/tiny-adder-teacher/build_info.json)"""
    task_reward_weight: float = 0.0
    """w: add w * (score - the group's mean score) to every token's advantage (distillation plus RL); 0: pure
    distillation (the task's score is still logged)"""
    tis_cap: float = 2.0
    """truncated importance sampling: weight tokens by min(pi_old / pi_rollout, cap); 0 turns it off"""


def check_args(args: Args, world_size: int) -> None:
    """Reject bad input on every rank, before any collective can hang (the shared checks, then distillation's own,
    the teacher's tokenizer among them)."""
    check_llm_args(args, world_size)
    if args.dynamic_sampling_rounds:
        fail("--dynamic-sampling-rounds is GRPO's (grpo_llm.py): distillation's reward is never the same for a group")
    if args.task_reward_weight < 0 or args.tis_cap < 0:
        fail("--task-reward-weight and --tis-cap must be non-negative")
    if args.task_reward_weight and args.num_generations < 2:
        fail("--task-reward-weight needs --num-generations of at least 2: the task's advantage is the score minus the "
             "group's mean")
    check_teacher(args.model_name_or_path, args.teacher_model)


# ============================================================================================
# ALGORITHM: the per-token reward from the teacher, and the policy-gradient loss
# ============================================================================================


def distillation_rewards(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor
                         ) -> torch.Tensor:
    """GKD / On-Policy Distillation's per-token reward, the negative reverse KL estimate at each sampled token:
    r_t = -(log pi_student(x_t) - log pi_teacher(x_t)), 0 where mask is 0 (padding, an environment's tokens). [B, C],
    no gradient (the student's logprobs are those before the update)."""
    return -(student_logprobs - teacher_logprobs).detach() * mask


def task_advantages(scores: torch.Tensor) -> torch.Tensor:
    """scores: [num_prompts, G]. The task's part of the advantage: each score minus its group's mean (GRPO's
    advantage without the std, Dr. GRPO's form). [num_prompts, G]."""
    return scores - scores.mean(dim=1, keepdim=True)


def truncated_importance_weight(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float
                                ) -> torch.Tensor:
    """TIS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"): the tokens were
    drawn from the engine's pi_rollout, so weight each by min(pi_old / pi_rollout, cap); a constant, no gradient.
    cap 0 turns it off (weight 1). [B, C], like the logprobs."""
    if cap <= 0:
        return torch.ones_like(old_logprobs)
    return torch.exp(old_logprobs - rollout_logprobs).clamp(max=cap).detach()


def distillation_loss(logprobs: torch.Tensor, advantages: torch.Tensor, correction: torch.Tensor, mask: torch.Tensor,
                      num_tokens: int) -> torch.Tensor:
    """REINFORCE with a per-token advantage A_t, weighted by TIS's w_t, as a micro-batch's share of the mean over the
    batch's `num_tokens` model tokens (all ranks): -sum_t w_t A_t log pi_theta(x_t) / num_tokens. Its gradient is
    -sum_t w_t A_t grad log pi_theta(x_t) / num_tokens; A and w carry no gradient. logprobs, advantages, correction,
    mask: [B, C]."""
    return -(correction * advantages * logprobs * mask).sum() / num_tokens


if __name__ == "__main__":
    args = tyro.cli(Args)
    check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    run = prepare_run(args)  # seeds, process group, tokenizer, prompts, the checkpoint to resume from (PLUMBING)
    rank, world_size, device = run.rank, run.world_size, run.device

    # --- models: the student (with --lora-rank, adapters over a frozen base) and the frozen teacher ---
    student = load_model(args.model_name_or_path, args, device, lora=lora_spec(args))
    teacher = load_model(args.teacher_model, args, device, trainable=False)
    vocabulary = student.get_output_embeddings().weight.shape[0]  # the ids the student samples: the teacher's
    # output layer may be padded to more rows (check_teacher), graded over these only
    optimizer, scheduler = make_optimizer(student, args, args.learning_rate, args.total_steps)
    trained = {"policy": (student, optimizer)}
    engine, tracker, start_step = start_training(run, trained, [scheduler], updates_per_step=1)

    for step in range(start_step + 1, args.total_steps + 1):
        # --- rollouts: G samples per prompt on this rank's engine, scored by the task (PLUMBING) ---
        rollout = generate(engine, run, step)
        scores = rollout.task_scores  # this rank's prompts, whole groups

        # ================================ ALGORITHM ================================
        # What the loss receives, per micro-batch `batch` of B completions (common/llm/batching.py):
        #   logprobs [B, C] log pi_student(token | prompt, earlier tokens) after temperature, with gradient;
        #   teacher_logprobs the same under the frozen teacher, computed once per batch; rollout_logprobs
        #   (batch.rollout_logprobs) under the engine that sampled them. All are exactly 0.0 where batch.mask [B, C]
        #   is 0 (padding, a tool's tokens). The loss is the micro-batch's share of the batch's mean over model
        #   tokens (all ranks); FSDP averages gradients over ranks, hence the backward of loss * world_size.
        task_advantage = task_advantages(scores.view(-1, args.num_generations)).flatten() * args.task_reward_weight
        counts = reduce_stats({"tokens": sum(s.model_tokens() for s in rollout.samples),  # the model's, not the env's
                               "sequences": len(rollout.samples), "score": scores.sum(),
                               "truncated": sum(s.truncated for s in rollout.samples), "correct": sum(rollout.correct)})
        num_tokens, num_sequences = int(counts["tokens"]), int(counts["sequences"])

        # --- update: one optimizer step, gradient accumulation over micro-batches ---
        train_start = time.time()
        student.eval()  # dropout off, as in the engine and the teacher: every forward sees one network
        micro_batch_rows = split(range(len(rollout.samples)), args.micro_batch_size)
        batches = micro_batches(rollout, micro_batch_rows, run)
        task_advantage = [task_advantage[list(rows), None].to(device) for rows in micro_batch_rows]  # copied once
        with torch.no_grad():  # the teacher's grades, once per batch, at the student's temperature (docstring)
            teacher_logprobs = [token_logprobs(teacher, batch, args.temperature, vocabulary=vocabulary)
                                for batch in batches]
        totals = Totals()
        for m, batch in enumerate(batches):
            logprobs = token_logprobs(student, batch, args.temperature)
            old = logprobs.detach()  # one update per batch: the student before it is the one in this forward
            rewards = distillation_rewards(old, teacher_logprobs[m], batch.mask)
            advantages = rewards + task_advantage[m] * batch.mask
            correction = truncated_importance_weight(old, batch.rollout_logprobs, args.tis_cap)  # the engine's tokens
            loss = distillation_loss(logprobs, advantages, correction, batch.mask, num_tokens)
            all_reduce_at_last(m == len(batches) - 1, student)  # HSDP: across nodes once per update
            (loss * world_size).backward()
            with torch.no_grad():  # --- diagnostics: the reverse KL estimate, the teacher's and student's tokens ---
                totals.add({"train/loss": loss, "train/reverse_kl": -rewards.sum() / num_tokens,
                            "train/teacher_logprob": (teacher_logprobs[m] * batch.mask).sum() / num_tokens,
                            "train/student_logprob": (old * batch.mask).sum() / num_tokens,
                            "mismatch/tis_weight_mean": (correction * batch.mask).sum() / num_tokens},
                           {"mismatch/tis_weight_max": (correction * batch.mask).max()})
                totals.add(*mismatch_stats(old, batch.rollout_logprobs, batch.mask, num_tokens))
        grad_norm, learning_rate = optimizer_step(student, optimizer, scheduler, args.max_grad_norm, step)
        train_s = time.time() - train_start
        # ============================== END ALGORITHM ==============================

        # --- weight sync into the engine; the step's metrics, reduced by name; evaluation, logs, checkpoint ---
        sync_s = sync_weights(engine, student, args.dtype, rollout)
        metrics = {
            "train/score": counts["score"] / num_sequences,
            "train/accuracy": counts["correct"] / num_sequences,
            "train/completion_length": num_tokens / num_sequences,
            "train/truncated_fraction": counts["truncated"] / num_sequences,
            "train/grad_norm": grad_norm,
            "train/learning_rate": learning_rate,
            **totals.reduce(),
            "perf/rollout_tokens_per_s": num_tokens / rollout.seconds,
            "perf/train_tokens_per_s": num_tokens / train_s,
            "perf/train_s": train_s,
            "perf/weight_sync_s": sync_s,
        }
        end_step(run, engine, tracker, step, rollout, metrics, trained)

    finish(run, engine, tracker, student, metrics)
