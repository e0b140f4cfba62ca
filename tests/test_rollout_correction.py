"""The rollout correction's copies agree: each script keeps its own (a script reads whole), so GRPO's, PPO's and
distillation's truncated importance weight, and GRPO's and PPO's sequence mask and rollout correction, must give the
same weights on the same inputs, masked positions and the truncation cap included, and say so in the same words."""

import math

import pytest
import torch

import distill_llm
import grpo_llm
import ppo_llm

TIS_COPIES = (grpo_llm, ppo_llm, distill_llm)
SEQUENCE_COPIES = (grpo_llm, ppo_llm)


def logprobs_and_mask(seed: int, rows: int = 6, columns: int = 9) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random old and rollout logprobs with masked positions as the engines leave them (0.0 on padding and on an
    environment's tokens), and three rows made for the edges: one with no model token, one whose ratio is exactly 2 on
    each of its 4 tokens (so its geometric mean is too), one whose ratios of e^5 pass every cap."""
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, columns, generator=generator) * 3
    rollout = old + torch.randn(rows, columns, generator=generator) * 0.5
    mask = (torch.rand(rows, columns, generator=generator) < 0.7).float()
    mask[0] = 0.0
    old[1], rollout[1], mask[1] = 0.0, -math.log(2.0), 0.0
    mask[1, :4] = 1.0  # a mean over a power of two is exact
    rollout[2], mask[2, 0] = old[2] - 5.0, 1.0
    rollout = torch.where(mask.bool(), rollout, torch.zeros_like(rollout))
    return old, rollout, mask


@pytest.mark.parametrize("cap", [0.0, 1.0, 2.0, 10.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_truncated_importance_weights_agree(cap, seed):
    old, rollout, mask = logprobs_and_mask(seed)
    weights = [copy.truncated_importance_weight(old, rollout, cap) for copy in TIS_COPIES]
    for weight in weights[1:]:
        assert torch.equal(weight, weights[0])
    expected = torch.ones_like(old) if cap == 0 else torch.exp(old - rollout).clamp(max=cap)
    torch.testing.assert_close(weights[0], expected, rtol=0, atol=0)  # the cap binds where the ratio passes it
    if cap:
        assert torch.all(weights[0][2][mask[2].bool()] == cap) and weights[0].max() <= cap


@pytest.mark.parametrize("tis_cap, seq_mask_cap", [(0.0, 2.0), (2.0, 2.0), (2.0, 0.0), (1.5, 1.2), (10.0, 50.0)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_sequence_masks_and_rollout_corrections_agree(tis_cap, seq_mask_cap, seed):
    old, rollout, mask = logprobs_and_mask(seed)
    if seq_mask_cap:
        kept = [copy.sequence_mask(old, rollout, mask, seq_mask_cap) for copy in SEQUENCE_COPIES]
        assert torch.equal(kept[0], kept[1]) and kept[0].shape == (old.shape[0], 1)
        assert kept[0][0].item() == 1.0  # no model token: a ratio of 1, kept
        assert kept[0][1].item() == float(seq_mask_cap >= 2.0)  # rho exactly 2 is inside [1/2, 2], outside [1/c, c<2]
        assert kept[0][2].item() == float(seq_mask_cap > torch.e ** 5)
    corrections = [copy.rollout_correction(old, rollout, mask, tis_cap, seq_mask_cap) for copy in SEQUENCE_COPIES]
    assert torch.equal(corrections[0], corrections[1])


def test_the_copies_say_the_same():
    for name, copies in (("truncated_importance_weight", TIS_COPIES), ("sequence_mask", SEQUENCE_COPIES),
                         ("rollout_correction", SEQUENCE_COPIES)):
        docs = {getattr(copy, name).__doc__ for copy in copies}
        assert len(docs) == 1, f"the docstrings of {name} differ across {[copy.__name__ for copy in copies]}"
