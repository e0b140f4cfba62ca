"""The LLM plumbing that grpo_llm.py, dpo_online.py and ppo_llm.py share, so each script shows only its algorithm:
loading and sharding models (FSDP2), prompts and the per-step prompt stream, padded batches, memory-lean per-token
logprobs, scoring with a named failure, greedy evaluation, streamed weight export, and sharded checkpoints.

Sizes that decided the design, for Qwen2.5-0.5B (vocabulary V = 151,936) with micro-batches of 8 sequences of
512 prompt + 1,024 completion tokens:
- logits for every position in float32, then three float32 copies (cast, / temperature, log_softmax) would be
  4 x 8 x 1,536 x V x 4 B = 30 GB; `sequence_logprobs` keeps logits only for completion positions, in the compute
  dtype (8 x 1,024 x V x 2 B = 2.5 GB in bfloat16, and as much again for their gradient), and works through them
  in chunks of CHUNK_ROWS rows (256 x V x 4 B = 156 MB per float32 temporary).
- shared prompts (GRPO's G samples of a prompt in one packed row) save the prompt's G - 1 repeats, but attention
  then spans the packed row: at 512 + 8 x 1,025 tokens that is 8,712^2 = 76M query-key pairs per row (a 76 MB
  boolean mask, and no FlashAttention) against 8 x 1,536^2 / 2 = 9.4M causal pairs for 8 separate rows. It pays
  for short completions (the embedded task: 2.2x fewer tokens), not for long ones.
- a 7B policy is 28 GB in float32 and its Adam state 56 GB more: checkpoints are written by every rank for its own
  shard (torch.distributed.checkpoint), and the exported model is gathered one tensor at a time.
"""

import json
import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from common.checkpoint import check_resume_args, resolve_checkpoint, save_checkpoint_all_ranks
from common.determinism import effective_determinism_env, restore_rng_states, rng_states, seed_rngs
from common.distributed import all_ranks_ok, fail, reduce_stats, save_group
from common.rollout import make_engine
from common.tasks import Example, Task, make_task
from common.tracking import RunTracker, get_logger

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
        if args.total_steps <= trainer_state["step"]:
            fail(f"the checkpoint is at step {trainer_state['step']}, --total-steps is {args.total_steps}: nothing "
                 "left to run (a larger --total-steps extends the run)")
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


def check_scalar_head(path: str, flag: str, must_be_classifier: bool) -> None:
    """A reward model (`must_be_classifier`) must be a one-label AutoModelForSequenceClassification; a value model
    may also be a plain causal LM (it gets a fresh head). A stored `score` head must be [1, hidden size]. Reads only
    the config and the head's stored shape, on every rank, before any model is loaded."""
    from safetensors import safe_open
    from transformers import AutoConfig
    from transformers.utils import cached_file

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as error:
        fail(f"cannot load {flag} {path!r}: {error}")
    architectures = config.architectures or []
    is_classifier = any(name.endswith(("ForSequenceClassification", "ForTokenClassification"))
                        for name in architectures)
    if must_be_classifier and not any(name.endswith("ForSequenceClassification") for name in architectures):
        fail(f"{flag} {path!r} is not a sequence classifier (architectures: {architectures}); a reward model must "
             "load with AutoModelForSequenceClassification and have one label")
    if (must_be_classifier or is_classifier) and config.num_labels != 1:
        fail(f"{flag} {path!r} has {config.num_labels} labels; it must have exactly one (a scalar score)")
    hidden_size = config.get_text_config().hidden_size
    index = cached_file(path, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False)
    weights_file = json.loads(Path(index).read_text())["weight_map"].get("score.weight") if index else \
        "model.safetensors"
    weights = cached_file(path, weights_file, _raise_exceptions_for_missing_entries=False) if weights_file else None
    if weights:
        with safe_open(weights, "pt") as stored:
            shape = stored.get_slice("score.weight").get_shape() if "score.weight" in stored.keys() else None
        if shape is not None and list(shape) != [1, hidden_size]:
            fail(f"{flag} {path!r}: its score head is {list(shape)}, but its hidden size is {hidden_size} "
                 f"(expected [1, {hidden_size}])")


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
    # a frozen model never runs the backward that would reshard it: kept gathered, it would hold a full copy all run
    reshard_after_forward = reshard_after_forward or not trainable
    for block in [m for m in model.modules() if type(m).__name__ in block_classes]:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    if not trainable:
        model.eval().requires_grad_(False)
    return model


def learning_rate_factor(update: int, warmup_steps: int, total_updates: int, schedule: str) -> float:
    """Linear warm-up to 1, then constant, linear or cosine decay to 0 at `total_updates`."""
    if update < warmup_steps:
        return (update + 1) / warmup_steps
    progress = (update - warmup_steps) / max(1, total_updates - warmup_steps)
    if schedule == "linear":
        return max(0.0, 1 - progress)
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return 1.0


