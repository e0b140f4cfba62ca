"""What a loss receives: token batches and per-token logprobs. Read this module before forking a loss.

`make_batch` lays B (prompt, completion) pairs out for one forward pass; `token_logprobs(model, batch, T)` returns
[B, C] float32: [i, j] is log pi(completion token j of row i | its prompt and earlier tokens) under softmax(logits / T),
exactly 0.0 wherever `batch.mask` is 0 (padding), so an exp of a difference never overflows there.
`batch.rollout_logprobs` holds the engine's logprobs of the same tokens, laid out alike.

The design follows from sizes (the arithmetic, for Qwen2.5-0.5B and 7B: docs/scaling.md, "Memory and bandwidth"):
the model runs up to its final hidden states, and the head runs inside `_ChosenTokenLogprob` in float32 on the rows
that predict a real token, CHUNK_ROWS at a time; the backward recomputes each chunk's logits (one more head matmul),
and a frozen head (LoRA's base) gets no gradient. Shared prompts (GRPO's G samples of a prompt in one packed row) save
the prompt's G - 1 repeats, but attention then spans the packed row, so the batch keeps [U, L] segment ids, and on
GPUs FlexAttention reads them through a block mask; it pays for short completions (the embedded task: 2.2x fewer
tokens).
"""

from dataclasses import dataclass, field

import torch

from common.llm.attention import packed_attention_mask
from common.llm.routing import packed_routes, padded_routes, replayed_routes
from common.llm.run import LLMRun, Rollout

CHUNK_ROWS = 256  # rows of float32 [rows, V] logits computed at a time


@dataclass
class TokenBatch:
    """Prompts left-padded to a common width P, completions right-padded to width C after them: completion token j
    of every row sits in column P + j and is predicted by the logits of column P + j - 1. With shared prompts
    (`make_batch(..., share_prompts=True)`) the model sees one packed row per run of rows with the same prompt: its
    first p - 1 tokens once, then per completion a copy of its last token and the completion, each segment at
    positions p - 1, p, ... and attending (block mask) to the prompt and itself only, so each packed column predicts
    one token and `gather_index` reads them back into the [B, C] layout. Same values as padded rows, fewer tokens."""
    input_ids: torch.Tensor  # [B, P + C], or [U, L] packed
    attention_mask: torch.Tensor | None  # [B, P + C]; packed: None (built per forward from segment_ids)
    position_ids: torch.Tensor  # [B, P + C], counting from each row's first real token (packed: [U, L])
    completion_ids: torch.Tensor  # [B, C]
    mask: torch.Tensor  # [B, C] float, 1.0 on the completion tokens the model sampled (not padding, not a multi-turn
    # episode's environment tokens: make_batch's loss_masks)
    prompt_width: int
    rollout_logprobs: torch.Tensor | None = None  # [B, C] float32, the engine's logprob of each token (0.0 off mask)
    packed_targets: torch.Tensor | None = None  # [U, L]: the token each packed column predicts (pad_id where none)
    gather_index: torch.Tensor | None = None  # [B, C]: flat index into the packed [U, L - first_predictor] columns
    first_predictor: int = 0  # the first packed column whose logits are needed (the shortest prompt's last token)
    segment_ids: torch.Tensor | None = None  # [U, L] packed: -1 the shared prompt, g completion g's segment, -2 pad
    routes: torch.Tensor | None = None  # --routing-replay: [B, P + C, MoE layers, k] (packed: [U, L, ...]) int16, the
    # engine's experts of each token, -1 where none (`with_routes`, common/llm/routing.py)
    head_rows: torch.Tensor = field(init=False)  # [N]: the kept hidden-state rows that predict a real token
    unpack_index: torch.Tensor = field(init=False)  # [B * C]: each position's row among them, N where padding


def _with_head_index(batch: TokenBatch, mask: torch.Tensor, gather_index: torch.Tensor | None,
                     device: torch.device) -> TokenBatch:
    """`batch` with its head's indices, worked out on the host from the host copies of its mask and gather index,
    then moved: a nonzero or a sum read on device tensors would make the host wait for the device (once per
    micro-batch built, e.g. per PPO minibatch)."""
    real = mask.reshape(-1) > 0
    head_rows = gather_index.reshape(-1)[real] if gather_index is not None else real.nonzero()[:, 0]
    batch.head_rows = head_rows.to(device)
    batch.unpack_index = torch.where(real, real.long().cumsum(0) - 1, int(real.sum())).to(device)
    return batch


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


def pad_completions(values: list[list[float]], width: int, device: torch.device) -> torch.Tensor:
    """Per-completion-token values (e.g. the engine's logprobs) as a right-padded [B, width] float32 tensor."""
    return _pack(values, width, 0.0, torch.float32, left=False).to(device)


