"""The split layout (`--rollout-ranks K`): the last K ranks only generate, each with its own engine; the first
N - K only train, FSDP2 over themselves alone; rank 0 (a trainer) writes the run directory. Each side gets a world
of its own: the default process group is replaced by the side's group (`_update_default_pg`, the private call
torch's own `shrink_group` makes), so FSDP2, checkpoints, statistics and vLLM's `external_launcher` groups work on
either side unchanged. Three groups created before the swap join the sides: `world` (every rank; CPU tensors,
gloo) carries samples (point to point: each rollout rank to the trainers holding its rows) and evaluations,
`bridge` (trainer rank 0 + the rollout ranks; NCCL on GPUs) the weights.

The schedule is fixed, so the bits do not depend on timing. Batch t is sampled with the weights after update
t - 1 - S (`--max-staleness S`, 0 or 1; version 0 = the starting model), and every transfer happens at a fixed point
of both sides' loops, in the same order:
    S = 0:  trainer  [receive batch t] train t [send weights t] [receive evaluation t, when due]
            rollout  [generate t, send it] [receive weights t] [evaluate, send it]
    S = 1:  trainer  train t [receive batch t + 1] [send weights t] [receive evaluation t]
            rollout  [generate t + 1 with the weights of update t - 1, send it] [receive weights t] [evaluate]
With S = 1 batch t + 1 is generated while batch t trains; it sits on the trainers when step t ends, so a checkpoint
holds it (each trainer's rows, gathered onto rank 0's trainer_state.pt) and a resumed run is the uninterrupted one.

Weights, trainer -> rollout, per sync: every trainer iterates the bucketed gather of the FSDP shards
(`models.stream_weights`, in the rollout dtype); trainer rank 0 concatenates each bucket of about SYNC_BUCKET_BYTES
and broadcasts it over `bridge` (a header object, then one tensor); each rollout rank loads it into its engine
before the next bucket comes, so no rank holds the whole model. A broadcast pipelines through a ring or tree, so it
costs about bytes / bandwidth whatever K; with --max-staleness 1 it is on the critical path once per step (the
trainer waits for it; the engines stop only for it). A rollout rank holds no optimizer state, gradients or float32
masters: its engine's weights, its KV cache and, during a sync, a few buckets (the time and the memory at 7B:
docs/scaling.md, "Memory and bandwidth")."""

import math
import pickle
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _update_default_pg

from common import distributed
from common.llm.models import SYNC_BUCKET_BYTES
from common.llm.rollouts import SampledRows, rank_rows
from common.llm.run import Layout, LLMRun, Rollout, Sample


def split_world(rollout_ranks: int, max_staleness: int) -> Layout:
    """A collective of every rank: the groups, then each side's group becomes its default (rank and world size as
    `dist` reports them are then the side's), and the long-timeout save group is made again inside it."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    trainers = world_size - rollout_ranks
    world = dist.group.WORLD
    trainer_group = dist.new_group(list(range(trainers)))  # new_group is collective over the world: all make all
    rollout_group = dist.new_group(list(range(trainers, world_size)))
    bridge = dist.new_group([0, *range(trainers, world_size)])
    _update_default_pg(rollout_group if rank >= trainers else trainer_group)
    distributed.renew_save_group()
    return Layout(rollout_ranks, trainers, max_staleness, rank >= trainers, world, bridge)


def row_ranges(rows: int, parts: int) -> list[range]:
    """The step's global rows (G consecutive per prompt) cut into `parts` equal contiguous slices."""
    per_part = rows // parts
    return [range(part * per_part, (part + 1) * per_part) for part in range(parts)]


def _overlap(first: range, second: range) -> range:
    return range(max(first.start, second.start), max(min(first.stop, second.stop), max(first.start, second.start)))


