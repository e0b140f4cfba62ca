"""The two attention implementations the trainer registers with transformers: `padded_rows` (SDPA for left-padded
rows, with a mask transformers never reads on the host; the CPU path of packed rows too, with their dense mask) and
`packed_flex` (FlexAttention over packed rows on GPUs, from [U, L] segment ids through a block mask).
common/llm/batching.py lays the rows out for them.

Per family, beyond a Llama block:
- sliding windows (Gemma 3, OLMo 3, gpt-oss, Mistral): transformers builds a padded row's mask per layer kind;
  packed rows get one mask per kind here, the window counted in positions (a packed completion continues its prompt's
  positions, not its columns);
- attention sinks (gpt-oss): a learned logit per head in the softmax's denominator, with transformers' eager semantics
  on padded rows and on CPU, and through FlexAttention's log-sum-exp on GPUs;
- linear attention (Gated DeltaNet): its state runs along a row, from one completion into the next: packed rows are
  refused (padded rows are exact);
- soft-capped attention logits (Gemma 2): refused at load (common/llm/models.py)."""

import functools

import torch

PACKED_ATTENTION = "packed_flex"  # the attention implementation for packed rows on GPUs (registered below)
# transformers' SDPA for padded rows, with a mask it never reads on the host. No "sdpa" in the name: transformers checks
# a model's SDPA support for any name holding it, and gpt-oss (sinks) has none.
PADDED_ATTENTION = "padded_rows"
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"  # transformers' names of layer kinds


