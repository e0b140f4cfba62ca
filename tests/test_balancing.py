"""Token balancing (--balance-tokens, common/llm/balancing.py): the plan by hand (the partition, the contiguous
micro-batches, the groups of one node), the rows that move keeping their loss masks, the point-to-point messages
between the pairs that move rows only (on a fake process group), then under torchrun: GRPO's loss and gradient the
same after balancing hand-skewed rollouts (2 ranks), and partners kept within a node (8 ranks).
The fake engine's balanced run and its timings: tests/test_scale.py; the simulator's model of balancing:
tests/test_weak_scaling_sim.py."""

import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import check, run_script

from common.llm.balancing import balance_groups, balance_tokens, balanced_partition, contiguous_pieces
from common.llm.run import Rollout, Sample


def test_balanced_partition_by_hand():
    assert balanced_partition([5, 1, 1, 1, 4, 3, 2, 2], 2) == [[0, 3, 6, 7], [1, 2, 4, 5]]  # 10 and 9
    skewed = [100, 90, 80] + [10] * 6 + [3] * 40  # one rank drew the long tail
    parts = balanced_partition(skewed, 4)
    loads = [sum(skewed[i] for i in part) for part in parts]
    assert max(loads) <= 1.1 * sum(loads) / 4
    assert sorted(i for part in parts for i in part) == list(range(len(skewed)))


def test_contiguous_pieces_by_hand():
    assert contiguous_pieces([1] * 6, 3) == [[0, 1], [2, 3], [4, 5]]
    assert contiguous_pieces([10, 1, 1, 1], 3) == [[0], [1], [2, 3]]
    assert contiguous_pieces([1, 1, 1, 10], 3) == [[0, 1], [2], [3]]  # never fewer items left than pieces to fill


def test_balancing_groups_are_the_ranks_of_one_node():
    assert balance_groups(16, 4) == [range(0, 4), range(4, 8), range(8, 12), range(12, 16)]  # never 8 over two nodes
    assert balance_groups(16, 8) == [range(0, 8), range(8, 16)]
    assert balance_groups(6, 4) == [range(0, 4), range(4, 6)]  # split layout: the trainers end inside a node
    assert balance_groups(3, 8) == [range(0, 3)]
    assert balance_groups(20, 1) == [range(0, 8), range(8, 16), range(16, 20)]  # one rank per node: 8 at a time


def test_balancing_carries_the_loss_masks(world_of_one):
    samples = [Sample([5, 6, 7, 8], [-0.1, -0.2, 0.0, -0.3], False, [1, 1, 0, 1]), Sample([9, 1], [-0.4, -0.5], True)]
    rollout = Rollout([[3, 4], [3, 4]], [], samples, [s.completion_ids for s in samples], [], torch.zeros(2),
                      torch.zeros(2), torch.tensor([[[2, 4], [2, 2]]]), 0.0, 0.0, {}, 1, 0, [], {})
    run = SimpleNamespace(rank=0, device=torch.device("cpu"))
    moved, values, _ = balance_tokens(rollout, run, torch.tensor([[1.0], [2.0]]), 1, 8, 0)
    by_ids = {tuple(s.completion_ids): s for s in moved.samples}
    assert by_ids[(5, 6, 7, 8)].loss_mask == [1, 1, 0, 1] and by_ids[(9, 1)].loss_mask is None
    assert by_ids[(9, 1)].truncated and by_ids[(5, 6, 7, 8)].logprobs == pytest.approx([-0.1, -0.2, 0.0, -0.3])


