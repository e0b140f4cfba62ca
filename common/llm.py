"""The LLM plumbing that grpo_llm.py, dpo_online.py and ppo_llm.py share, so each script shows only its algorithm:
loading and sharding models (FSDP2), prompts and the per-step prompt stream, padded batches, memory-lean per-token
logprobs, scoring with a named failure, greedy evaluation, streamed weight export, and sharded checkpoints.

Sizes that decided the design, for Qwen2.5-0.5B (vocabulary V = 151,936) with micro-batches of 8 sequences of
512 prompt + 1,024 completion tokens:
- logits for every position in float32, then three float32 copies (cast, / temperature, log_softmax) would be
  4 x 8 x 1,536 x V x 4 B = 30 GB; `sequence_logprobs` keeps logits only for completion positions, in the compute
  dtype (8 x 1,024 x V x 2 B = 2.5 GB in bfloat16, and as much again for their gradient), and works through them
  in chunks of CHUNK_ROWS rows (256 x V x 4 B = 156 MB per float32 temporary).
- a 7B policy is 28 GB in float32 and its Adam state 56 GB more: checkpoints are written by every rank for its own
  shard (torch.distributed.checkpoint), and the exported model is gathered one tensor at a time.
"""

import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from common.checkpoint import check_resume_args, resolve_checkpoint, save_checkpoint_all_ranks
from common.determinism import rng_states
from common.distributed import all_ranks_ok, fail, reduce_stats, save_group
from common.tasks import Example, Task, make_task

CHUNK_ROWS = 256  # rows of the [rows, V] logits turned into float32 at a time
EXPORT_SHARD_BYTES = 2 * 2**30  # safetensors file size of an exported model
SYNC_BUCKET_BYTES = 256 * 2**20  # full tensors held at once while streaming weights (a 0.5B layer is 30 MB in bf16)


# ------------------------------------------------------------------------------------------------------------------
# Arguments, prompts, resume
# ------------------------------------------------------------------------------------------------------------------
def check_llm_args(args: object, world_size: int) -> None:
    """Checks every LLM script shares; each script adds its own. Runs on every rank before any collective."""
    for name in ("total_steps", "prompts_per_step", "num_generations", "micro_batch_size", "max_completion_length",
                 "vllm_tp", "max_prompt_length"):
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("learning_rate", "temperature"):
        if not getattr(args, name) > 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.prompts_per_step % world_size:
        fail(f"--prompts-per-step {args.prompts_per_step} must be divisible by the world size {world_size}")
    if world_size % args.vllm_tp:
        fail(f"--vllm-tp {args.vllm_tp} must divide the world size {world_size}")
    if args.eval_every < 0 or args.save_every < 0 or args.keep_last < 0 or args.num_eval_prompts < 0:
        fail("--eval-every, --save-every, --keep-last and --num-eval-prompts must be non-negative")
    if args.track:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            fail("--track needs Weights & Biases: pip install wandb")
    path = args.model_name_or_path
    if not os.path.isdir(path) and (os.path.exists(path) or path.startswith(("/", "./", "../"))):
        fail(f"--model-name-or-path {path!r} is not a model directory")


# Arguments a resumed run may change: where and how it reports, not what it computes.
MAY_CHANGE_ON_RESUME = ("resume", "run_root", "exp_name", "track", "wandb_project_name", "eval_every",
                        "num_eval_prompts", "save_every", "keep_last", "rollout_engine", "vllm_kv_cache_memory_bytes",
                        "vllm_gpu_memory_utilization")


@dataclass
class Prompts:
    train: list[Example]
    train_ids: list[list[int]]
    test: list[Example]
    test_ids: list[list[int]]


@dataclass
class RunSetup:
    task: Task
    tokenizer: object
    prompts: Prompts
    eos_ids: list[int]  # every id that ends a completion, for both engines and for decoding
    pad_id: int
    resume_dir: Path | None
    trainer_state: dict | None  # step, args, world size and RNG states of the checkpoint resumed from