def make_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int, device: torch.device,
               share_prompts: bool = False, rollout_logprobs: list[list[float]] | None = None,
               loss_masks: list[list[int] | None] | None = None) -> TokenBatch:
    """`loss_masks` (multi-turn): per completion, 1 on the tokens the model sampled and 0 on the environment's (None:
    all the model's). The environment's tokens are attended to like any other, but `mask` is 0 there: no logprob is
    computed for them (the head skips their rows), and every loss, count and normaliser built on `mask` leaves them
    out."""
    prompt_width = max(len(p) for p in prompts)
    completion_width = max(1, max(len(c) for c in completions))
    completion_ids = _pack(completions, completion_width, pad_id, torch.long, left=False)
    real = _pack([[1] * len(c) for c in completions], completion_width, 0, torch.float32, left=False)
    loss_masks = loss_masks or [None] * len(completions)
    completion_mask = real if all(m is None for m in loss_masks) else _pack(
        [m if m is not None else [1] * len(c) for m, c in zip(loss_masks, completions)], completion_width, 0,
        torch.float32, left=False)
    engine = None if rollout_logprobs is None else pad_completions(rollout_logprobs, completion_width, device)
    if share_prompts:
        return _packed_batch(prompts, completions, pad_id, completion_ids, completion_mask, prompt_width, device,
                             engine)
    prompt_ids = _pack(prompts, prompt_width, pad_id, torch.long, left=True)
    mask = torch.cat([_pack([[1] * len(p) for p in prompts], prompt_width, 0, torch.long, left=True),
                      real.long()], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    batch = TokenBatch(torch.cat([prompt_ids, completion_ids], 1).to(device), mask.to(device), positions.to(device),
                       completion_ids.to(device), completion_mask.to(device), prompt_width, engine)
    return _with_head_index(batch, completion_mask, None, device)


def _packed_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int, completion_ids: torch.Tensor,
                  completion_mask: torch.Tensor, prompt_width: int, device: torch.device,
                  rollout_logprobs: torch.Tensor | None) -> TokenBatch:
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
    first_predictor = min(len(p) for p in prompts) - 1
    kept = width - first_predictor
    gather_index = torch.zeros_like(completion_ids)
    for row, (packed_row, start) in starts.items():
        length = len(completions[row])
        gather_index[row, :length] = packed_row * kept + start - first_predictor + torch.arange(length)
    batch = TokenBatch(_pack(tokens, width, pad_id, torch.long, left=False).to(device), None,
                       _pack(positions, width, 0, torch.long, left=False).to(device), completion_ids.to(device),
                       completion_mask.to(device), prompt_width, rollout_logprobs,
                       _pack(targets, width, pad_id, torch.long, left=False).to(device), gather_index.to(device),
                       first_predictor, _pack(segments, width, -2, torch.long, left=False).to(device))
    return _with_head_index(batch, completion_mask, gather_index, device)


# The head's weight gradient is accumulated over row chunks in slices of the vocabulary: one chunk's product for the
# whole vocabulary would be a [V, H] float32 temporary beside the [V, H] accumulator (2.2 GB at 7B, 151,936 x 3,584
# x 4 B); a slice's is 16,384 x 3,584 x 4 B = 235 MB there (59 MB at 0.5B, H = 896). Each element's sum over a chunk's
# rows is the same product either way.
VOCABULARY_SLICE = 16_384


