"""GRPO: Group Relative Policy Optimization for LLMs with verifiable rewards, on an embedded vLLM engine.

Paper: Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
arXiv:2402.03300 (GRPO, section 4). Options from DAPO (Yu et al., arXiv:2503.14476: clip-higher, token-level loss) and
Dr. GRPO (Liu et al., arXiv:2503.20783: no length or std normalisation).

Each torchrun rank holds one vLLM engine for rollouts and one FSDP2 shard of the policy for training; after every
update the full weights are pushed into the engine. Same arguments + same machine + same world size = same bits.

    torchrun --nproc_per_node 2 grpo_llm.py --seed 1
"""

import importlib.util
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
import tyro

from common.checkpoint import resolve_checkpoint, save_checkpoint
from common.determinism import parameter_hash, restore_rng_states, rng_states, seed_everything
from common.distributed import all_ranks_ok, fail, init_distributed
from common.rollout import make_engine, sample_seed
from common.tasks import Example, Task, make_task
from common.tracking import RunTracker, get_logger

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
    total_steps: int = 200
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
    micro_batch_size: int = 64
    """completions per forward/backward on each rank (gradient accumulation over the rest)"""
    learning_rate: float = 2e-4
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
    """a checkpoint directory (or a run's checkpoints/ directory) to continue from"""


def check_args(args: Args, world_size: int) -> None:
    """Reject bad input on every rank, before any collective can hang."""
    for name in ("total_steps", "prompts_per_step", "num_generations", "micro_batch_size", "max_completion_length",
                 "vllm_tp", "max_prompt_length", "num_iterations"):
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("learning_rate", "temperature"):
        if not getattr(args, name) > 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.prompts_per_step % world_size:
        fail(f"--prompts-per-step {args.prompts_per_step} must be divisible by the world size {world_size}")
    per_rank = args.prompts_per_step // world_size * args.num_generations
    if per_rank % args.micro_batch_size:
        fail(f"completions per rank ({args.prompts_per_step} prompts / {world_size} ranks x {args.num_generations} "
             f"generations = {per_rank}) must be divisible by --micro-batch-size {args.micro_batch_size}")
    if args.scale_rewards == "group" and args.num_generations < 2:
        fail("--num-generations must be at least 2 to compute a group's reward std")
    if world_size % args.vllm_tp:
        fail(f"--vllm-tp {args.vllm_tp} must divide the world size {world_size}")
    if args.clip_eps_low < 0 or args.clip_eps_high < 0 or args.beta < 0 or args.tis_cap < 0:
        fail("--clip-eps-low, --clip-eps-high, --beta and --tis-cap must be non-negative")
    if args.eval_every < 0 or args.save_every < 0 or args.keep_last < 0 or args.warmup_steps < 0:
        fail("--eval-every, --save-every, --keep-last and --warmup-steps must be non-negative")
    if args.track and importlib.util.find_spec("wandb") is None:
        fail("--track needs Weights & Biases: pip install wandb")
    if not os.path.isdir(args.model_name_or_path) and (os.path.exists(args.model_name_or_path)
                                                       or args.model_name_or_path.startswith(("/", "./", "../"))):
        fail(f"--model-name-or-path {args.model_name_or_path!r} is not a model directory")


# ============================================================================================
# ALGORITHM: advantages, per-token logprobs, the clipped surrogate and its aggregation
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


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float) -> torch.Tensor:
    """log pi(token_t | tokens_<t) under the temperature-scaled distribution, for t = 1..T-1: [B, T-1]."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


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


def learning_rate_factor(step: int, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """Linear warm-up to 1, then constant, linear or cosine decay to 0 at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if schedule == "linear":
        return max(0.0, 1 - progress)
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return 1.0


# ============================================================================================
# PLUMBING: model loading, batching, weight export, evaluation, checkpoints
# ============================================================================================