def make_optimizer(model: torch.nn.Module, args: object, learning_rate: float, total_updates: int
                   ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the model's shards (foreach: one op per step for all of them) and the warm-up + decay schedule."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=args.weight_decay, foreach=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: learning_rate_factor(
        update, args.warmup_steps, total_updates, args.lr_schedule))
    return optimizer, scheduler


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LambdaLR, max_grad_norm: float, step: int
                   ) -> tuple[float, float]:
    """Clip by the global gradient norm, step, advance the schedule, free the gradients (before the engine wakes).
    A non-finite norm (every rank sees the same one) stops the run before the weights are touched.
    Returns the norm and the learning rate used."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    if not math.isfinite(grad_norm):
        fail(f"non-finite gradient at step {step} (grad norm {grad_norm}); the last checkpoint is left as it was")
    learning_rate = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, learning_rate


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
    token j of every row sits in column P + j and is predicted by the logits of column P + j - 1.

    With shared prompts (`make_batch(..., share_prompts=True)`) the model instead sees one packed row per run of rows
    with the same prompt: the prompt's first p - 1 tokens once, then for each completion its own copy of the prompt's
    last token followed by the completion, every segment at positions p - 1, p, ... and attending (block mask) to the
    prompt and to itself only. Each packed column then predicts exactly one token, the next one of its segment, and
    `gather_index` reads those back into the [B, C] layout above. Same values as the padded rows, fewer tokens."""
    input_ids: torch.Tensor  # [B, P + C], or [U, L] packed
    attention_mask: torch.Tensor  # [B, P + C], or [U, 1, L, L] bool (True: may attend) packed
    position_ids: torch.Tensor  # [B, P + C], counting from each row's first real token (packed: [U, L])
    completion_ids: torch.Tensor  # [B, C]
    completion_mask: torch.Tensor  # [B, C] float, 1 on real completion tokens
    prompt_width: int
    packed_targets: torch.Tensor | None = None  # [U, L]: the token each packed column predicts (pad_id where none)
    gather_index: torch.Tensor | None = None  # [B, C]: flat index into the packed [U, L - first_predictor] columns
    first_predictor: int = 0  # the first packed column whose logits are needed (the shortest prompt's last token)


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


def make_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int, device: torch.device,
               share_prompts: bool = False) -> TokenBatch:
    prompt_width = max(len(p) for p in prompts)
    completion_width = max(1, max(len(c) for c in completions))
    completion_ids = _pack(completions, completion_width, pad_id, torch.long, left=False)
    completion_mask = _pack([[1] * len(c) for c in completions], completion_width, 0, torch.float32, left=False)
    if share_prompts:
        return _packed_batch(prompts, completions, pad_id, completion_ids, completion_mask, prompt_width, device)
    prompt_ids = _pack(prompts, prompt_width, pad_id, torch.long, left=True)
    mask = torch.cat([_pack([[1] * len(p) for p in prompts], prompt_width, 0, torch.long, left=True),
                      completion_mask.long()], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return TokenBatch(torch.cat([prompt_ids, completion_ids], 1).to(device), mask.to(device), positions.to(device),
                      completion_ids.to(device), completion_mask.to(device), prompt_width)


def _packed_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int, completion_ids: torch.Tensor,
                  completion_mask: torch.Tensor, prompt_width: int, device: torch.device) -> TokenBatch:
    """The shared-prompt layout of TokenBatch, built on the host: per packed row, a segment id for every column
    (-1: the prompt's first p - 1 tokens, g >= 0: segment of the row's g-th completion, -2: padding)."""
    groups: list[list[int]] = []  # runs of consecutive rows with one prompt (GRPO's G samples of a prompt)
    for row, prompt in enumerate(prompts):
        if groups and prompts[groups[-1][0]] == prompt:
            groups[-1].append(row)
        else:
            groups.append([row])
    tokens, positions, segments, targets, starts = [], [], [], [], {}
    for members in groups:
        prompt = prompts[members[0]]
        row_tokens, row_positions = list(prompt[:-1]), list(range(len(prompt) - 1))
        row_segments, row_targets = [-1] * len(row_tokens), [pad_id] * len(row_tokens)
        for g, row in enumerate(members):
            segment = [prompt[-1], *completions[row]]
            starts[row] = (len(tokens), len(row_tokens))
            row_tokens += segment
            row_positions += range(len(prompt) - 1, len(prompt) - 1 + len(segment))
            row_segments += [g] * len(segment)
            row_targets += [*completions[row], pad_id]  # the segment's last column predicts nothing
        tokens.append(row_tokens)
        positions.append(row_positions)
        segments.append(row_segments)
        targets.append(row_targets)
    width = max(map(len, tokens))
    segment_ids = _pack(segments, width, -2, torch.long, left=False)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
    allowed = causal & (same_segment | (segment_ids[:, None, :] == -1))  # padding attends to itself, never read
    first_predictor = min(len(p) for p in prompts) - 1
    kept = width - first_predictor
    gather_index = torch.zeros_like(completion_ids)
    for row, (packed_row, start) in starts.items():
        length = len(completions[row])
        gather_index[row, :length] = packed_row * kept + start - first_predictor + torch.arange(length)
    return TokenBatch(_pack(tokens, width, pad_id, torch.long, left=False).to(device), allowed[:, None].to(device),
                      _pack(positions, width, 0, torch.long, left=False).to(device), completion_ids.to(device),
                      completion_mask.to(device), prompt_width,
                      _pack(targets, width, pad_id, torch.long, left=False).to(device), gather_index.to(device),
                      first_predictor)


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


