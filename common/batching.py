"""What a loss receives: token batches and per-token logprobs. Read this module before forking a loss.

`make_batch` lays B (prompt, completion) pairs out for one forward pass; `token_logprobs(model, batch, T)` returns
[B, C] float32: [i, j] is log pi(completion token j of row i | its prompt and earlier tokens) under softmax(logits / T),
exactly 0.0 wherever `batch.mask` is 0 (padding), so an exp of a difference never overflows there.
`batch.rollout_logprobs` holds the engine's logprobs of the same tokens, laid out alike.

Sizes that decided the design, for Qwen2.5-0.5B (vocabulary V = 151,936), micro-batches of 8 rows of 512 prompt +
1,024 completion tokens:
- logits at every position in float32 plus three float32 copies (cast, / T, log_softmax) would be
  4 x 8 x 1,536 x V x 4 B = 30 GB. Logits are kept only where they predict completion tokens, in the compute dtype
  (8 x 1,024 x V x 2 B = 2.5 GB in bfloat16, as much again for their gradient), and turned into float32 CHUNK_ROWS
  rows at a time (256 x V x 4 B = 156 MB per temporary).
- shared prompts (GRPO's G samples of a prompt in one packed row) save the prompt's G - 1 repeats, but attention
  then spans the packed row: at 512 + 8 x 1,025 tokens, 8,712^2 = 76M query-key pairs per row (a 76 MB boolean
  mask, and no FlashAttention) against 8 x 1,536^2 / 2 = 9.4M causal pairs for 8 padded rows. It pays for short
  completions (the embedded task: 2.2x fewer tokens), not for long ones.
"""

from dataclasses import dataclass

import torch

CHUNK_ROWS = 256  # rows of the [rows, V] logits turned into float32 at a time


@dataclass
class TokenBatch:
    """Prompts left-padded to a common width P, completions right-padded to width C after them: completion token j
    of every row sits in column P + j and is predicted by the logits of column P + j - 1. With shared prompts
    (`make_batch(..., share_prompts=True)`) the model sees one packed row per run of rows with the same prompt: its
    first p - 1 tokens once, then per completion a copy of its last token and the completion, each segment at
    positions p - 1, p, ... and attending (block mask) to the prompt and itself only, so each packed column predicts
    one token and `gather_index` reads them back into the [B, C] layout. Same values as padded rows, fewer tokens."""
    input_ids: torch.Tensor  # [B, P + C], or [U, L] packed
    attention_mask: torch.Tensor  # [B, P + C], or [U, 1, L, L] bool (True: may attend) packed
    position_ids: torch.Tensor  # [B, P + C], counting from each row's first real token (packed: [U, L])
    completion_ids: torch.Tensor  # [B, C]
    mask: torch.Tensor  # [B, C] float, 1.0 on real completion tokens
    prompt_width: int
    rollout_logprobs: torch.Tensor | None = None  # [B, C] float32, the engine's logprob of each token (0.0 off mask)
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


def pad_completions(values: list[list[float]], width: int, device: torch.device) -> torch.Tensor:
    """Per-completion-token values (e.g. the engine's logprobs) as a right-padded [B, width] float32 tensor."""
    return _pack(values, width, 0.0, torch.float32, left=False).to(device)


def make_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int, device: torch.device,
               share_prompts: bool = False, rollout_logprobs: list[list[float]] | None = None) -> TokenBatch:
    prompt_width = max(len(p) for p in prompts)
    completion_width = max(1, max(len(c) for c in completions))
    completion_ids = _pack(completions, completion_width, pad_id, torch.long, left=False)
    completion_mask = _pack([[1] * len(c) for c in completions], completion_width, 0, torch.float32, left=False)
    engine = None if rollout_logprobs is None else pad_completions(rollout_logprobs, completion_width, device)
    if share_prompts:
        return _packed_batch(prompts, completions, pad_id, completion_ids, completion_mask, prompt_width, device,
                             engine)
    prompt_ids = _pack(prompts, prompt_width, pad_id, torch.long, left=True)
    mask = torch.cat([_pack([[1] * len(p) for p in prompts], prompt_width, 0, torch.long, left=True),
                      completion_mask.long()], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return TokenBatch(torch.cat([prompt_ids, completion_ids], 1).to(device), mask.to(device), positions.to(device),
                      completion_ids.to(device), completion_mask.to(device), prompt_width, engine)


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
                      completion_mask.to(device), prompt_width, rollout_logprobs,
                      _pack(targets, width, pad_id, torch.long, left=False).to(device), gather_index.to(device),
                      first_predictor)


