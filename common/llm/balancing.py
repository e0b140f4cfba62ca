"""Token balancing: completions move between ranks so that each trains on nearly the same number of tokens (FSDP runs
in lock step, so each micro-batch costs the slowest rank's time), and each rank's rows are cut into the same number of
micro-batches. The plan is a function of every rank's lengths alone, so every rank computes the same one."""

import math

import torch
import torch.distributed as dist

from common.distributed import local_world_size
from common.llm.run import LLMRun, Rollout, Sample

# Rows move only among the ranks of one node (`balance_groups`): gloo keeps a socket open for every pair that ever
# exchanged, so balancing over the whole world would, step after step, open N - 1 per rank (past the common 1,024
# open files at about 1,000 ranks), and within a node no row crosses the network. Within a group the plan is as
# before; the groups' totals are not evened out (their difference shrinks as the group's sum of many rows). With one
# rank per node there is no node to stay within: groups of BALANCE_GROUP_RANKS consecutive ranks then.
BALANCE_GROUP_RANKS = 8


def balance_groups(world_size: int, ranks_per_node: int) -> list[range]:
    """The consecutive ranks that balance among themselves: each node's (torchrun numbers ranks node by node, node k
    holding ranks k x ranks_per_node onwards; the split layout's trainers, the first ranks, may end inside a node),
    or BALANCE_GROUP_RANKS at a time with one rank per node. On nodes of 4 GPUs, groups of 8 would span two."""
    size = ranks_per_node if ranks_per_node > 1 else BALANCE_GROUP_RANKS
    return [range(first, min(first + size, world_size)) for first in range(0, world_size, size)]