def completion_columns(batch: TokenBatch) -> torch.Tensor:
    """The C columns whose outputs predict (or, for a value model, precede) the completion tokens."""
    assert batch.gather_index is None, "a packed batch has no common completion columns"
    width = batch.completion_ids.shape[1]
    return torch.arange(batch.prompt_width - 1, batch.prompt_width - 1 + width, device=batch.input_ids.device)


@torch.no_grad()
def _chunked_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of softmax(logits / T) per row, CHUNK_ROWS rows of float32 at a time (a statistic: no gradient)."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], CHUNK_ROWS):
        part = flat[start:start + CHUNK_ROWS].float() / temperature
        logsumexp = torch.logsumexp(part, dim=-1)
        out[start:start + CHUNK_ROWS] = logsumexp - (torch.softmax(part, dim=-1) * part).sum(-1)
    return out.view(logits.shape[:-1])


def sequence_logprobs(model: torch.nn.Module, batch: TokenBatch, temperature: float, with_entropy: bool = False
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log pi(completion token | everything before it) under the temperature-scaled distribution: [B, C] float32
    (and, `with_entropy`, the entropy of that distribution at each completion position, detached).
    Logits are computed only for the columns that predict completion tokens (`logits_to_keep`)."""
    packed = batch.gather_index is not None  # every kept packed column predicts the next token of its segment
    columns = (torch.arange(batch.first_predictor, batch.input_ids.shape[1], device=batch.input_ids.device) if packed
               else completion_columns(batch))
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                   logits_to_keep=columns).logits
    targets = batch.packed_targets[:, batch.first_predictor:] if packed else batch.completion_ids
    logprobs = _ChosenTokenLogprob.apply(logits, targets, temperature)
    entropy = _chunked_entropy(logits, temperature) if with_entropy else None
    if packed:  # back to one row per completion
        logprobs = logprobs.reshape(-1)[batch.gather_index]
        entropy = entropy.reshape(-1)[batch.gather_index] if with_entropy else None
    return (logprobs, entropy) if with_entropy else logprobs


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


class RewardModel:
    """A one-label AutoModelForSequenceClassification scoring prompt + completion text with its own tokenizer (and its
    own chat template when it has one), sharded with FSDP2 like the policy. Calling it is a collective: every rank
    scores as many completions (the scripts give each rank the same number)."""

    def __init__(self, path: str, dtype: str, device: torch.device, world_size: int, micro_batch_size: int) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = load_model(path, dtype, device, world_size, trainable=False,
                                model_class=AutoModelForSequenceClassification)
        self.pad_id = next((i for i in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id) if i is not None), 0)
        # HF pools the last token that is not config.pad_token_id. Rows are left-padded, so the last column is always
        # the text's last token; -1 matches no token, so a text ending in the pad id (often EOS) is read there too.
        self.model.config.pad_token_id = -1
        self.device, self.micro_batch_size = device, micro_batch_size

    def texts(self, examples: list[Example], completions: list[str]) -> list[str]:
        if getattr(self.tokenizer, "chat_template", None):
            return [self.tokenizer.apply_chat_template([{"role": "user", "content": example.prompt},
                                                        {"role": "assistant", "content": completion}], tokenize=False)
                    for example, completion in zip(examples, completions)]
        return [example.prompt + completion for example, completion in zip(examples, completions)]

    @torch.no_grad()
    def __call__(self, examples: list[Example], completions: list[str]) -> torch.Tensor:
        chat = bool(getattr(self.tokenizer, "chat_template", None))
        ids = self.tokenizer(self.texts(examples, completions), add_special_tokens=not chat).input_ids
        scores = []
        for start in range(0, len(ids), self.micro_batch_size):
            rows = ids[start:start + self.micro_batch_size]
            width = max(map(len, rows))
            mask = _pack([[1] * len(row) for row in rows], width, 0, torch.long, left=True)
            logits = self.model(input_ids=_pack(rows, width, self.pad_id, torch.long, left=True).to(self.device),
                                attention_mask=mask.to(self.device),
                                position_ids=(mask.cumsum(-1) - 1).clamp(min=0).to(self.device)).logits
            scores.append(logits[:, 0].float().cpu())
        return torch.cat(scores) if scores else torch.zeros(0)


def judge(setup: RunSetup, reward_model: RewardModel | None, examples: list[Example], completions: list[list[int]]
          ) -> torch.Tensor:
    """One score per completion: the reward model's when there is one, else the task's verifiable reward."""
    if reward_model is None:
        return torch.tensor(score(setup.task.reward, setup.tokenizer, examples, completions, setup.eos_ids))
    return reward_model(examples, [decode_completion(setup.tokenizer, ids, setup.eos_ids) for ids in completions])


# ------------------------------------------------------------------------------------------------------------------
# Start, resume, checkpoints: sharded training state + a transformers-loadable export of the policy
# ------------------------------------------------------------------------------------------------------------------
def start_engine(args: object, setup: RunSetup, device: torch.device) -> object:
    """This rank's rollout engine, sized for the longest prompt plus a completion. Starting vLLM reseeds python, numpy
    and torch with the engine's seed, so the global RNGs are seeded with --seed again right after."""
    max_model_len = max(map(len, setup.prompts.train_ids + setup.prompts.test_ids)) + args.max_completion_length
    if device.type == "cuda":  # each model went to the GPU whole before sharding; vLLM sizes itself from free memory
        torch.cuda.empty_cache()
    engine = make_engine(args.rollout_engine, args.model_name_or_path, args.dtype, args.vllm_tp, max_model_len,
                         device, args.vllm_kv_cache_memory_bytes, args.vllm_gpu_memory_utilization)
    seed_rngs(args.seed)
    return engine


def resume_training(setup: RunSetup, trained: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]],
                    schedulers: list[torch.optim.lr_scheduler.LambdaLR], updates_per_step: int, rank: int) -> int:
    """Continue from the checkpoint `prepare_run` checked, if any: shards back into the models and optimizers, the
    schedules fast-forwarded (a pure function of the update count), this rank's RNG states restored (after the
    engine started). Returns the last completed step (0 for a fresh run)."""
    if not setup.trainer_state:
        return 0
    load_training_checkpoint(setup.resume_dir, trained)
    step = setup.trainer_state["step"]
    for scheduler in schedulers:
        for _ in range(step * updates_per_step):
            scheduler.step()
    restore_rng_states(setup.trainer_state["rng"][rank])
    return step