class _ChosenTokenLogprob(torch.autograd.Function):
    """log softmax(logits / T)[token] and its gradient, chunk by chunk, never holding a float32 [rows, V] tensor
    beyond CHUNK_ROWS rows: forward keeps only logsumexp per row; backward recomputes softmax per chunk. Computed in
    float32 (float64 for float64 logits, for exactness checks)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
        flat, chosen = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1)
        out = torch.empty(flat.shape[0], dtype=torch.promote_types(logits.dtype, torch.float32),
                          device=logits.device)
        logsumexp = torch.empty_like(out)
        for start in range(0, flat.shape[0], CHUNK_ROWS):
            part = flat[start:start + CHUNK_ROWS].to(out.dtype) / temperature
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
            probs = torch.exp(flat[rows].to(logsumexp.dtype) / ctx.temperature - logsumexp[rows, None])
            onehot = vocabulary[None, :] == chosen[rows, None]  # a comparison, not a scatter: deterministic on GPUs
            grad[rows] = (torch.where(onehot, 1 - probs, -probs) * (grad_flat[rows, None] / ctx.temperature)
                          ).to(grad.dtype)
        return grad.view_as(logits), None, None


@torch.no_grad()
def _chunked_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of softmax(logits / T) per row, CHUNK_ROWS rows of float32 at a time (a statistic: no gradient)."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.promote_types(logits.dtype, torch.float32), device=logits.device)
    for start in range(0, flat.shape[0], CHUNK_ROWS):
        part = flat[start:start + CHUNK_ROWS].to(out.dtype) / temperature
        logsumexp = torch.logsumexp(part, dim=-1)
        out[start:start + CHUNK_ROWS] = logsumexp - (torch.softmax(part, dim=-1) * part).sum(-1)
    return out.view(logits.shape[:-1])


def completion_columns(batch: TokenBatch) -> torch.Tensor:
    """The C columns whose outputs predict (or, for a value model, precede) the completion tokens."""
    assert batch.gather_index is None, "a packed batch has no common completion columns"
    width = batch.completion_ids.shape[1]
    return torch.arange(batch.prompt_width - 1, batch.prompt_width - 1 + width, device=batch.input_ids.device)


def token_logprobs(model: torch.nn.Module, batch: TokenBatch, temperature: float, with_entropy: bool = False
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log pi(completion token | everything before it) under softmax(logits / T): [B, C] float32, 0.0 under the mask
    (and, `with_entropy`, the entropy of that distribution at each completion position, detached, 0.0 likewise).
    Logits are computed only for the columns that predict completion tokens (`logits_to_keep`)."""
    packed = batch.gather_index is not None  # every kept packed column predicts the next token of its segment
    columns = (torch.arange(batch.first_predictor, batch.input_ids.shape[1], device=batch.input_ids.device) if packed
               else completion_columns(batch))
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                   logits_to_keep=columns, use_cache=False).logits  # no KV cache: nothing decodes after this forward
    targets = batch.packed_targets[:, batch.first_predictor:] if packed else batch.completion_ids
    logprobs = _ChosenTokenLogprob.apply(logits, targets, temperature)
    entropy = _chunked_entropy(logits, temperature) if with_entropy else None
    if packed:  # back to one row per completion
        logprobs = logprobs.reshape(-1)[batch.gather_index]
        entropy = entropy.reshape(-1)[batch.gather_index] if with_entropy else None
    padding = batch.mask == 0  # packed: another token's logprob there; padded: a prediction of a pad token
    logprobs = logprobs.masked_fill(padding, 0.0)
    return (logprobs, entropy.masked_fill(padding, 0.0)) if with_entropy else logprobs


def mismatch_stats(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                   num_tokens: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """How far the engine's sampled-token logprobs are from the trainer's for the same tokens: shares of the batch
    means (divided by the global token count) of |difference| and of the k3 KL(rollout || trainer), and the max."""
    gap = (trainer_logprobs - rollout_logprobs) * mask
    log_ratio = -gap
    k3 = (torch.exp(log_ratio) - log_ratio - 1) * mask
    return ({"mismatch/logprob_abs_diff_mean": gap.abs().sum() / num_tokens, "mismatch/kl": k3.sum() / num_tokens},
            {"mismatch/logprob_abs_diff_max": gap.abs().max()})