def _head_logits(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """hidden [rows, H] @ weight [V, H]^T in `dtype` (float32, or float64 for exactness checks). On CUDA a bf16
    weight is multiplied as stored with float32 output (cuBLAS accumulates in float32), so no float32 copy of it
    is made; elsewhere both operands are cast."""
    if hidden.is_cuda and weight.dtype != dtype:
        return torch.mm(hidden, weight.t(), out_dtype=dtype)
    return hidden.to(dtype) @ weight.to(dtype).t()


def _head_backward_mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a @ b with `dtype` (float32) output, for the head's two backward GEMMs (grad_logits @ W, grad_logits^T @
    hidden: 2 x 2 x rows x V x H FLOPs). With a bf16 head, grad_logits arrives rounded to bf16, as every gradient of
    the bf16 body is, and the products accumulate in float32: on CUDA one bf16 tensor-core GEMM with float32 output
    (several times float32's speed: docs/scaling.md, "Memory and bandwidth"), and no float32 copy of the head.
    Elsewhere
    (CPUs have no mixed-dtype mm) the same bf16 values are multiplied in float32: the same products, another
    summation order. A float32 head multiplies in float32."""
    if a.is_cuda and a.dtype == b.dtype != dtype:
        return torch.mm(a, b, out_dtype=dtype)
    return a.to(dtype) @ b.to(dtype)


class _ChosenTokenLogprob(torch.autograd.Function):
    """log softmax(hidden @ W^T / T)[token] per row and its gradient, from the final hidden states of the rows that
    predict a token: the LM head itself runs here, in float32, CHUNK_ROWS rows at a time, so neither [rows, V]
    logits in the compute dtype nor a float32 [rows, V] tensor beyond one chunk ever exists. Forward keeps only the
    logsumexp per row; backward recomputes each chunk's logits (one more head matmul) for the hidden states'
    gradient and, when the head trains, the head's. A frozen head (LoRA's base) skips its gradient: a [V, H] float32
    accumulator, its copy in the head's dtype and one of the two backward GEMMs; the hidden states' gradient is the
    same computation either way, so its bits do not depend on it."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, temperature: float
                ) -> torch.Tensor:
        dtype = torch.promote_types(weight.dtype, torch.float32)
        out = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
        logsumexp = torch.empty_like(out)
        for start in range(0, hidden.shape[0], CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            logits = _head_logits(hidden[rows], weight, dtype) / temperature
            logsumexp[rows] = torch.logsumexp(logits, dim=-1)
            out[rows] = logits.gather(-1, tokens[rows, None])[:, 0] - logsumexp[rows]
        ctx.save_for_backward(hidden, weight, tokens, logsumexp)
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None, None]:
        hidden, weight, tokens, logsumexp = ctx.saved_tensors
        dtype = logsumexp.dtype
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if ctx.needs_input_grad[1] else None
        vocabulary = torch.arange(weight.shape[0], device=hidden.device)
        for start in range(0, hidden.shape[0], CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            probs = torch.exp(_head_logits(hidden[rows], weight, dtype) / ctx.temperature - logsumexp[rows, None])
            onehot = vocabulary[None, :] == tokens[rows, None]  # a comparison, not a scatter: deterministic on GPUs
            grad_logits = torch.where(onehot, 1 - probs, -probs) * (grad_out[rows, None] / ctx.temperature)
            grad_logits = grad_logits.to(weight.dtype)  # a bf16 head: the body's precision (see _head_backward_mm)
            grad_hidden[rows] = _head_backward_mm(grad_logits, weight, dtype).to(hidden.dtype)
            if grad_weight is None:  # a frozen head
                continue
            for first in range(0, weight.shape[0], VOCABULARY_SLICE):  # fixed chunk and slice order: deterministic
                ids = slice(first, first + VOCABULARY_SLICE)
                grad_weight[ids] += _head_backward_mm(grad_logits[:, ids].t(), hidden[rows], dtype)
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None


@torch.no_grad()
def _chunked_entropy(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of softmax(hidden @ W^T / T) per row, CHUNK_ROWS rows of float32 logits at a time (no gradient)."""
    dtype = torch.promote_types(weight.dtype, torch.float32)
    out = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
    for start in range(0, hidden.shape[0], CHUNK_ROWS):
        logits = _head_logits(hidden[start:start + CHUNK_ROWS], weight, dtype) / temperature
        out[start:start + CHUNK_ROWS] = torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, -1) * logits).sum(-1)
    return out


def completion_columns(batch: TokenBatch) -> torch.Tensor:
    """The C columns whose outputs predict (or, for a value model, precede) the completion tokens."""
    assert batch.gather_index is None, "a packed batch has no common completion columns"
    width = batch.completion_ids.shape[1]
    return torch.arange(batch.prompt_width - 1, batch.prompt_width - 1 + width, device=batch.input_ids.device)


def token_logprobs(model: torch.nn.Module, batch: TokenBatch, temperature: float, with_entropy: bool = False,
                   vocabulary: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log pi(completion token | everything before it) under softmax(logits / T): [B, C] float32, 0.0 under the mask
    (and, `with_entropy`, the entropy of that distribution at each completion position, detached, 0.0 likewise).
    The model runs up to its final hidden states; its LM head then runs in float32 on the rows that predict a real
    completion token only (no prompt or padding positions, in either layout), inside the model's forward, where FSDP
    has gathered the head's weight: its `forward` is swapped for the chosen-token computation for that one call.
    `vocabulary`: the softmax over the head's first `vocabulary` rows only (a distillation teacher whose output layer
    is padded beyond the student's ids: both distributions over the same ids); None: over all of them. Packed rows
    get a mask per layer kind (common/llm/attention.py); a model whose layers no mask can cut between completions
    (linear attention) raises there."""
    packed = batch.gather_index is not None  # every kept packed column predicts the next token of its segment
    columns = (torch.arange(batch.first_predictor, batch.input_ids.shape[1], device=batch.input_ids.device) if packed
               else completion_columns(batch))
    targets = (batch.packed_targets[:, batch.first_predictor:] if packed else batch.completion_ids).reshape(-1)
    rows = batch.head_rows
    head, entropy = model.get_output_embeddings(), {}
    attention_mask = (packed_attention_mask(batch.segment_ids, batch.position_ids, model.config) if packed
                      else batch.attention_mask)

    def chosen_token_head(hidden: torch.Tensor) -> torch.Tensor:  # [rows, columns, H] -> [N] logprobs
        hidden = hidden.reshape(-1, hidden.shape[-1])[rows]
        weight = head.weight if vocabulary is None else head.weight[:vocabulary]  # leading rows: a view, no copy
        if with_entropy:
            entropy["rows"] = _chunked_entropy(hidden.detach(), weight.detach(), temperature)
        return _ChosenTokenLogprob.apply(hidden, weight, targets[rows], temperature)

    head.forward = chosen_token_head
    try:
        with replayed_routes(model, batch.routes):  # a MoE policy routes each token as the engine did (R3)
            chosen = model(input_ids=batch.input_ids, attention_mask=attention_mask, position_ids=batch.position_ids,
                           logits_to_keep=columns, use_cache=False).logits  # no KV cache: nothing decodes afterwards
    finally:
        del head.forward

    def unpack(values: torch.Tensor) -> torch.Tensor:  # [N] -> [B, C], exactly 0.0 where the mask is 0
        return torch.cat([values, values.new_zeros(1)])[batch.unpack_index].view(batch.mask.shape)

    return (unpack(chosen), unpack(entropy["rows"])) if with_entropy else unpack(chosen)


def mismatch_stats(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                   num_tokens: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """How far the engine's sampled-token logprobs are from the trainer's for the same tokens: shares of the batch
    means (divided by the global token count) of |difference| and of the k3 KL(rollout || trainer), and the max."""
    gap = (trainer_logprobs - rollout_logprobs) * mask
    log_ratio = -gap
    k3 = (torch.exp(log_ratio) - log_ratio - 1) * mask
    return ({"mismatch/logprob_abs_diff_mean": gap.abs().sum() / num_tokens, "mismatch/kl": k3.sum() / num_tokens},
            {"mismatch/logprob_abs_diff_max": gap.abs().max()})


def split(rows: list[int] | range, size: int) -> list[list[int] | range]:
    """Consecutive runs of at most `size` rows (micro-batches; the last may be smaller), like `Tensor.split`."""
    return [rows[start:start + size] for start in range(0, len(rows), size)]


def with_routes(batch: TokenBatch, prompts: list[list[int]], routes: list[torch.Tensor | None]) -> TokenBatch:
    """`batch` (make_batch's, of these prompts) with the engine's routes of its rows laid out as its tokens are
    (--routing-replay); as it was where the rows carry none."""
    if routes and routes[0] is not None:
        width = batch.input_ids.shape[1]
        laid_out = packed_routes(prompts, routes, width) if batch.gather_index is not None else \
            padded_routes(prompts, routes, batch.prompt_width, width)
        batch.routes = laid_out.to(batch.input_ids.device)
    return batch


def micro_batches(rollout: Rollout, micro_batch_rows: list[list[int] | range], run: LLMRun, share_prompts: bool = False
                  ) -> list[TokenBatch]:
    """One TokenBatch per list of rows, on the device, with the engine's logprobs of those rows' tokens. Counts the
    tokens it lays out, real and padded, into the step's timings."""
    batches = [make_batch([rollout.prompts[r] for r in rows], [rollout.samples[r].completion_ids for r in rows],
                          run.pad_id, run.device, share_prompts, [rollout.samples[r].logprobs for r in rows],
                          [rollout.samples[r].loss_mask for r in rows])
               for rows in micro_batch_rows]
    for batch, rows in zip(batches, micro_batch_rows):  # --routing-replay: the engine's routes, if any
        with_routes(batch, [rollout.prompts[r] for r in rows], [rollout.samples[r].routes for r in rows])
    counts = rollout.timings
    counts["micro_batches"] = counts.get("micro_batches", 0) + len(batches)
    counts["tokens"] = counts.get("tokens", 0) + sum(  # real tokens: a packed row holds its prompt once
        int((b.segment_ids != -2).sum() if b.attention_mask is None else b.attention_mask.sum()) for b in batches)
    counts["padded_tokens"] = counts.get("padded_tokens", 0) + sum(b.input_ids.numel() for b in batches)
    return batches