def start_tracking(args: object, engine: object, setup: RunSetup, determinism: dict[str, object], start_step: int,
                   rank: int, world_size: int, device: torch.device) -> RunTracker:
    """The run directory (the checkpoint's, on resume) with the determinism settings in force after the engine
    started and the vLLM model runner in the manifest; warns when CUDA samples with the legacy V1 runner."""
    runner = getattr(engine, "model_runner", None)
    tracker = RunTracker(args, args.exp_name, rank, world_size,
                         {**determinism, **effective_determinism_env(), "vllm_model_runner": runner},
                         args.track, args.wandb_project_name, args.run_root, setup.resume_dir, start_step)
    log = get_logger(rank)
    if runner == "v1" and device.type == "cuda":
        log.warning("vLLM runs its V1 model runner, which samples seeded requests one by one in Python; "
                    "unset VLLM_USE_V2_MODEL_RUNNER=0 or use a model the V2 runner supports")
    log.info(f"world size {world_size}, {type(engine).__name__} (model runner {runner}), "
             f"{len(setup.prompts.train_ids)} train / {len(setup.prompts.test_ids)} test prompts, "
             f"starting after step {start_step}")
    return tracker


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
                             keep_last: int, extra: dict | None = None) -> Path:
    """Every rank writes its own shard of each trained model and optimizer (`trained`, e.g. {"policy": (model,
    optimizer)}) with torch.distributed.checkpoint; the policy is exported loadable by transformers and vLLM; rank 0
    adds trainer_state.pt (step, arguments, world size, every rank's RNG states, and `extra`: whatever other state
    the algorithm carries from step to step, e.g. an adaptive coefficient) and publishes the directory
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
            torch.save({"step": step, "args": asdict(args), "world_size": dist.get_world_size(), "rng": all_rng,
                        "extra": extra or {}}, directory / "trainer_state.pt")

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
