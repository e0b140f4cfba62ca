"""The two attention implementations the trainer registers with transformers: `padded_sdpa` (SDPA for left-padded
rows, with a mask transformers never reads on the host) and `packed_flex` (FlexAttention over packed rows on GPUs,
from [U, L] segment ids through a block mask). common/llm/batching.py lays the rows out for them."""

import functools

import torch

PACKED_ATTENTION = "packed_flex"  # the attention implementation for packed rows on GPUs (registered below)


def packed_attention_mask(segment_ids: torch.Tensor, attn_implementation: str) -> object:
    """Who may attend to whom in packed rows: earlier columns of one's own segment, and the shared prompt (padding
    attends to itself and is never read). For FlexAttention a BlockMask, built from this rule and the [U, L] segment
    ids, never an L x L tensor (at 512 + 8 x 1,025 tokens an L x L boolean is 76 MB per row, and SDPA with any
    explicit mask cannot use its flash kernel); for SDPA (the CPU path) the dense [U, 1, L, L] boolean, on the
    device, for this forward only."""
    rows, width = segment_ids.shape
    if attn_implementation == PACKED_ATTENTION:
        from torch.nn.attention.flex_attention import create_block_mask

        def may_attend(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return (kv <= q) & ((segment_ids[b, q] == segment_ids[b, kv]) | (segment_ids[b, kv] == -1))

        # compiled on GPUs: eager construction evaluates the rule on a dense [U, L, L] grid first
        return create_block_mask(may_attend, rows, None, width, width, device=segment_ids.device,
                                 _compile=segment_ids.is_cuda)
    causal = torch.ones(width, width, dtype=torch.bool, device=segment_ids.device).tril()
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (causal & (same_segment | (segment_ids[:, None, :] == -1)))[:, None]


def _flex_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: object, scaling: float | None = None, **kwargs: object
                    ) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over FlexAttention with the packed rows' BlockMask, compiled with dynamic
    shapes (transformers' own flex path compiles per shape, and packed widths change every micro-batch); eager on
    CPU, where only the tests run it. query [U, heads, L, D] -> [U, L, heads, D]."""
    from torch.nn.attention.flex_attention import flex_attention

    attend = flex_attention if query.device.type == "cpu" else _compiled_flex_attention()
    output = attend(query, key, value, block_mask=attention_mask, scale=scaling,
                    enable_gqa=query.shape[1] != key.shape[1])
    return output.transpose(1, 2).contiguous(), None


@functools.cache
def _compiled_flex_attention() -> object:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def register_packed_attention() -> None:
    """Make PACKED_ATTENTION a name transformers' models accept as `attn_implementation`."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, _flex_attention)


PADDED_ATTENTION = "padded_sdpa"  # transformers' SDPA for padded rows, with a mask it never reads on the host


def _padded_sdpa_mask(*args: object, **kwargs: object) -> torch.Tensor:
    """transformers' SDPA mask without its skip: before building a mask it asks whether every position of the
    padding mask is real (`padding_mask.all()`, read on the host), so that SDPA could run with is_causal instead; on
    GPUs that read waits for every kernel queued, the previous micro-batch's backward included, at every forward.
    Padded RL batches almost always have padding, so the mask was built anyway; here it always is (a micro-batch
    without any padding, which could have run SDPA's flash kernel with is_causal, now runs the masked kernel: other
    bits for such a batch than before; the CPU reference runs kept their hashes)."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})


def register_padded_attention() -> None:
    """Make PADDED_ATTENTION a name transformers' models accept as `attn_implementation`: SDPA's attention, and
    _padded_sdpa_mask as its mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    AttentionInterface.register(PADDED_ATTENTION, ALL_ATTENTION_FUNCTIONS["sdpa"])
    ALL_MASK_ATTENTION_FUNCTIONS.register(PADDED_ATTENTION, _padded_sdpa_mask)