def load_policy(path: str, dtype: str, device: torch.device, world_size: int) -> torch.nn.Module:
    """The HF model in float32 master weights, sharded with FSDP2 per transformer block (the classes the model names
    in `_no_split_modules`, e.g. Qwen2DecoderLayer) and at the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    mesh = init_device_mesh(device.type, (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    for block in [m for m in model.modules() if type(m).__name__ in block_classes]:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def full_weights(model: torch.nn.Module, dtype: str) -> list[tuple[str, torch.Tensor]]:
    """Gather every shard into full tensors (a collective: all ranks call it) in the rollout dtype."""
    return [(name, tensor.full_tensor().to(getattr(torch, dtype))) for name, tensor in model.state_dict().items()]


def pad_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt+completion ids, their attention mask, and a [B, T-1] mask of completion-token targets."""
    length = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    targets = torch.zeros((len(prompts), length - 1))
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        ids[row, :len(prompt) + len(completion)] = torch.tensor(prompt + completion)
        attention[row, :len(prompt) + len(completion)] = 1
        targets[row, len(prompt) - 1:len(prompt) - 1 + len(completion)] = 1
    return ids.to(device), attention.to(device), targets.to(device)


def completion_tensor(values: list[list[float]], like: torch.Tensor, prompt_lengths: list[int]) -> torch.Tensor:
    """Place per-completion-token values at their target positions of a [B, T-1] tensor shaped like `like`."""
    out = torch.zeros_like(like)
    for row, (row_values, start) in enumerate(zip(values, prompt_lengths)):
        out[row, start - 1:start - 1 + len(row_values)] = torch.tensor(row_values, dtype=out.dtype)
    return out


def score(task: Task, tokenizer: object, examples: list[Example], completions: list[list[int]]) -> list[float]:
    """Rewards of decoded completions; a reward function that raises names the prompt and completion."""
    rewards = []
    for example, ids in zip(examples, completions):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        try:
            rewards.append(float(task.reward(text, example)))
        except Exception as error:
            raise RuntimeError(f"reward function failed on prompt {example.prompt!r} with completion {text!r}: "
                               f"{error!r}") from error
    return rewards


def evaluate(engine: object, task: Task, tokenizer: object, test_ids: list[list[int]], args: Args, rank: int,
             world_size: int) -> dict[str, float]:
    """Held-out greedy accuracy, the test prompts split round-robin over ranks and the counts summed."""
    count = len(task.test) if args.num_eval_prompts == 0 else min(args.num_eval_prompts, len(task.test))
    indices = list(range(rank, count, world_size))
    samples = engine.generate([test_ids[i] for i in indices], [0] * len(indices), args.max_completion_length, 0.0,
                              tokenizer.eos_token_id)
    texts = [tokenizer.decode(s.completion_ids, skip_special_tokens=True) for s in samples]
    examples = [task.test[i] for i in indices]
    totals = torch.tensor([sum(task.reward(t, e) for t, e in zip(texts, examples)),
                           sum(getattr(task, "flexible_reward", task.reward)(t, e) for t, e in zip(texts, examples))],
                          dtype=torch.float64)
    dist.all_reduce(totals)
    metrics = {"eval/accuracy": totals[0].item() / count}
    if hasattr(task, "flexible_reward"):
        metrics["eval/accuracy_flexible"] = totals[1].item() / count
    return metrics