def layer_windows(config: object) -> dict[str, int | None]:
    """The kinds of attention layer a model has, each with its window in tokens (None: full attention), as its
    transformers forward reads them: a config with `layer_types` (Gemma 3, OLMo 3, gpt-oss, Qwen2/3) has one mask per
    kind, the window on the sliding ones; one without (Mistral, Phi-3, Qwen3-MoE) gives every layer one mask, windowed
    where the config names a window. A kind no attention mask can express raises (linear attention)."""
    text = config.get_text_config()
    window = getattr(text, "sliding_window", None)
    kinds = getattr(text, "layer_types", None)
    if not kinds:
        return {FULL_ATTENTION: window}
    unknown = sorted(set(kinds) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown:
        raise ValueError(f"{text.model_type}: packed rows cannot hold its {', '.join(unknown)} layers (a linear "
                         "attention layer's state runs along the row, from one completion into the next, and no mask "
                         "cuts it); lay its rows out padded (make_batch(..., share_prompts=False))")
    return {kind: window if kind == SLIDING_ATTENTION else None for kind in dict.fromkeys(kinds)}


def packed_attention_mask(segment_ids: torch.Tensor, position_ids: torch.Tensor, config: object) -> object:
    """Who may attend to whom in packed rows: earlier columns of one's own segment, and the shared prompt (padding
    attends to itself and is never read), and in a sliding layer only the last `window` positions (transformers'
    rule, q - kv < window). One mask per layer kind (`layer_windows`): a dict keyed by kind where a model has two
    kinds, as transformers' forwards accept it, else the mask itself.

    For FlexAttention (`config._attn_implementation` PACKED_ATTENTION) a BlockMask, built from this rule and the
    [U, L] segment ids and positions, never an L x L tensor (at 512 + 8 x 1,025 tokens an L x L boolean is 76 MB per
    row, and SDPA with any explicit mask cannot use its flash kernel); for SDPA (the CPU path) the dense [U, 1, L, L]
    boolean, on the device, for this forward only."""
    flex = config._attn_implementation == PACKED_ATTENTION
    masks = {kind: _packed_mask(segment_ids, position_ids, window, flex)
             for kind, window in layer_windows(config).items()}
    return masks if len(masks) > 1 else next(iter(masks.values()))


def _packed_mask(segment_ids: torch.Tensor, position_ids: torch.Tensor, window: int | None, flex: bool) -> object:
    rows, width = segment_ids.shape
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask

        def may_attend(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            allowed = (kv <= q) & ((segment_ids[b, q] == segment_ids[b, kv]) | (segment_ids[b, kv] == -1))
            if window is None:
                return allowed
            return allowed & (position_ids[b, q] - position_ids[b, kv] < window)

        # compiled on GPUs: eager construction evaluates the rule on a dense [U, L, L] grid first
        return create_block_mask(may_attend, rows, None, width, width, device=segment_ids.device,
                                 _compile=segment_ids.is_cuda)
    causal = torch.ones(width, width, dtype=torch.bool, device=segment_ids.device).tril()
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
    allowed = causal & (same_segment | (segment_ids[:, None, :] == -1))
    if window is not None:
        allowed &= position_ids[:, :, None] - position_ids[:, None, :] < window
    return allowed[:, None]


def _flex_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: object, scaling: float | None = None, s_aux: torch.Tensor | None = None,
                    **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over FlexAttention with the packed rows' BlockMask, compiled with dynamic
    shapes (transformers' own flex path compiles per shape, and packed widths change every micro-batch); eager on
    CPU, where only the tests run it. query [U, heads, L, D] -> [U, L, heads, D]. With sinks (`s_aux`, one logit per
    head) each query's output is rescaled by Z / (Z + exp(sink)), Z = exp(its log-sum-exp over the keys it attends to):
    the same softmax as with the sink as one more key whose value is zero (the kernel's log-sum-exp carries a
    gradient on GPUs; on CPU FlexAttention has no backward)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    attend = flex_attention if query.device.type == "cpu" else _compiled_flex_attention()
    enable_gqa = query.shape[1] != key.shape[1]
    if s_aux is None:
        output = attend(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=enable_gqa)
    else:
        output, aux = attend(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=enable_gqa,
                             return_aux=AuxRequest(lse=True))
        kept = torch.sigmoid(aux.lse - s_aux.float()[None, :, None])  # [U, heads, L], float32
        output = (output.float() * kept[..., None]).to(output.dtype)
    return output.transpose(1, 2).contiguous(), None


@functools.cache
def _compiled_flex_attention() -> object:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def register_packed_attention() -> None:
    """Make PACKED_ATTENTION a name transformers' models accept as `attn_implementation`."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, _flex_attention)


def _padded_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, s_aux: torch.Tensor | None = None, **kwargs: object
                      ) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, as called for its own "sdpa"; with sinks (`s_aux`), which SDPA cannot add to
    its softmax, `_eager_attention_with_sinks`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if s_aux is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return _eager_attention_with_sinks(query, key, value, attention_mask, kwargs["scaling"], s_aux)


def _eager_attention_with_sinks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                attention_mask: torch.Tensor | None, scaling: float, sinks: torch.Tensor
                                ) -> tuple[torch.Tensor, None]:
    """gpt-oss's eager attention (transformers' modeling_gpt_oss.eager_attention_forward, the same operations in the
    same order) from a boolean mask: each head's sink logit joins every query's softmax as one more column, which is
    then dropped. It holds [rows, heads, L, L] scores and probabilities per layer, as transformers' eager path does
    (SDPA has no sinks; packed rows on GPUs go through FlexAttention)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, float("-inf"))  # eager adds the dtype's minimum: the same 0.0s
    sink_column = sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], -1)
    logits = torch.cat([scores, sink_column], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(value.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


def _padded_attention_mask(*args: object, **kwargs: object) -> torch.Tensor:
    """transformers' SDPA mask without its skip: before building a mask it asks whether every position of the
    padding mask is real (`padding_mask.all()`, read on the host), so that SDPA could run with is_causal instead; on
    GPUs that read waits for every kernel queued, the previous micro-batch's backward included, at every forward.
    Padded RL batches almost always have padding, so the mask was built anyway; here it always is (a micro-batch
    without any padding, which transformers' own mask would send to SDPA's flash kernel with is_causal, runs the masked
    kernel: other bits for such a batch than transformers' path; the CPU reference runs' hashes are the same either
    way)."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})


def register_padded_attention() -> None:
    """Make PADDED_ATTENTION a name transformers' models accept as `attn_implementation`: `_padded_attention`, and
    `_padded_attention_mask` as its mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(PADDED_ATTENTION, _padded_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PADDED_ATTENTION, _padded_attention_mask)