def _correspondents(layout: Layout, rows_per_step: int) -> dict[tuple[int, int], range]:
    """Which rollout rank sends which global rows to which trainer: {(rollout index, trainer): rows}. Every rollout
    rank also writes to trainer 0 (its timings for the log), so a trainer talks to the few rollout ranks that hold its
    rows and never opens a connection to every rank (gloo connects a pair when it first exchanges data)."""
    generated = row_ranges(rows_per_step, layout.rollout_ranks)
    trained = row_ranges(rows_per_step, layout.trainer_ranks)
    return {(source, trainer): _overlap(generated[source], trained[trainer])
            for source in range(layout.rollout_ranks) for trainer in range(layout.trainer_ranks)
            if trainer == 0 or _overlap(generated[source], trained[trainer])}


def send_samples(layout: Layout, rows_per_step: int, samples: list[Sample], scores: list[float],
                 correct: list[float], version: int, timings: dict[str, float],
                 indices: list[int] | None = None) -> None:
    """A rollout rank's side of the sample transfer, point to point over `world`: each of its trainers gets its rows
    (their scores and correctness), the weight version that sampled them and this rank's timings; a size, then the
    bytes. The rows' `indices` into the training prompts travel too when they are not the step's own (dynamic
    sampling refills a batch from further prompts)."""
    me = dist.get_rank()  # this side's rank: the rollout index
    first = row_ranges(rows_per_step, layout.rollout_ranks)[me].start
    requests = []
    for (source, trainer), rows in _correspondents(layout, rows_per_step).items():
        if source != me:
            continue
        local = slice(rows.start - first, rows.stop - first)
        payload = pickle.dumps({"samples": samples[local], "scores": scores[local], "correct": correct[local],
                                "version": version, "timings": timings,
                                **({"indices": indices[local]} if indices is not None else {})})
        size = torch.tensor([len(payload)], dtype=torch.long)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        requests += [dist.isend(size, group=layout.world, group_dst=trainer, tag=0),
                     dist.isend(data, group=layout.world, group_dst=trainer, tag=1)]
    for request in requests:
        request.wait()


def receive_samples(layout: Layout, rows_per_step: int) -> list[dict]:
    """A trainer's side: one payload from each rollout rank that writes to it, in rollout-rank order (their rows
    are consecutive)."""
    me, payloads = dist.get_rank(), []
    for source, trainer in _correspondents(layout, rows_per_step):
        if trainer != me:
            continue
        sender = layout.trainer_ranks + source  # its rank in `world`
        size = torch.empty(1, dtype=torch.long)
        dist.recv(size, group=layout.world, group_src=sender, tag=0)
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(data, group=layout.world, group_src=sender, tag=1)
        payloads.append(pickle.loads(data.numpy().tobytes()))
    return payloads