def eos_token_ids(model_path: str, tokenizer: object) -> list[int]:
    """The generation config's EOS ids (Qwen2.5-Instruct lists two) together with the tokenizer's."""
    from transformers import GenerationConfig

    try:
        configured = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        configured = None
    ids = set([configured] if isinstance(configured, int) else configured or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def prepare_run(args: object, world_size: int) -> RunSetup:
    """Tokenizer, task, encoded prompts, EOS ids, and the checkpoint to resume from (checked against `args`).
    Every failure here stops every rank with a message, before any model is loaded."""
    from transformers import AutoConfig, AutoTokenizer

    resume_dir = trainer_state = None
    if args.resume:
        try:
            resume_dir = resolve_checkpoint(args.resume)
        except FileNotFoundError as error:
            fail(str(error))
        trainer_state = torch.load(resume_dir / "trainer_state.pt", weights_only=False)
        if trainer_state.get("world_size") != world_size:
            fail(f"checkpoint was written with world size {trainer_state.get('world_size')}, this run has "
                 f"{world_size}; resume needs the same")
        problems = check_resume_args(trainer_state["args"], asdict(args), MAY_CHANGE_ON_RESUME)
        if problems:
            fail(f"{resume_dir} was written with other arguments; resuming would silently change the run:\n  "
                 + "\n  ".join(problems) + f"\n(arguments a resume may change: {', '.join(MAY_CHANGE_ON_RESUME)}; "
                 "--total-steps may grow)")
        if args.total_steps < trainer_state["step"]:
            fail(f"--total-steps {args.total_steps} is below the checkpoint's step {trainer_state['step']}")
    try:
        AutoConfig.from_pretrained(args.model_name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    except (OSError, ValueError) as error:
        fail(f"cannot load model {args.model_name_or_path!r}: {error}")
    try:
        task = make_task(args.task)
    except Exception as error:  # datasets raises many types for a missing dataset
        fail(f"cannot load task {args.task!r}: {error}")

    def encode(examples: list[Example]) -> list[list[int]]:
        texts = [task.format_prompt(tokenizer, example) for example in examples]
        return tokenizer(texts, add_special_tokens=not getattr(tokenizer, "chat_template", None)).input_ids

    train_ids = encode(task.train)
    keep = [i for i, ids in enumerate(train_ids) if len(ids) <= args.max_prompt_length]
    if len(keep) < args.prompts_per_step:
        fail(f"only {len(keep)} training prompts fit --max-prompt-length {args.max_prompt_length}")
    prompts = Prompts([task.train[i] for i in keep], [train_ids[i] for i in keep], task.test,
                      [ids[-args.max_prompt_length:] for ids in encode(task.test)])
    eos_ids = eos_token_ids(args.model_name_or_path, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    return RunSetup(task, tokenizer, prompts, eos_ids, pad_id, resume_dir, trainer_state)


def step_prompts(step: int, seed: int, num_prompts: int, prompts_per_step: int, rank: int, world_size: int
                 ) -> tuple[list[int], int]:
    """This rank's prompt indices for `step` (1-based) and the global position of its first one: a fixed
    permutation per epoch, cut into consecutive steps, each step's prompts split into contiguous rank slices."""
    steps_per_epoch = num_prompts // prompts_per_step
    epoch, position = divmod(step - 1, steps_per_epoch)
    order = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    per_rank = prompts_per_step // world_size
    first = position * prompts_per_step + rank * per_rank
    return order[first:first + per_rank].tolist(), rank * per_rank


# ------------------------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------------------------
def load_model(path: str, dtype: str, device: torch.device, world_size: int, trainable: bool = True,
               reshard_after_forward: bool = True, model_class: object = None) -> torch.nn.Module:
    """A HF model with float32 master weights, sharded with FSDP2 per transformer block (the classes the model names
    in `_no_split_modules`, e.g. Qwen2DecoderLayer) and at the root; computes in `dtype`, reduces in float32.
    `reshard_after_forward=False` keeps each block gathered from forward to backward: one all-gather per block
    instead of two, for a block's full size in memory (a win for small models)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    model = (model_class or AutoModelForCausalLM).from_pretrained(path, dtype=torch.float32).to(device)
    mesh = init_device_mesh(device.type, (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    for block in [m for m in model.modules() if type(m).__name__ in block_classes]:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    if not trainable:
        model.eval().requires_grad_(False)
    return model


def stream_weights(model: torch.nn.Module, dtype: torch.dtype, tied_aliases: bool = True
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's full tensors, gathered in buckets of about SYNC_BUCKET_BYTES (a collective: every rank iterates
    to the end, in the same order). Within a bucket the all-gathers run back to back, so ranks do not wait on each
    other's consumer (e.g. vLLM's loader) after every tensor; across buckets, memory stays bounded. Each shard is cast
    before its all-gather, so bfloat16 moves half the bytes, and a tensor shared by several modules (tied embeddings)
    is gathered once. With `tied_aliases` it is also yielded under its other names, right after: vLLM's in-place
    reload rebuilds every layer that receives no weights from its old copy, so a tied `lm_head` left unnamed would
    keep stale weights; a file export wants each tensor once. Buffers are left out on purpose: the ones HF models
    have (rotary tables) are recomputed by every engine and are not in checkpoints."""
    aliases: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(parameter), []).append(name)
    bucket: list[tuple[str, torch.Tensor]] = []
    bucket_bytes = 0
    for name, parameter in model.named_parameters():
        tensor = parameter.detach().to(dtype)
        tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        bucket += [(alias, tensor) for alias in (aliases[id(parameter)] if tied_aliases else [name])]
        bucket_bytes += tensor.numel() * tensor.element_size()
        if bucket_bytes >= SYNC_BUCKET_BYTES:
            yield from bucket
            bucket, bucket_bytes = [], 0
    yield from bucket


# ------------------------------------------------------------------------------------------------------------------
# Batches and logprobs
# ------------------------------------------------------------------------------------------------------------------
@dataclass
class TokenBatch:
    """Prompts left-padded to a common width P, completions right-padded to width C after them, so that completion
    token j of every row sits in column P + j and is predicted by the logits of column P + j - 1."""
    input_ids: torch.Tensor  # [B, P + C]
    attention_mask: torch.Tensor  # [B, P + C]
    position_ids: torch.Tensor  # [B, P + C], counting from each row's first real token
    completion_ids: torch.Tensor  # [B, C]
    completion_mask: torch.Tensor  # [B, C] float, 1 on real completion tokens
    prompt_width: int


def _pack(rows: list[list[int]], width: int, fill: float, dtype: torch.dtype, left: bool) -> torch.Tensor:
    """Rows of different lengths into a [len(rows), width] tensor in one scatter, padded on the left or right."""
    lengths = torch.tensor([len(row) for row in rows])
    out = torch.full((len(rows), width), fill, dtype=dtype)
    if lengths.sum() == 0:
        return out
    row_index = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    column = torch.arange(int(lengths.sum())) - torch.repeat_interleave(starts, lengths)
    if left:
        column += torch.repeat_interleave(width - lengths, lengths)
    out[row_index, column] = torch.tensor([value for row in rows for value in row], dtype=dtype)
    return out


def make_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int, device: torch.device
               ) -> TokenBatch:
    prompt_width = max(len(p) for p in prompts)
    completion_width = max(1, max(len(c) for c in completions))
    prompt_ids = _pack(prompts, prompt_width, pad_id, torch.long, left=True)
    completion_ids = _pack(completions, completion_width, pad_id, torch.long, left=False)
    mask = torch.cat([_pack([[1] * len(p) for p in prompts], prompt_width, 0, torch.long, left=True),
                      _pack([[1] * len(c) for c in completions], completion_width, 0, torch.long, left=False)], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return TokenBatch(torch.cat([prompt_ids, completion_ids], 1).to(device), mask.to(device), positions.to(device),
                      completion_ids.to(device), mask[:, prompt_width:].float().to(device), prompt_width)


def completion_values(values: list[list[float]], like: torch.Tensor) -> torch.Tensor:
    """Per-completion-token values (e.g. the rollout engine's logprobs) as a [B, C] tensor shaped like `like`."""
    return _pack(values, like.shape[1], 0.0, torch.float32, left=False).to(like.device, like.dtype)


class _ChosenTokenLogprob(torch.autograd.Function):
    """log softmax(logits / T)[token] and its gradient, chunk by chunk, never holding a float32 [rows, V] tensor
    beyond CHUNK_ROWS rows: forward keeps only logsumexp per row; backward recomputes softmax per chunk."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
        flat, chosen = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1)
        out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        logsumexp = torch.empty_like(out)
        for start in range(0, flat.shape[0], CHUNK_ROWS):
            part = flat[start:start + CHUNK_ROWS].float() / temperature
            logsumexp[start:start + CHUNK_ROWS] = torch.logsumexp(part, dim=-1)
            out[start:start + CHUNK_ROWS] = (part.gather(-1, chosen[start:start + CHUNK_ROWS, None])[:, 0]
                                             - logsumexp[start:start + CHUNK_ROWS])
        ctx.save_for_backward(logits, tokens, logsumexp)
        ctx.temperature = temperature
        return out.view(tokens.shape)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, tokens, logsumexp = ctx.saved_tensors
        flat, chosen, grad_flat = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1), grad_out.reshape(-1)
        grad = torch.empty_like(flat)
        vocabulary = torch.arange(flat.shape[-1], device=flat.device)
        for start in range(0, flat.shape[0], CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            probs = torch.exp(flat[rows].float() / ctx.temperature - logsumexp[rows, None])
            onehot = vocabulary[None, :] == chosen[rows, None]  # a comparison, not a scatter: deterministic on GPUs
            grad[rows] = (torch.where(onehot, 1 - probs, -probs) * (grad_flat[rows, None] / ctx.temperature)
                          ).to(grad.dtype)
        return grad.view_as(logits), None, None


def sequence_logprobs(model: torch.nn.Module, batch: TokenBatch, temperature: float) -> torch.Tensor:
    """log pi(completion token | everything before it) under the temperature-scaled distribution: [B, C] float32.
    Logits are computed only for the C columns that predict completion tokens (`logits_to_keep`)."""
    width = batch.completion_ids.shape[1]
    keep = torch.arange(batch.prompt_width - 1, batch.prompt_width - 1 + width, device=batch.input_ids.device)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                   logits_to_keep=keep).logits
    return _ChosenTokenLogprob.apply(logits, batch.completion_ids, temperature)


def mismatch_stats(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                   num_tokens: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """How far the engine's sampled-token logprobs are from the trainer's for the same tokens: shares of the batch
    means (divided by the global token count) of |difference| and of the k3 KL(rollout || trainer), and the max."""
    gap = (trainer_logprobs - rollout_logprobs) * mask
    log_ratio = -gap
    k3 = (torch.exp(log_ratio) - log_ratio - 1) * mask
    return ({"logprob_abs_diff_mean": gap.abs().sum() / num_tokens, "kl": k3.sum() / num_tokens},
            gap.abs().max().detach())


# ------------------------------------------------------------------------------------------------------------------
# Scoring and evaluation
# ------------------------------------------------------------------------------------------------------------------
def decode_completion(tokenizer: object, ids: list[int], eos_ids: list[int]) -> str:
    """The completion's text for a reward: the final EOS (any of the model's) dropped, special tokens skipped."""
    if ids and ids[-1] in eos_ids:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=True)


def score(reward: object, tokenizer: object, examples: list[Example], completions: list[list[int]],
          eos_ids: list[int]) -> list[float]:
    """`reward(text, example)` of every completion. A reward that raises on any rank stops every rank with a message
    naming the prompt and completion, instead of leaving the others waiting in the next collective."""
    rewards, error = [], None
    for example, ids in zip(examples, completions):
        text = decode_completion(tokenizer, ids, eos_ids)
        try:
            rewards.append(float(reward(text, example)))
        except Exception as exception:
            error = (f"reward function failed on prompt {example.prompt!r} with completion {text!r}: "
                     f"{exception!r}")
            break
    if not all_ranks_ok(error is None):
        fail(error or "a reward function failed on another rank")
    return rewards


def evaluate(engine: object, setup: RunSetup, num_eval_prompts: int, max_tokens: int, rank: int,
             world_size: int) -> dict[str, float]:
    """Held-out greedy accuracy (and GSM8K's flexible accuracy), the test prompts split round-robin over ranks."""
    task, test_ids = setup.task, setup.prompts.test_ids
    count = len(test_ids) if num_eval_prompts == 0 else min(num_eval_prompts, len(test_ids))
    indices = list(range(rank, count, world_size))
    samples = engine.generate([test_ids[i] for i in indices], [0] * len(indices), max_tokens, 0.0, setup.eos_ids)
    completions = [s.completion_ids for s in samples]
    examples = [setup.prompts.test[i] for i in indices]
    sums = {"accuracy": sum(score(task.reward, setup.tokenizer, examples, completions, setup.eos_ids))}
    if hasattr(task, "flexible_reward"):
        sums["accuracy_flexible"] = sum(score(task.flexible_reward, setup.tokenizer, examples, completions,
                                              setup.eos_ids))
    return {f"eval/{name}": value / count for name, value in reduce_stats(sums).items()}


# ------------------------------------------------------------------------------------------------------------------
# Checkpoints: sharded training state + a transformers-loadable export of the policy
# ------------------------------------------------------------------------------------------------------------------
def export_pretrained(model: torch.nn.Module, tokenizer: object, directory: Path) -> None:
    """`save_pretrained`'s layout (config, safetensors shards, index, tokenizer) from a streamed gather: rank 0
    holds at most one shard file's worth of tensors; weights are stored in the config's dtype. Every rank calls it."""
    from safetensors.torch import save_file

    config = model.config
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, str(config.dtype or "float32"))
    is_writer = dist.get_rank() == 0
    shard, shard_bytes, files, weight_map = {}, 0, [], {}

    def flush() -> None:
        nonlocal shard, shard_bytes
        name = f"part-{len(files):05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        files.append((name, list(shard)))
        shard, shard_bytes = {}, 0

    for name, tensor in stream_weights(model, dtype, tied_aliases=False):
        if is_writer:
            shard[name] = tensor.cpu().contiguous()
            shard_bytes += tensor.numel() * tensor.element_size()
            if shard_bytes >= EXPORT_SHARD_BYTES:
                flush()
    if not is_writer:
        return
    if shard or not files:
        flush()
    if len(files) == 1:
        os.replace(directory / files[0][0], directory / "model.safetensors")
    else:
        for index, (name, keys) in enumerate(files):
            final = f"model-{index + 1:05d}-of-{len(files):05d}.safetensors"
            os.replace(directory / name, directory / final)
            weight_map.update(dict.fromkeys(keys, final))
        index_file = {"metadata": {}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2) + "\n")
    config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def save_training_checkpoint(root: Path, step: int, policy: torch.nn.Module, tokenizer: object,
                             trained: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]], args: object,
                             keep_last: int) -> Path:
    """Every rank writes its own shard of each trained model and optimizer (`trained`, e.g. {"policy": (model,
    optimizer)}) with torch.distributed.checkpoint; the policy is exported loadable by transformers and vLLM; rank 0
    adds trainer_state.pt (step, arguments, world size, every rank's RNG states) and publishes the directory
    atomically. A collective; waits use the long-timeout save group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    all_rng: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(all_rng, rng_states(), group=save_group())

    def write(directory: Path) -> None:
        state = {name: {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
                 for name, (model, optimizer) in trained.items()}
        dcp.save(state, checkpoint_id=str(directory / "trainer"), process_group=save_group())
        export_pretrained(policy, tokenizer, directory)
        if dist.get_rank() == 0:
            torch.save({"step": step, "args": asdict(args), "world_size": dist.get_world_size(), "rng": all_rng},
                       directory / "trainer_state.pt")

    return save_checkpoint_all_ranks(root, step, write, keep_last, save_group())


def load_training_checkpoint(directory: Path, trained: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]
                             ) -> None:
    """Read each rank's shards back into the (already sharded) models and optimizers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = {name: {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
             for name, (model, optimizer) in trained.items()}
    dcp.load(state, checkpoint_id=str(directory / "trainer"), process_group=save_group())
    for name, (model, optimizer) in trained.items():
        set_model_state_dict(model, state[name]["model"])
        set_optimizer_state_dict(model, optimizer, state[name]["optimizer"])