def gather_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, args: Args,
                          world_size: int) -> dict[str, object]:
    """Full (unsharded) model and optimizer state plus every rank's RNG state, on rank 0; all ranks must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    all_rng = [None] * world_size
    dist.all_gather_object(all_rng, rng_states())
    return {"model": get_model_state_dict(model, options=options),
            "trainer": {"step": step, "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
                        "rng": all_rng, "world_size": world_size, "args": vars(args)}}


def write_checkpoint(path: Path, model: torch.nn.Module, tokenizer: object, state: dict[str, object]) -> None:
    """The policy with save_pretrained (loadable by transformers and vLLM), plus what resuming needs."""
    model.save_pretrained(path, state_dict=state["model"])
    tokenizer.save_pretrained(path)
    torch.save(state["trainer"], path / "trainer_state.pt")


if __name__ == "__main__":
    args = tyro.cli(Args)
    world_size_env = int(os.environ.get("WORLD_SIZE", "1"))
    check_args(args, world_size_env)
    determinism = seed_everything(args.seed, args.deterministic)  # before any engine: sets CUDA/vLLM env flags
    rank, world_size, device = init_distributed()
    log = get_logger(rank)

    # --- setup: task, tokenizer, policy, optimizer, rollout engine (TRY NOT TO MODIFY) ---
    from transformers import AutoConfig, AutoTokenizer

    resume_dir = None
    if args.resume:
        try:
            resume_dir = resolve_checkpoint(args.resume)
        except FileNotFoundError as error:
            fail(str(error))
    model_path = str(resume_dir) if resume_dir else args.model_name_or_path
    try:
        AutoConfig.from_pretrained(model_path)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as error:
        fail(f"cannot load model {model_path!r}: {error}")
    try:
        task = make_task(args.task)
    except Exception as error:  # datasets raises many types for a missing dataset
        fail(f"cannot load task {args.task!r}: {error}")
    trainer_state = torch.load(resume_dir / "trainer_state.pt", weights_only=False) if resume_dir else None
    if trainer_state and trainer_state["world_size"] != world_size:
        fail(f"checkpoint was written with world size {trainer_state['world_size']}, this run has {world_size}")

    def encode_all(examples: list[Example]) -> list[list[int]]:
        texts = [task.format_prompt(tokenizer, example) for example in examples]
        return tokenizer(texts, add_special_tokens=not getattr(tokenizer, "chat_template", None)).input_ids

    train_ids = encode_all(task.train)
    keep = [i for i, ids in enumerate(train_ids) if len(ids) <= args.max_prompt_length]
    if len(keep) < args.prompts_per_step:
        fail(f"only {len(keep)} training prompts fit --max-prompt-length {args.max_prompt_length}")
    if len(keep) < len(train_ids):
        log.info(f"dropped {len(train_ids) - len(keep)} training prompts longer than {args.max_prompt_length} tokens")
    train_examples, train_ids = [task.train[i] for i in keep], [train_ids[i] for i in keep]
    test_ids = [ids[-args.max_prompt_length:] for ids in encode_all(task.test)]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    policy = load_policy(model_path, args.dtype, device, world_size)
    reference = None
    if args.beta > 0:  # frozen reference = the starting model of the whole run, not of a resumed segment
        reference = load_policy(args.model_name_or_path, args.dtype, device, world_size).eval()
        reference.requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    total_updates = args.total_steps * args.num_iterations
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: learning_rate_factor(
        update, args.warmup_steps, total_updates, args.lr_schedule))
    start_step = 0
    if trainer_state:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(policy, optimizer, trainer_state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
        start_step = trainer_state["step"]
        for _ in range(start_step * args.num_iterations):  # the schedule is a pure function of the update count
            scheduler.step()
        restore_rng_states(trainer_state["rng"][rank])
    max_model_len = max(len(ids) for ids in train_ids + test_ids) + args.max_completion_length
    engine = make_engine(args.rollout_engine, model_path, args.dtype, args.vllm_tp, max_model_len, device,
                         args.vllm_kv_cache_memory_bytes, args.vllm_gpu_memory_utilization)
    tracker = RunTracker(args, args.exp_name, rank, world_size, determinism, args.track, args.wandb_project_name,
                         args.run_root)
    checkpoint_root = tracker.run_dir / "checkpoints" if rank == 0 else None
    log.info(f"world size {world_size}, {type(engine).__name__}, {len(train_ids)} train / {len(test_ids)} test "
             f"prompts, starting after step {start_step}")

    prompts_per_rank = args.prompts_per_step // world_size
    steps_per_epoch = len(train_ids) // args.prompts_per_step
    metrics: dict[str, float] = {}
    if start_step > 0:  # the same weight path as the uninterrupted run took into the engine
        engine.update_weights(full_weights(policy, args.dtype))
    else:
        metrics = evaluate(engine, task, tokenizer, test_ids, args, rank, world_size)
        tracker.log(0, metrics)
        tracker.write_json("eval_before.json", metrics)
        log.info(f"held-out greedy accuracy before training: {metrics['eval/accuracy']:.4f}")

    for step in range(start_step + 1, args.total_steps + 1):
        step_start = time.time()
        # --- prompts: a fixed permutation per epoch, each rank a contiguous slice (TRY NOT TO MODIFY) ---
        epoch, position = divmod(step - 1, steps_per_epoch)
        order = torch.randperm(len(train_ids), generator=torch.Generator().manual_seed(args.seed * 100_003 + epoch))
        step_indices = order[position * args.prompts_per_step:(position + 1) * args.prompts_per_step].tolist()
        first_prompt = rank * prompts_per_rank
        my_indices = step_indices[first_prompt:first_prompt + prompts_per_rank]

        # --- rollouts: G samples per prompt, each with its own seed ---
        rollout_start = time.time()
        prompts = [train_ids[i] for i in my_indices for _ in range(args.num_generations)]
        seeds = [sample_seed(args.seed, step, first_prompt + p, g)
                 for p in range(prompts_per_rank) for g in range(args.num_generations)]
        samples = engine.generate(prompts, seeds, args.max_completion_length, args.temperature, tokenizer.eos_token_id)
        engine.sleep()
        rollout_s = time.time() - rollout_start
        completions = [s.completion_ids for s in samples]
        examples = [train_examples[i] for i in my_indices for _ in range(args.num_generations)]
        try:
            rewards_local, reward_error = score(task, tokenizer, examples, completions), None
        except RuntimeError as error:
            rewards_local, reward_error = [], error
        if not all_ranks_ok(reward_error is None):
            fail(str(reward_error) if reward_error else "a reward function failed on another rank")

        # ================================ ALGORITHM ================================
        # --- advantages: group-relative, computed over the global batch ---
        rewards = torch.tensor(rewards_local, dtype=torch.float32)
        all_rewards = [torch.zeros_like(rewards) for _ in range(world_size)]
        dist.all_gather(all_rewards, rewards)
        grouped = torch.cat(all_rewards).view(args.prompts_per_step, args.num_generations)
        advantages_all = group_advantages(grouped, args.scale_rewards).flatten()
        advantages = advantages_all.view(world_size, -1)[rank]
        batch_counts = torch.tensor([sum(len(c) for c in completions), len(completions)], dtype=torch.float64)
        dist.all_reduce(batch_counts)
        num_tokens, num_sequences = int(batch_counts[0].item()), int(batch_counts[1].item())

        # --- update: mu optimizer steps on this batch, gradient accumulation over micro-batches ---
        train_start = time.time()
        policy.train()
        micro_batches = [range(s, s + args.micro_batch_size) for s in range(0, len(samples), args.micro_batch_size)]
        prompt_lengths = [len(p) for p in prompts]
        old_logprobs: list[torch.Tensor | None] = [None] * len(micro_batches)
        if args.num_iterations > 1:  # pi_old: the trainer's own logprobs before the first of the mu updates
            with torch.no_grad():
                for m, rows in enumerate(micro_batches):
                    ids, attention, _ = pad_batch([prompts[r] for r in rows], [completions[r] for r in rows], pad_id,
                                                  device)
                    old_logprobs[m] = token_logprobs(policy, ids, attention, args.temperature)
        stats = {key: torch.zeros((), dtype=torch.float64) for key in
                 ("loss", "clip", "kl", "mismatch_abs", "mismatch_kl", "tis_weight")}
        mismatch_max = torch.zeros((), dtype=torch.float64)
        for iteration in range(args.num_iterations):
            optimizer.zero_grad(set_to_none=True)
            for m, rows in enumerate(micro_batches):
                ids, attention, mask = pad_batch([prompts[r] for r in rows], [completions[r] for r in rows], pad_id,
                                                 device)
                lengths_mb = [prompt_lengths[r] for r in rows]
                logprobs = token_logprobs(policy, ids, attention, args.temperature)
                old = old_logprobs[m] if old_logprobs[m] is not None else logprobs.detach()
                rollout_logprobs = completion_tensor([samples[r].logprobs for r in rows], old, lengths_mb)
                advantage = advantages[list(rows)].to(device)[:, None]
                per_token, clipped = clipped_surrogate(logprobs, old, advantage, args.clip_eps_low, args.clip_eps_high)
                if args.tis_cap > 0:  # truncated IS: correct for rollouts drawn from vLLM's pi, not the trainer's
                    tis_weight = torch.exp(old - rollout_logprobs).clamp(max=args.tis_cap)
                    per_token = per_token * tis_weight
                else:
                    tis_weight = torch.ones_like(old)
                if reference is not None:
                    with torch.no_grad():
                        ref_logprobs = token_logprobs(reference, ids, attention, args.temperature)
                    kl = k3_kl(logprobs, ref_logprobs)
                    per_token = per_token + args.beta * kl
                    stats["kl"] += ((kl.detach() * mask).sum() / num_tokens).double().cpu()
                loss = aggregate_loss(per_token, mask, args.loss_type, num_sequences, num_tokens,
                                      args.max_completion_length)
                (loss * world_size).backward()  # FSDP averages gradients over ranks; the loss is already a global sum
                if iteration == 0:
                    gap = (old - rollout_logprobs) * mask
                    stats["mismatch_abs"] += (gap.abs().sum() / num_tokens).double().cpu()
                    mismatch_max = torch.maximum(mismatch_max, gap.abs().max().double().cpu())
                    stats["mismatch_kl"] += ((k3_kl(rollout_logprobs, old) * mask).sum() / num_tokens).double().cpu()
                    stats["tis_weight"] += ((tis_weight * mask).sum() / num_tokens).double().cpu()
                stats["loss"] += loss.detach().double().cpu() / args.num_iterations
                stats["clip"] += ((clipped * mask).sum() / num_tokens / args.num_iterations).double().cpu()
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            if not all_ranks_ok(math.isfinite(grad_norm) and math.isfinite(stats["loss"].item())):
                fail(f"non-finite loss or gradient at step {step} (loss {stats['loss'].item()}, grad norm "
                     f"{grad_norm}); the last checkpoint is left as it was")
            learning_rate = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
        train_s = time.time() - train_start
        # ============================== END ALGORITHM ==============================

        # --- weight sync: full tensors from the FSDP shards into the rollout engine ---
        sync_start = time.time()
        engine.update_weights(full_weights(policy, args.dtype))
        sync_s = time.time() - sync_start

        # --- logging (global numbers: every rank contributes) ---
        num_truncated = torch.tensor(sum(s.truncated for s in samples), dtype=torch.float64)
        totals = torch.stack([*stats.values(), num_truncated])
        dist.all_reduce(totals)
        dist.all_reduce(mismatch_max, op=dist.ReduceOp.MAX)
        flat_rewards = grouped.flatten()
        metrics = {
            "train/reward_mean": flat_rewards.mean().item(),
            "train/reward_std": flat_rewards.std().item(),
            "train/accuracy": (flat_rewards >= 1).float().mean().item(),
            "train/completion_length": num_tokens / num_sequences,
            "train/truncated_fraction": totals[6].item() / num_sequences,
            "train/loss": totals[0].item(),
            "train/clip_fraction": totals[1].item(),
            "train/grad_norm": grad_norm,
            "train/learning_rate": learning_rate,
            "mismatch/logprob_abs_diff_mean": totals[3].item(),
            "mismatch/logprob_abs_diff_max": mismatch_max.item(),
            "mismatch/kl": totals[4].item(),
            "mismatch/tis_weight_mean": totals[5].item(),
            "perf/rollout_tokens_per_s": num_tokens / rollout_s,
            "perf/train_tokens_per_s": num_tokens * args.num_iterations / train_s,
            "perf/weight_sync_s": sync_s,
            "perf/step_s": time.time() - step_start,
        }
        if reference is not None:
            metrics["train/kl"] = totals[2].item() / args.num_iterations
        if step == args.total_steps or (args.eval_every and step % args.eval_every == 0):
            metrics.update(evaluate(engine, task, tokenizer, test_ids, args, rank, world_size))
        tracker.log(step, metrics)
        tracker.progress(step, args.total_steps, {
            "reward": metrics["train/reward_mean"], "acc": metrics["train/accuracy"],
            **({"eval_acc": metrics["eval/accuracy"]} if "eval/accuracy" in metrics else {}),
            "tok/s": metrics["perf/rollout_tokens_per_s"]}, first_step=start_step)

        # --- checkpoint (atomic): every --save-every steps and at the end ---
        if (args.save_every and step % args.save_every == 0) or step == args.total_steps:
            state = gather_training_state(policy, optimizer, step, args, world_size)  # a collective
            if rank == 0:
                save_checkpoint(checkpoint_root, step, lambda path, state=state: write_checkpoint(
                    path, policy, tokenizer, state), args.keep_last)
            dist.barrier()

    final_hash = parameter_hash(policy)
    tracker.write_json("final.json", {"step": args.total_steps, "parameter_sha256": final_hash, **metrics})
    log.info(f"done: held-out greedy accuracy {metrics.get('eval/accuracy', float('nan')):.4f}, "
             f"parameters sha256 {final_hash[:16]}")
    tracker.close()
    engine.close()
    if dist.is_initialized():
        dist.destroy_process_group()