def send_weights(layout: Layout, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Every trainer drains `weights` (the gather is their collective); rank 0 broadcasts them bucket by bucket. A
    tensor yielded again under another name (a tied embedding) travels once, named as an alias."""
    sender = dist.get_rank() == 0
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0

    def flush() -> None:
        nonlocal bucket, size
        if sender:
            header, tensors, seen = [], [], {}
            for name, tensor in bucket:
                if id(tensor) in seen:
                    header.append((name, seen[id(tensor)], None))
                else:
                    seen[id(tensor)] = name
                    header.append((name, None, tuple(tensor.shape)))
                    tensors.append(tensor.reshape(-1))
            flat = torch.cat(tensors)
            dist.broadcast_object_list([(header, str(flat.dtype).removeprefix("torch."))], group=layout.bridge,
                                       group_src=0)
            dist.broadcast(flat, group=layout.bridge, group_src=0)
        bucket, size = [], 0

    for name, tensor in weights:
        if size >= SYNC_BUCKET_BYTES and all(tensor is not held for _, held in bucket):  # aliases stay together
            flush()
        bucket.append((name, tensor))
        size += 0 if any(tensor is held for _, held in bucket[:-1]) else tensor.numel() * tensor.element_size()
    if bucket:
        flush()
    if sender:
        dist.broadcast_object_list([None], group=layout.bridge, group_src=0)


def receive_weights(layout: Layout, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """A rollout rank's side: (name, tensor) as the buckets arrive, for the engine's `update_weights`."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, group=layout.bridge, group_src=0)
        if box[0] is None:
            return
        header, dtype = box[0]
        flat = torch.empty(sum(math.prod(shape) for _, alias, shape in header if alias is None),
                           dtype=getattr(torch, dtype), device=device)
        dist.broadcast(flat, group=layout.bridge, group_src=0)
        offset, by_name = 0, {}
        for name, alias, shape in header:
            if alias is None:
                count = math.prod(shape)
                by_name[name] = flat[offset:offset + count].view(shape)
                offset += count
            yield name, by_name[alias or name]


def send_evaluation(layout: Layout, metrics: dict[str, float] | None) -> None:
    """Rollout rank 0's evaluation reaches every rank (the other rollout ranks pass None)."""
    dist.broadcast_object_list([metrics], group=layout.world, group_src=layout.trainer_ranks)


def receive_evaluation(layout: Layout) -> dict[str, float]:
    box = [None]
    dist.broadcast_object_list(box, group=layout.world, group_src=layout.trainer_ranks)
    return box[0]


class RemoteRollouts:
    """The trainers' rollouts in the split layout, with the methods and attributes of the colocated layout's
    `LocalRollouts` (common/llm/rollouts.py): each step's rows (this trainer's) and the evaluations arrive from the
    rollout ranks, sampled and scored; the weights go to them. `in_flight`: the batch a checkpoint saved (S = 1)."""

    model_runner = "remote"

    def __init__(self, run: LLMRun, in_flight: list[dict] | None, serves_adapters: bool = False) -> None:
        self.run, self.layout, self.in_flight = run, run.layout, in_flight
        self.rows_per_step = run.args.prompts_per_step * run.args.num_generations
        self.serves_adapters = serves_adapters  # the rollout ranks' engines take LoRA adapters alone
        self.wait_s = 0.0  # this step's seconds waiting for samples

    def _receive(self) -> list[dict]:
        started = time.time()
        payloads = receive_samples(self.layout, self.rows_per_step)
        self.wait_s += time.time() - started
        return payloads

    def rows(self, step: int) -> SampledRows:
        """Step `step`'s rows, one payload per rollout rank: received now (S = 0, or the first step of a fresh S = 1
        run), else the batch that arrived during the previous step or came with the checkpoint. A checkpoint older
        than `correct` has scores alone: a score of 1 is correct."""
        self.wait_s = 0.0
        payloads, self.in_flight = self.in_flight or self._receive(), None
        indices = [i for payload in payloads for i in payload["indices"]] if "indices" in payloads[0] else \
            rank_rows(self.run, step)[0]  # the rows of the step's own prompts, unless dynamic sampling refilled them
        judged = [pair for payload in payloads for pair in zip(payload["scores"], payload.get(
            "correct", [score >= 1 for score in payload["scores"]]))]
        timings = [payload["timings"] for payload in payloads]
        return SampledRows(indices, [sample for payload in payloads for sample in payload["samples"]], None, judged,
                           max(t["generate_s"] for t in timings), 0.0, None, payloads[0]["version"], timings)

    def receive_next(self, step: int) -> None:
        """After update `step`, before its weights go out: with S = 1, the batch of step + 1 (generated meanwhile)."""
        if self.layout.max_staleness and step < self.run.args.total_steps:
            self.in_flight = self._receive()

    def update_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        send_weights(self.layout, weights)

    update_adapter = update_weights  # the adapters travel as any weights do; the rollout ranks load them as adapters

    def evaluate(self) -> dict[str, float]:
        """Rollout rank 0's held-out evaluation of the weights last sent."""
        return receive_evaluation(self.layout)

    def step_metrics(self, rollout: Rollout, step: int) -> dict[str, float]:
        """The staleness of the step's rows, and the idle times: this trainer's wait for them (also in the step's
        timings), and the rollout ranks' mean wait for the trainers."""
        rollout.timings["trainer_wait_s"] = self.wait_s
        return {"perf/trainer_wait_s": self.wait_s, "perf/rollout_wait_s": sum(
            t["rollout_wait_s"] for t in rollout.rollout_timings) / len(rollout.rollout_timings),
            "rollout/weight_version": rollout.version, "rollout/staleness": step - 1 - rollout.version}

    def close(self) -> None:
        """The rollout ranks end on their own after the last evaluation."""