def balance_tokens(rollout: Rollout, run: LLMRun, per_row: torch.Tensor, unit: int, micro_batch_size: int,
                   micro_batch_tokens: int) -> tuple[Rollout, torch.Tensor, list[list[int]]]:
    """Move rows between ranks so that every rank trains on nearly the same number of tokens (FSDP runs in lock step:
    each micro-batch costs the slowest rank's time), and cut each rank's rows into micro-batches. Units of `unit`
    consecutive rows (GRPO's packed groups) move whole; `per_row` [rows, k] (e.g. advantages) travels with them.

    The plan needs nothing but every rank's lengths, gathered by `generate`, so every rank computes the same plan:
    `balanced_partition` of each group's units by tokens (heaviest unit <= mean + the largest), each rank's units
    ordered by length (similar lengths pad less together), then the same number M of micro-batches on every rank (the
    lock step): M = the most any rank needs for `micro_batch_tokens` padded tokens each (else `micro_batch_size`
    rows), at most the fewest units any rank holds. The rows move point to point between the pairs of ranks that
    exchange any, over gloo (`exchange`), within each node (`balance_groups`), never an all-to-all over the world.
    The loss is unchanged: every normaliser counts the whole batch. Returns this rank's rollout, per_row and
    its micro-batches' rows."""
    world, rows, _ = rollout.lengths.shape
    lengths = rollout.lengths.view(world * rows // unit, unit, 2)  # [global units, unit, (prompt, completion)]
    weights = (lengths[:, :, 0] + lengths[:, :, 1]).sum(1).tolist()
    units_per_rank = rows // unit
    parts = []
    for group in balance_groups(world, local_world_size()):  # each group's units among its own ranks
        offset = group.start * units_per_rank
        plan = balanced_partition(weights[offset:offset + len(group) * units_per_rank], len(group))
        parts += [[offset + u for u in part] for part in plan]
    for part in parts:
        part.sort(key=lambda u: (weights[u], u))
    mine = parts[run.rank]
    # --- move: each rank sends its units to their new ranks, in the order the receiver keeps them
    tokens = [rollout.prompts[r] + rollout.completions[r] for r in range(rows)]
    floats = [[*rollout.samples[r].logprobs, *rollout.samples[r].model_mask(), float(rollout.samples[r].truncated),
               *per_row[r].tolist()] for r in range(rows)]  # a completion's logprobs and loss mask, then per row
    route_shape = rollout.samples[0].routes.shape[1:] if rows and rollout.samples[0].routes is not None else None
    streams = [(tokens, torch.long, -1), (floats, torch.float64, 1 + per_row.shape[1])]
    if route_shape is not None:  # --routing-replay: each token's experts travel with it
        streams.append(([rollout.samples[r].routes.reshape(-1).tolist() for r in range(rows)], torch.int16, -2))

    def rows_of(u: int) -> range:
        return range((u % units_per_rank) * unit, (u % units_per_rank + 1) * unit)

    def size(u: int, extra: int) -> int:  # a unit's entries in the token (-1), route (-2) or float stream
        if extra == -2:
            return int(lengths[u].sum()) * math.prod(route_shape)
        return int(lengths[u].sum()) if extra < 0 else 2 * int(lengths[u, :, 1].sum()) + unit * extra

    sent = [[u for u in part if u // units_per_rank == run.rank] for part in parts]
    received = [[u for u in mine if u // units_per_rank == source] for source in range(world)]
    extra = 1 + per_row.shape[1]
    moved = [exchange([[value for u in part for r in rows_of(u) for value in stream[r]] for part in sent],
                      [sum(size(u, width) for u in part) for part in received], dtype)
             for stream, dtype, width in streams]
    starts = {}  # where each unit starts in each received stream (in sender order)
    offsets = [0] * len(streams)
    for u in (u for part in received for u in part):
        starts[u] = list(offsets)
        offsets = [offset + size(u, width) for offset, (_, _, width) in zip(offsets, streams)]
    prompts, samples, values = [], [], []
    for u in sorted(mine, key=lambda u: (weights[u], u)):
        t, f, *routed = starts[u]
        for prompt_length, completion_length in lengths[u].tolist():
            prompts.append(moved[0][t:t + prompt_length])
            completion = moved[0][t + prompt_length:t + prompt_length + completion_length]
            record = moved[1][f:f + 2 * completion_length + extra]
            loss_mask = [int(m) for m in record[completion_length:2 * completion_length]]
            routes = None
            if routed:
                count = (prompt_length + completion_length) * math.prod(route_shape)
                routes = torch.tensor(moved[2][routed[0]:routed[0] + count], dtype=torch.int16).view(-1, *route_shape)
                routed[0] += count
            samples.append(Sample(completion, record[:completion_length], bool(record[2 * completion_length]),
                                  loss_mask if 0 in loss_mask else None, routes=routes))
            values.append(record[2 * completion_length + 1:])
            t, f = t + prompt_length + completion_length, f + 2 * completion_length + extra
    # --- micro-batches: the same count on every rank
    def padded(units: list[int]) -> int:
        block = lengths[units]
        return len(units) * unit * int(block[:, :, 0].max() + block[:, :, 1].max())

    def needed(part: list[int]) -> int:
        if not micro_batch_tokens:
            return math.ceil(len(part) * unit / micro_batch_size)
        count, current = 0, []
        for u in part:
            if current and padded(current + [u]) > micro_batch_tokens:
                count, current = count + 1, []
            current.append(u)
        return count + bool(current)

    count = min(max(needed(part) for part in parts), min(len(part) for part in parts))
    micro_batch_units = contiguous_pieces([weights[u] for u in mine], count) if mine else []
    micro_batch_rows = [[i * unit + j for i in units for j in range(unit)] for units in micro_batch_units]
    balanced = Rollout(prompts, [], samples, [s.completion_ids for s in samples], [], torch.empty(0), torch.empty(0),
                       rollout.lengths, rollout.started, rollout.seconds, rollout.timings, rollout.step,
                       rollout.version, rollout.rollout_timings, rollout.rollout_metrics)
    return balanced, torch.tensor(values, dtype=per_row.dtype).reshape(len(samples), -1), micro_batch_rows


def balanced_partition(weights: list[int], parts: int) -> list[list[int]]:
    """Indices of `weights` split into `parts` lists of nearly equal sums, deterministically: heaviest first, each to
    the lightest part so far (ties: the lower part, then the lower index). Greedy LPT (Graham 1969): the heaviest part
    exceeds the mean by at most the largest weight, and the optimum's by at most a third; O(n log n) where
    Karmarkar-Karp's differencing costs O(n x parts) list merges, minutes in Python at 1,024 ranks x 64 completions.
    Each part lists its indices in ascending order."""
    import heapq

    loads = [(0, part) for part in range(parts)]
    members: list[list[int]] = [[] for _ in range(parts)]
    for index in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        load, part = heapq.heappop(loads)
        members[part].append(index)
        heapq.heappush(loads, (load + weights[index], part))
    return [sorted(part) for part in members]


def contiguous_pieces(weights: list[int], count: int) -> list[list[int]]:
    """Indices 0..n-1 cut into exactly `count` consecutive non-empty pieces (count <= n) of nearly equal weight: each
    cut where the running sum first reaches the next multiple of total / count, never leaving fewer items than the
    pieces still to fill."""
    total, pieces, running = sum(weights), [[]], 0
    for index, weight in enumerate(weights):
        left_after = len(weights) - index - 1
        pieces[-1].append(index)
        running += weight
        if len(pieces) < count and (running >= total * len(pieces) / count or left_after == count - len(pieces)):
            pieces.append([])
    return pieces


def exchange(outgoing: list[list[float]], incoming_sizes: list[int], dtype: torch.dtype) -> list[float]:
    """Point to point: `outgoing[p]` goes to rank p, `incoming_sizes[p]` values come from rank p; returns what came,
    in rank order, this rank's own part copied locally. Only non-empty pairs exchange a message, over gloo (CPU
    tensors): every rank knows the plan, so no rank posts a zero-byte send. An unequal-split all-to-all on NCCL
    would post a send and a receive to every peer, and NCCL sets up a connection per peer and channel the first
    time a pair exchanges, with the buffers of all three protocols (12 MiB per channel and peer inside a node, by
    NCCL 2.30's source; benchmarks/memory_estimate.py --outside-the-step): memory and connection time growing with
    the world size, for bookkeeping built on the host anyway."""
    rank = dist.get_rank()
    received = [torch.zeros(size, dtype=dtype) for size in incoming_sizes]
    requests = [dist.irecv(received[peer], src=peer) for peer, size in enumerate(incoming_sizes)
                if size and peer != rank]
    requests += [dist.isend(torch.tensor(values, dtype=dtype), dst=peer) for peer, values in enumerate(outgoing)
                 if values and peer != rank]
    for request in requests:
        request.wait()
    received[rank] = torch.tensor(outgoing[rank], dtype=dtype)
    return [value for part in received for value in part.tolist()]