@pytest.mark.parametrize("fake_world", [(4, rank) for rank in range(4)], indirect=True)
def test_token_balancing_messages_only_the_pairs_that_move_rows(fake_world, monkeypatch):
    """World 4, rank 0 holding the long completions: the plan moves rows between some pairs of ranks only, and each
    rank posts exactly those sends and receives (an all-to-all would post one of each to every peer, empty or not)."""
    rank, world_size = fake_world
    rows = 4
    completion_lengths = [[30, 28, 26, 24], [3, 3, 2, 2], [4, 3, 3, 2], [2, 2, 2, 2]]
    prompts = [[3, 4, 5]] * rows
    samples = [Sample([5] * length, [-0.5] * length, False) for length in completion_lengths[rank]]
    lengths = torch.tensor([[[3, length] for length in ranks] for ranks in completion_lengths])
    rollout = Rollout(prompts, [], samples, [s.completion_ids for s in samples], [], torch.empty(0), torch.empty(0),
                      lengths, 0.0, 0.0, {}, 1, 0, [])
    messages = {"send": set(), "receive": set()}
    monkeypatch.setattr(dist, "isend", lambda tensor, dst: messages["send"].add(dst) or _done())
    monkeypatch.setattr(dist, "irecv", lambda tensor, src: messages["receive"].add(src) or _done())
    monkeypatch.setattr(dist, "all_to_all_single", lambda *args, **kwargs: pytest.fail("an all-to-all"))
    run = SimpleNamespace(rank=rank, world_size=world_size, device=torch.device("cpu"), pad_id=0)
    balance_tokens(rollout, run, torch.zeros(rows, 1), 1, 2, 0)
    weights = [3 + length for ranks in completion_lengths for length in ranks]
    parts = balanced_partition(weights, world_size)
    sends = {destination for destination, part in enumerate(parts) if any(u // rows == rank for u in part)} - {rank}
    receives = {u // rows for u in parts[rank]} - {rank}
    assert messages == {"send": sends, "receive": receives}
    pairs = {(rank, d) for d in sends}
    assert len(pairs) < world_size - 1 or len(receives) < world_size - 1  # some peer gets no message at all


def _done() -> SimpleNamespace:
    return SimpleNamespace(wait=lambda: None)  # a finished isend/irecv request


@pytest.fixture(scope="module")
def balance_summary(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("balance") / "summary.json"
    check(run_script("tests/workers/balance_worker.py", [str(out)], nproc=2, timeout=300))
    return json.loads(out.read_text())


@pytest.mark.parametrize("layout", ["padded", "shared"])
def test_token_balancing_moves_rows_not_the_loss(balance_summary: dict, layout: str):
    """Hand-skewed rollouts (rank 0: completions of 20-40 tokens, rank 1: 3-6): after balancing every rank holds
    nearly the mean, every row arrives exactly once with its logprobs, advantage and MoE routes, both ranks run the
    same number of micro-batches, and GRPO's loss and gradient norm are the unbalanced ones up to summation order;
    balancing twice gives the same gradient bits."""
    result = balance_summary[layout]
    before = [tokens[0] for tokens in result["tokens_per_rank"]]
    after = [tokens[1] for tokens in result["tokens_per_rank"]]
    assert max(before) > 2 * min(before)  # the skew is real
    assert sum(after) == sum(before) and max(after) <= 1.1 * sum(after) / len(after)
    assert result["same_rows"]
    assert len(set(result["micro_batches_per_rank"])) == 1
    unbalanced, balanced = result["unbalanced"], result["balanced"]
    # float32 sums in another order: measured 6e-8 relative on the loss, 3e-7 on the norm
    assert balanced["loss"] == pytest.approx(unbalanced["loss"], rel=1e-5)
    assert balanced["grad_norm"] == pytest.approx(unbalanced["grad_norm"], rel=1e-5)
    assert balanced["gradient_sha256"] == result["balanced_again"]["gradient_sha256"]


def test_token_balancing_keeps_its_partners_within_its_node(tmp_path):
    """8 gloo ranks, 200 steps of long-tailed random lengths (tests/workers/balance_fds_worker.py). Taken for two nodes
    of 4 ranks, each rank exchanges rows with members of its own node only, and holds fewer open sockets than as one
    node of 8 (the negative control), whose ranks exchange with peers beyond their first 4."""
    touched = {}
    for node in (4, 8):
        out = tmp_path / f"node_{node}"
        out.mkdir()
        check(run_script("tests/workers/balance_fds_worker.py", [str(out), str(node)], nproc=8))
        touched[node] = {rank: json.loads((out / f"rank_{rank}.json").read_text()) for rank in range(8)}
    for rank, result in touched[4].items():
        own_node = set(range(rank - rank % 4, rank - rank % 4 + 4)) - {rank}
        assert set(result["peers"]) <= own_node and result["peers"], (rank, result)
        assert result["sockets_at_end"] < touched[8][rank]["sockets_at_end"], (rank, result, touched[8][rank])
    assert any(set(result["peers"]) - set(range(rank - rank % 4, rank - rank % 4 + 4))
               for rank, result in touched[8].items())  # one node of 8: rows cross the first 4 ranks
