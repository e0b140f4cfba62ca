"""Weak scaling of one synchronous RL step, predicted by a model (not measured): T(N) per phase and the efficiency
T(N0) / T(N) for N = 1 ... 1,024 GPUs, N0 = 1 and 8, for the design as built ("today") and with each fix on or off.

The layout is colocated: every rank generates with its own engine, then all ranks train in FSDP lock step, then the
weights sync into every engine. The per-GPU workload is fixed (weak scaling), so a perfect system keeps T(N) = T(1).
--one-step-off predicts the split layout instead (K GPUs generate, N - K train; below).

    python benchmarks/weak_scaling_sim.py                                  # H100 and H200 x both workloads
    python benchmarks/weak_scaling_sim.py --out benchmarks/results/weak_scaling        # + tables.md, CSV, PNG
    python benchmarks/weak_scaling_sim.py --constants benchmarks/scaling_constants/h200.json --lognormal 600 0.8 4096
    python benchmarks/weak_scaling_sim.py --num-minibatches 4 --num-iterations 2     # 8 optimizer steps a step
    python benchmarks/weak_scaling_sim.py --timings runs/<run>/timings.jsonl \\
        --constants benchmarks/scaling_constants/cpu_2core.json --machines 2          # predicted vs measured
    python benchmarks/weak_scaling_sim.py --one-step-off --constants benchmarks/scaling_constants/h100.json \\
        --out benchmarks/results/weak_scaling           # split layout: one_step_off.md and one_step_off.png

Inputs. Hardware constants come from a JSON file, one {"value": ..., "source": "..."} per constant (a datasheet, our
own measurement, or a stated assumption; an entry without a source is refused). Completion lengths are drawn per
step from a lognormal (median, sigma), rounded up to whole tokens and capped; every configuration sees the same draws,
numpy's generator seeded with (seed, N), averaged over --steps simulated steps. The model is Qwen2.5-7B (QWEN25_7B).

The model, per step (each phase waits for its slowest rank, as a synchronous design does):
- collective over g GPUs on n nodes, a ring priced as NCCL's tuning model prices one: a base latency + (g - n) hops
  x NVLink latency + (n - 1) hops x InfiniBand latency + B (g - 1) / g / bandwidth, B the gathered bytes, bandwidth
  per direction of the slowest link (NVLink inside a node of `gpus_per_node`, InfiniBand once the group spans
  nodes). An all-to-all costs the same with B = one rank's bytes; an all-reduce costs two.
- generation: decode step k of rank r costs max(W / HBM, n_live(k) x 2 P_m / F) + KV_live(k) / HBM: the bf16
  weights W = 2 P_m are read once per step, the KV cache (2 x layers x kv_heads x head_dim x 2 bytes per token) of
  every live sequence is read too; plus the prefill of the rank's prompts (2 P_m x tokens / F, each prompt once:
  prefix caching). The rank runs as many decode steps as its longest completion; the step waits for max over ranks.
- balance (fix "balance"): an all-gather of every completion's length, then the token data (12 bytes a token: id
  and engine logprob) moves point to point inside each node (`gpus_per_node` consecutive ranks, as
  common/llm/balancing.py groups them), after which every rank of a node holds about the node's mean (see
  balanced_rank_tokens; the nodes' totals stay apart). Priced as NCCL's ring inside the node; the script moves the
  rows over gloo (common/llm/balancing.py's exchange), through the CPUs.
- training: micro-batches; each costs max(the slowest rank's compute, FSDP's communication), the two overlapping as
  FSDP2 prefetches the next block's all-gather during this block's compute. Compute = (6 + 2 x forward-only passes)
  x P_m x tokens (padding included) / (F x train_efficiency). Communication per micro-batch, per FSDP unit (28
  blocks + the root): a bf16 all-gather in the forward, again in the backward (--reshard-after-forward, as the GPU
  commands run), one per forward-only pass, and a float32 reduce-scatter of the gradients, over the whole mesh
  (today) or inside the node (fix "hsdp", whose replicas then all-reduce the float32 gradient shards across nodes
  once per optimizer step, after its last micro-batch, as the scripts do with FSDP2's set_requires_all_reduce).
  Optimizer steps per training step: mu x k (--num-iterations mu passes over the batch, --num-minibatches k
  minibatches of consecutive whole groups, an optimizer step each; default 1 x 1), so mu x k all-reduces; the
  micro-batches are cut within each minibatch, every pass trains all of them, and with mu x k > 1 the first pass
  adds one forward-only pass (pi_old, as grpo_llm.py computes it once per batch). As built, each rank trains its own
  completions in micro-batches of 8 rows, padded to their longest row; with "balance" the rows are packed (no
  padding) into micro-batches of the same token budget (8 x (prompt + cap): what the built micro-batch must hold at
  worst), as many on every rank as the fullest rank needs.
- bookkeeping: 10 latency-bound collectives over the whole mesh (scores, counts, gradient norm, statistics), each a
  ring of N - 1 hops; 3 with the fix "fewer_collectives" (statistics reduced by name in one dict); every optimizer
  step past the first adds its gradient norm's. A ring throughout: NCCL may pick a tree (log2 N hops) for small
  all-reduces, so this errs on the slow side.
- weight sync: as built, one all-gather per state tensor (339) over the whole mesh, the bf16 bytes once; with the fix
  "bucketed_sync" one per 256 MiB bucket, however many tensors. Either gathers over the shard group: the whole mesh,
  or the node with "hsdp" (every node holds a full replica). Then the engine's reload: the bf16 bytes read and
  written once in HBM (2 W / HBM).
Not modelled: AdamW (28 bytes of HBM traffic per parameter of the shard, each optimizer step: about 50 ms at N = 1,
less when sharded), attention FLOPs (about +10% of the training compute at 16k tokens), recomputation under gradient
checkpointing (+1/3), vLLM's scheduler and preemption, the engine's sleep and wake, scoring, logging and evaluation
(a fixed cost per step, unknown on GPUs: it would raise every efficiency), memory (7B does not train on one GPU, and
64 sequences of 16k tokens need 66 GB of KV cache: N = 1 is the arithmetic reference), network contention,
stragglers other than length.

Split layout (--one-step-off; grpo_llm.py's --rollout-ranks K --max-staleness S, common/llm/layout.py). K of the N
GPUs only generate, an engine each holding bf16 weights and KV cache; the other N - K only train, with every fix on
(FSDP2 over the trainers, HSDP inside nodes, "balance" packing, bucketed gathers, 3 bookkeeping collectives). The
global batch stays colocated's, N x 64 completions: its prompts are dealt to the engines round robin (a prompt's
completions on one engine), so an engine decodes N / K times a colocated rank's sequences at once (the weight read
shared by more of them, the KV read grown), and the trainers share the rows as "balance" does, N / (N - K) times a
rank's tokens each. Per step:
- generation: as above, on the engines' lengths; the step waits for the slowest engine;
- transfer: the lengths' all-gather and the samples' all-to-all (12 bytes a token) over the whole job, B = the
  busiest rank's bytes (an engine sending, or a trainer receiving), priced as NCCL's (the script's gloo, through
  the CPUs, is slower);
- training, bookkeeping: as above over the N - K trainers (the 3 collectives over the whole job);
- sync_gather: the bucketed all-gather of the bf16 weights inside the trainers' shard group (their node);
- sync_broadcast: one trainer broadcasts W to the K engines, 256 MiB buckets, each a pipelined ring over K + 1 GPUs:
  its ring latency (K hops; past one node the engines fill whole nodes and the sender is on another) + the bytes once
  through the slowest link (W / bandwidth: every GPU receives all of W);
- sync_reload: every engine's 2 W / HBM, side by side.
Staleness 0 (synchronous): T = generation + transfer + training + bookkeeping + sync_gather + sync_broadcast
+ sync_reload. Staleness 1 (one-step-off: batch t + 1 generates, with the weights from before batch t's update, while
the trainers train on batch t): T = max(generation of batch t + 1, training + bookkeeping of batch t) + transfer +
sync_gather + sync_broadcast + sync_reload. What overlaps: the engines' decoding with the trainers' update and
bookkeeping, nothing else. What does not: the weights' gather, broadcast and reload (the next generation needs
them, and the script's trainers wait for the broadcast too, although it could run under the next update), and the
samples' transfer (the next update needs them). The steps pair generation of step t + 1 with training of step t,
the last with the first (the steady state of the pipeline); T is the mean over steps.
K: the allowed K nearest --rollout-fraction x N (default 0.25: the README of verl's recipe/one_step_off_policy runs
Qwen2.5-Math-7B on 16 GPUs, 4 generating and 12 training) and, per N and staleness, the allowed K of the lowest
mean step (the minimum over up to 127 candidates of 32 steps each: slightly optimistic). Allowed: whole nodes
(multiples of gpus_per_node) once N spans two nodes, so that the trainers hold whole nodes (at N = 16 K is then 8,
not 4); any 1 <= K < N inside one node. N = 1 cannot split: its split rows are colocated "all fixes"'. A split row's
efficiency is T_all fixes(N0) / T(N) against colocated "all fixes" (same fixes, same batch), N0 = 1 and 8, so above
1 where the split beats it; its tokens per GPU-second against "all fixes" at the same N is T_all fixes(N) / T(N).
Not modelled, besides the above: memory (each engine decodes all its sequences at once: no cap on running
sequences, no preemption; the tables give its KV cache at the peak, see kv_peak_bytes), what staleness does to
learning, partial rollouts, the script's header broadcast before each bucket.

Timings mode (--timings) predicts the mean step time of a run on the CPU test bed (fake engine: generation is a
sleep of tau0 per token of the longest completion) from its own `timings.jsonl` (one line per step from rank 0:
{"step", "ranks": [{"longest_completion", "padded_tokens", "micro_batches", ... measured seconds}, ...]}), using the
per-rank lengths and token counts only, never the measured seconds, and prints predicted against measured per phase.
Steps after the first are used (the first pays warm-up). The constants file (benchmarks/scaling_constants/
cpu_2core.json, calibrated from a 2-rank run) carries these keys, each {"value", "source"}:
    decode_step_s             tau0: seconds per token of a rank's longest completion (the fake engine's sleep)
    train_s_per_padded_token  trainer seconds per token of the rank's micro-batches, padding included
    train_s_per_micro_batch   trainer seconds per micro-batch (FSDP's collectives, optimizer share, launch)
    sync_s                    weight sync seconds per step (gather and reload)
    step_overhead_s           fixed seconds per step (scoring, the statistics' reduction; waiting for the slowest
                              generator is not in it: the generation phase's max over ranks is that wait)
    cores                     CPU cores per machine
Prediction: max_r tau0 x longest_r + contention x (max_r (padded_tokens_r x train_s_per_padded_token +
micro_batches_r x train_s_per_micro_batch) + sync_s + step_overhead_s), contention = max(1, ranks per machine / cores):
every phase but the sleep computes on the shared cores.
"""

import argparse
import csv
import json
import math
import shlex
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CONSTANTS_DIR = ROOT / "benchmarks" / "scaling_constants"
WORLD_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
FIXES = ("balance", "hsdp", "fewer_collectives", "bucketed_sync")
CONFIGS = {"today": frozenset(), **{f"+{fix}": frozenset({fix}) for fix in FIXES}, "all fixes": frozenset(FIXES)}
PHASES = ("generation", "balance", "training", "bookkeeping", "sync_gather", "sync_reload")
BOOKKEEPING_COLLECTIVES = {"today": 10, "fewer_collectives": 3}
SYNC_BUCKET_BYTES = 256 * 2**20  # common/llm/models.py's bucket
BALANCE_BYTES_PER_TOKEN = 12  # int64 token id + float32 engine logprob
SPLIT_BASE = "all fixes"  # the split layout trains with every fix, so its efficiency is against this colocated one
SPLIT_FIXES = CONFIGS[SPLIT_BASE]
SPLIT_PHASES = ("generation", "transfer", "training", "bookkeeping", "sync_gather", "sync_broadcast", "sync_reload")
STALENESS = (0, 1)  # synchronous; one-step-off


@dataclass(frozen=True)
class Model:
    parameters: float  # what FSDP gathers and reduces and the sync moves
    matmul_parameters: float  # all but the input embedding (a lookup): 2 FLOPs per token each, forward
    layers: int
    kv_heads: int
    head_dim: int
    state_tensors: int  # the built sync gathers each one by itself


# Hugging Face config of Qwen/Qwen2.5-7B: 28 layers, hidden 3584, MLP 18944, 28 query / 4 KV heads of 128, vocab
# 152,064, untied head; parameters computed from it (7.616e9; the model card says 7.61B); 28 x 12 + 3 state tensors.
QWEN25_7B = Model(parameters=7.62e9, matmul_parameters=7.07e9, layers=28, kv_heads=4, head_dim=128,
                  state_tensors=339)


@dataclass(frozen=True)
class Workload:
    name: str
    median: float  # completion length, tokens
    sigma: float  # of log(length)
    cap: int  # --max-completion-length
    prompts: int = 8  # per GPU
    generations: int = 8  # completions per prompt
    prompt_tokens: int = 200
    micro_batch_rows: int = 8  # the --micro-batch-size of benchmarks/README.md's GPU commands
    forward_passes: int = 0  # forward-only passes per micro-batch (GRPO at --beta 0: none; a reference adds one)
    num_minibatches: int = 1  # k: an optimizer step per minibatch (GRPO's and PPO's --num-minibatches)
    num_iterations: int = 1  # mu: passes over the batch (GRPO's --num-iterations, PPO's --ppo-epochs)

    def __post_init__(self) -> None:
        if self.num_minibatches < 1 or self.num_iterations < 1 or self.prompts % self.num_minibatches:
            raise ValueError(f"--num-minibatches {self.num_minibatches} must divide the {self.prompts} prompts per "
                             f"GPU (whole groups per minibatch, as grpo_llm.py asks) and --num-iterations "
                             f"{self.num_iterations} be positive")

    @property
    def completions(self) -> int:
        return self.prompts * self.generations

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per training step: one per minibatch, every pass."""
        return self.num_minibatches * self.num_iterations

    @property
    def no_grad_passes(self) -> int:
        """Forward-only passes per micro-batch and step: the reference's, plus pi_old's before the first of several
        optimizer steps (grpo_llm.py computes old_logprobs once per batch when mu x k > 1)."""
        return self.forward_passes + (self.optimizer_steps > 1)


WORKLOADS = {"short": Workload("short", 600, 0.8, 4096), "long_tail": Workload("long_tail", 2000, 0.7, 16384)}


def load_constants(path: Path) -> dict[str, float]:
    """{name: value} of a constants file whose every entry is {"value": ..., "source": "..."}."""
    entries = json.loads(Path(path).read_text())
    unsourced = [name for name, entry in entries.items() if not str(entry.get("source", "")).strip()]
    if unsourced:
        raise ValueError(f"{path}: every constant needs a source; these have none: {unsourced}")
    return {name: float(entry["value"]) for name, entry in entries.items()}


# ---------------------------------------------------------------- lengths
def draw_lengths(workload: Workload, ranks: int, steps: int, rng: np.random.Generator) -> np.ndarray:
    """[steps, ranks, completions] completion lengths in tokens: lognormal, rounded up, capped."""
    shape = (steps, ranks, workload.completions)
    lengths = np.ceil(rng.lognormal(math.log(workload.median), workload.sigma, shape))
    return np.minimum(lengths, workload.cap)


def expected_longest(median: float, sigma: float, n: int) -> float:
    """E[max of n iid lognormal(log median, sigma)], uncapped: the quantile at Hazen's plotting position (n - 1/2) / n.
    Against numerical integration it is within 3% for sigma <= 0.8 when n >= 64 and for sigma <= 0.7 when n >= 8.
    Blom's (n - 3/8) / (n + 1/4), right for the maximum of normals, is 4-11% low here: E[exp(M)] > exp(E[M])."""
    return median * math.exp(sigma * statistics.NormalDist().inv_cdf((n - 0.5) / n))


# ---------------------------------------------------------------- collectives
def nodes_spanned(constants: dict[str, float], ranks: int) -> int:
    """Nodes under a group of `ranks` consecutive GPUs."""
    return math.ceil(ranks / constants["gpus_per_node"])


def collective_s(gathered_bytes: float, ranks: int, nodes: int, constants: dict[str, float], count: int = 1) -> float:
    """`count` ring all-gathers (or reduce-scatters) over `ranks` GPUs on `nodes` nodes moving `gathered_bytes` in
    all, priced as NCCL's tuning model prices a ring: a base latency, (ranks - nodes) steps inside nodes and
    (nodes - 1) across them, and each GPU's share of the bytes through the slowest link."""
    if ranks == 1:
        return 0.0
    return count * ring_latency_s(ranks, nodes, constants) + gathered_bytes * (ranks - 1) / ranks / link_bandwidth(
        nodes, constants)


def ring_latency_s(ranks: int, nodes: int, constants: dict[str, float]) -> float:
    """Latency of one collective over a ring of `ranks` GPUs on `nodes` nodes: base + each hop's."""
    return (constants["collective_base_latency"] + (ranks - nodes) * constants["nvlink_latency"]
            + (nodes - 1) * constants["ib_latency"])


def link_bandwidth(nodes: int, constants: dict[str, float]) -> float:
    """Bytes per second per direction of a group's slowest link: InfiniBand once the group spans nodes."""
    return constants["ib_bandwidth"] if nodes > 1 else constants["nvlink_bandwidth"]


def shard_group(constants: dict[str, float], ranks: int, fixes: frozenset[str]) -> int:
    """GPUs a parameter is sharded over: the whole mesh, or the node with HSDP."""
    return min(ranks, int(constants["gpus_per_node"])) if "hsdp" in fixes else ranks


# ---------------------------------------------------------------- phases
def generation_s(lengths: np.ndarray, workload: Workload, model: Model, constants: dict[str, float]) -> np.ndarray:
    """[steps, ranks] seconds of each rank's rollout: prefill, then one decode step per token of its longest."""
    hbm, flops = constants["hbm_bandwidth"], constants["matmul_flops"]
    weight_read = 2 * model.matmul_parameters / hbm
    per_sequence = 2 * model.matmul_parameters / flops
    longest_first = -np.sort(-lengths, axis=-1)
    # between the j-th and the (j+1)-th longest completion, j sequences are live
    shorter = np.concatenate([longest_first[..., 1:], np.zeros_like(longest_first[..., :1])], axis=-1)
    live = np.arange(1, lengths.shape[-1] + 1)
    decode = ((longest_first - shorter) * np.maximum(weight_read, live * per_sequence)).sum(-1)
    # sequence of length L reads sum over k = 1..L of (prompt + k) cached tokens
    cached_tokens = (workload.prompt_tokens * lengths + lengths * (lengths + 1) / 2).sum(-1)
    # a 0 is a slot left empty (an engine of the split layout dealt one prompt fewer): no prompt to prefill
    prompts = (lengths > 0).sum(-1) / workload.generations
    prefill = 2 * model.matmul_parameters * prompts * workload.prompt_tokens / flops
    return prefill + decode + cached_tokens * kv_bytes_per_token(model) / hbm


def kv_bytes_per_token(model: Model) -> int:
    """Bytes of KV cache a token holds: keys and values, every layer, bf16."""
    return 2 * model.layers * model.kv_heads * model.head_dim * 2


def padded_micro_batches(lengths: np.ndarray, workload: Workload) -> list[np.ndarray]:
    """Today, per step: each micro-batch's tokens on its slowest rank, rows padded to the longest in the batch. Each
    of the num_minibatches minibatches (consecutive rows) is cut into micro-batches of its own, as grpo_llm.py cuts
    them."""
    rows, completions = workload.micro_batch_rows, lengths.shape[-1]
    per_minibatch = completions // workload.num_minibatches
    slices = [slice(start, min(start + rows, first + per_minibatch))
              for first in range(0, completions, per_minibatch) for start in range(first, first + per_minibatch, rows)]
    padded = [lengths[..., rows_slice].shape[-1] * (workload.prompt_tokens + lengths[..., rows_slice].max(-1))
              for rows_slice in slices]
    return list(np.stack(padded, axis=-1).max(axis=1))  # [steps] of [micro-batches], max over ranks


def balanced_rank_tokens(lengths: np.ndarray, prompt_tokens: int, group: int, ranks: int | None = None
                         ) -> np.ndarray:
    """[steps, ranks] tokens per rank once the step's completions are redistributed: each round hands the next
    longest rows to the ranks in order of load, lightest first (greedy longest-first, as the fix's partition,
    common/llm/balancing.py's balanced_partition; at 64 rows per rank it leaves every rank within 1% of the mean),
    within each group of `group` consecutive ranks (a node's), as the script balances (its groups' totals stay
    apart).
    `ranks`: those that share the rows, by default the ranks that generated them (the split layout's trainers, who
    receive the rows of all rollout ranks: balanced as one group there)."""
    steps = lengths.shape[0]
    if ranks is not None and ranks != lengths.shape[1]:
        return _greedy_loads(lengths.reshape(steps, -1) + prompt_tokens, ranks)
    per_rank = (lengths + prompt_tokens).reshape(steps, lengths.shape[1], -1)
    return np.concatenate([_greedy_loads(per_rank[:, first:first + group].reshape(steps, -1),
                                         min(group, lengths.shape[1] - first))
                           for first in range(0, lengths.shape[1], group)], axis=1)


def _greedy_loads(row_tokens: np.ndarray, ranks: int) -> np.ndarray:
    rows = -np.sort(-row_tokens, axis=1)
    steps = rows.shape[0]
    loads = np.zeros((steps, ranks))
    step_index = np.arange(steps)[:, None]
    for start in range(0, rows.shape[1], ranks):
        chunk = rows[:, start:start + ranks]
        lightest = np.argsort(loads, axis=1, kind="stable")[:, :chunk.shape[1]]
        loads[step_index, lightest] += chunk
    return loads


def packed_micro_batches(lengths: np.ndarray, workload: Workload, group: int, ranks: int | None = None
                         ) -> list[np.ndarray]:
    """With "balance", per step: each micro-batch's tokens on its slowest rank, rows packed to the token budget;
    `group` and `ranks` as in balanced_rank_tokens. With k minibatches each packs its 1 / k of the fullest rank's
    tokens into micro-batches of its own (grpo_llm.py refuses --balance-tokens with --num-minibatches > 1: a
    stand-in for balancing each minibatch by itself)."""
    budget = workload.micro_batch_rows * (workload.prompt_tokens + workload.cap)
    fullest = balanced_rank_tokens(lengths, workload.prompt_tokens, group, ranks).max(axis=1)
    minibatches = workload.num_minibatches
    return [np.full(minibatches * math.ceil(tokens / minibatches / budget),
                    tokens / minibatches / math.ceil(tokens / minibatches / budget)) for tokens in fullest]


def fsdp_comm_s(model: Model, constants: dict[str, float], ranks: int, fixes: frozenset[str], forward_passes: int
                ) -> tuple[float, float]:
    """(per micro-batch, per optimizer step) seconds of FSDP's collectives. Per micro-batch, over the shard group:
    every FSDP unit's bf16 all-gathers (forward, backward again, `forward_passes` forward-only passes) and float32
    gradient reduce-scatter. Per optimizer step, with HSDP: the replicas' all-reduce of the float32 gradient shards
    across nodes, once, after the step's last micro-batch (the scripts skip it before: common/llm/models.py's
    all_reduce_at_last; FSDP2 alone would all-reduce after every micro-batch's backward)."""
    group = shard_group(constants, ranks, fixes)
    group_nodes, units = nodes_spanned(constants, group), model.layers + 1
    all_gathers = 2 + forward_passes  # forward, backward again, forward-only passes
    per_micro_batch = (all_gathers * collective_s(2 * model.parameters, group, group_nodes, constants, units)
                       + collective_s(4 * model.parameters, group, group_nodes, constants, units))
    replicas = math.ceil(ranks / group)  # with HSDP one GPU per node in each replica group; without, 1
    per_optimizer_step = 2 * collective_s(4 * model.parameters / group, replicas, replicas, constants, units)
    return per_micro_batch, per_optimizer_step


def training_s(micro_batches: list[np.ndarray], workload: Workload, model: Model, constants: dict[str, float],
               ranks: int, fixes: frozenset[str], overlap: bool = True) -> np.ndarray:
    """[steps] seconds of each step's update: num_iterations passes over the step's micro-batches (all minibatches')
    in lock step, the first with the forward-only passes, and the replicas' all-reduce once per optimizer step,
    num_iterations x num_minibatches of them. `overlap`: FSDP's communication hides under the compute (max of the
    two); otherwise they add."""
    flops = constants["matmul_flops"] * constants["train_efficiency"]
    no_grad = workload.no_grad_passes
    first_pass = fsdp_comm_s(model, constants, ranks, fixes, no_grad)[0]
    again, per_optimizer_step = fsdp_comm_s(model, constants, ranks, fixes, 0)
    combine = np.maximum if overlap else np.add
    lock_step = [combine(tokens * (6 + 2 * no_grad) * model.matmul_parameters / flops, first_pass).sum()
                 + (workload.num_iterations - 1) * combine(tokens * 6 * model.matmul_parameters / flops, again).sum()
                 for tokens in micro_batches]
    return np.array(lock_step) + workload.optimizer_steps * per_optimizer_step


def balance_s(ranks: int, workload: Workload, mean_rank_tokens: float, constants: dict[str, float]) -> float:
    """The lengths' all-gather over every rank, then the rows' point-to-point exchange inside a node (its
    `gpus_per_node` ranks): at most a rank's B bytes out and in, through the node's links, priced as a ring
    all-to-all of that group (B (g - 1) / g through each link)."""
    lengths_gather = collective_s(8 * ranks * workload.completions, ranks, nodes_spanned(constants, ranks), constants)
    group = min(ranks, int(constants["gpus_per_node"]))
    rows_exchange = collective_s(BALANCE_BYTES_PER_TOKEN * mean_rank_tokens, group, nodes_spanned(constants, group),
                                 constants)
    return lengths_gather + rows_exchange


def bookkeeping_s(ranks: int, constants: dict[str, float], fixes: frozenset[str], optimizer_steps: int = 1
                  ) -> float:
    """The step's latency-bound collectives; one of them is the gradient norm, so every optimizer step past the first
    adds one."""
    count = BOOKKEEPING_COLLECTIVES["fewer_collectives" if "fewer_collectives" in fixes else "today"]
    return collective_s(0.0, ranks, nodes_spanned(constants, ranks), constants, count + optimizer_steps - 1)


def weight_sync_s(model: Model, constants: dict[str, float], ranks: int, fixes: frozenset[str]) -> tuple[float, float]:
    """(gather, reload) seconds of streaming the bf16 weights into the engine."""
    weight_bytes = 2 * model.parameters
    collectives = math.ceil(weight_bytes / SYNC_BUCKET_BYTES) if "bucketed_sync" in fixes else model.state_tensors
    group = shard_group(constants, ranks, fixes)
    gather = collective_s(weight_bytes, group, nodes_spanned(constants, group), constants, collectives)
    return gather, 2 * weight_bytes / constants["hbm_bandwidth"]


def simulate(constants: dict[str, float], workload: Workload, model: Model = QWEN25_7B,
             world_sizes: tuple[int, ...] = WORLD_SIZES, steps: int = 32, seed: int = 1, overlap: bool = True
             ) -> dict[str, dict[int, dict[str, float]]]:
    """{configuration: {N: {phase: mean seconds, "step": their sum, "longest": mean longest completion}}}."""
    results: dict[str, dict[int, dict[str, float]]] = {config: {} for config in CONFIGS}
    for ranks in world_sizes:
        lengths = draw_lengths(workload, ranks, steps, np.random.default_rng([seed, ranks]))
        generation = float(generation_s(lengths, workload, model, constants).max(axis=1).mean())
        micro_batches = {False: padded_micro_batches(lengths, workload),
                         True: packed_micro_batches(lengths, workload, int(constants["gpus_per_node"]))}
        mean_rank_tokens = float((lengths + workload.prompt_tokens).sum(-1).mean())
        for config, fixes in CONFIGS.items():
            gather, reload = weight_sync_s(model, constants, ranks, fixes)
            phases = {"generation": generation,
                      "balance": balance_s(ranks, workload, mean_rank_tokens, constants) if "balance" in fixes else 0.0,
                      "training": float(training_s(micro_batches["balance" in fixes], workload, model, constants,
                                                   ranks, fixes, overlap).mean()),
                      "bookkeeping": bookkeeping_s(ranks, constants, fixes, workload.optimizer_steps),
                      "sync_gather": gather, "sync_reload": reload}
            results[config][ranks] = {**phases, "step": sum(phases.values()),
                                      "longest": float(lengths.max(axis=(1, 2)).mean())}
    return results


def efficiency(per_size: dict[int, dict[str, float]], base: int,
               reference: dict[int, dict[str, float]] | None = None) -> dict[int, float]:
    """T(base) / T(N) for N >= base (weak scaling); T(base) the configuration's own unless `reference` is given."""
    reference = per_size if reference is None else reference
    return {n: reference[base]["step"] / row["step"] for n, row in per_size.items() if n >= base and base in reference}


def efficiencies(results: dict[str, dict[int, dict[str, float]]], base: int) -> dict[str, dict[int, float]]:
    """Every configuration's efficiency from `base`: a colocated one against its own T(base), a split one against
    the colocated "all fixes" (the same fixes, one layout)."""
    return {config: efficiency(per_size, base, None if config in CONFIGS else results[SPLIT_BASE])
            for config, per_size in results.items()}


# ---------------------------------------------------------------- split layout (--one-step-off)
def rollout_engine_lengths(lengths: np.ndarray, workload: Workload, engines: int) -> np.ndarray:
    """[steps, engines, completions] the step's whole batch dealt to `engines` engines prompt by prompt, round robin
    (a prompt's completions stay on one engine); an engine dealt one prompt fewer ends in 0s (empty slots)."""
    steps, generations = lengths.shape[0], workload.generations
    groups = lengths.reshape(steps, -1, generations)
    rounds = math.ceil(groups.shape[1] / engines)
    dealt = np.zeros((steps, rounds * engines, generations))
    dealt[:, :groups.shape[1]] = groups
    return dealt.reshape(steps, rounds, engines, generations).transpose(0, 2, 1, 3).reshape(steps, engines, -1)


def kv_peak_bytes(lengths: np.ndarray, workload: Workload, model: Model) -> np.ndarray:
    """[steps, ranks] bytes of KV cache at its fullest while a rank decodes its completions, all at once: just before
    the j-th longest finishes, j sequences hold prompt + that many tokens. Prompts counted once per sequence (prefix
    caching would share them within a prompt's group: high by at most prompt / (prompt + completion))."""
    longest_first = -np.sort(-lengths, axis=-1)
    live = np.arange(1, lengths.shape[-1] + 1)
    held = np.where(longest_first > 0, live * (workload.prompt_tokens + longest_first), 0.0)
    return held.max(-1) * kv_bytes_per_token(model)


def weight_broadcast_s(model: Model, constants: dict[str, float], ranks: int, rollout_ranks: int) -> float:
    """Seconds of one trainer broadcasting the bf16 weights to the `rollout_ranks` engines in 256 MiB buckets, each a
    pipelined ring over rollout_ranks + 1 GPUs: its ring latency, and the bytes once through the slowest link (every
    GPU receives all of them: W / bandwidth, not an all-gather's W (g - 1) / g)."""
    weight_bytes = 2 * model.parameters
    # past one node the engines fill whole nodes and the sending trainer is on another
    nodes = 1 if ranks <= constants["gpus_per_node"] else nodes_spanned(constants, rollout_ranks) + 1
    buckets = math.ceil(weight_bytes / SYNC_BUCKET_BYTES)
    return (buckets * ring_latency_s(rollout_ranks + 1, nodes, constants)
            + weight_bytes / link_bandwidth(nodes, constants))


def split_phases(lengths: np.ndarray, workload: Workload, model: Model, constants: dict[str, float],
                 rollout_ranks: int, overlap: bool = True) -> dict[str, np.ndarray]:
    """{phase: [steps] seconds} of the split layout: `rollout_ranks` of the lengths' ranks generate the whole batch,
    the others train it with every colocated fix on."""
    steps, ranks = lengths.shape[:2]
    trainers = ranks - rollout_ranks
    engines = rollout_engine_lengths(lengths, workload, rollout_ranks)
    rank_tokens = float((lengths + workload.prompt_tokens).sum(-1).mean())
    # the all-to-all waits for the busiest rank: an engine sending, or a trainer receiving
    busiest_tokens = max(ranks / rollout_ranks, ranks / trainers) * rank_tokens
    gather, reload = weight_sync_s(model, constants, trainers, SPLIT_FIXES)
    per_step = {"transfer": balance_s(ranks, workload, busiest_tokens, constants),
                "bookkeeping": bookkeeping_s(ranks, constants, SPLIT_FIXES, workload.optimizer_steps),
                "sync_gather": gather, "sync_broadcast": weight_broadcast_s(model, constants, ranks, rollout_ranks),
                "sync_reload": reload}
    return {"generation": generation_s(engines, workload, model, constants).max(axis=1),
            "training": training_s(packed_micro_batches(lengths, workload, int(constants["gpus_per_node"]), trainers),
                                   workload, model, constants, trainers, SPLIT_FIXES, overlap),
            **{phase: np.full(steps, seconds) for phase, seconds in per_step.items()}}


def split_step_s(phases: dict[str, np.ndarray], staleness: int) -> np.ndarray:
    """[steps] seconds of a split step. Staleness 0: every phase in turn. Staleness 1: batch t + 1 generates while
    batch t trains (steps wrap around: the steady state); the weights' gather, broadcast and reload and the samples'
    transfer stay on the critical path."""
    serial = phases["transfer"] + phases["sync_gather"] + phases["sync_broadcast"] + phases["sync_reload"]
    trainer = phases["training"] + phases["bookkeeping"]
    if staleness == 0:
        return phases["generation"] + trainer + serial
    if staleness == 1:
        return np.maximum(np.roll(phases["generation"], -1), trainer) + serial
    raise ValueError(f"staleness {staleness}: the model has 0 (synchronous) and 1 (one-step-off)")


def rollout_rank_choices(ranks: int, constants: dict[str, float]) -> list[int]:
    """The K tried: whole nodes once the job spans two or more, any split of the GPUs inside one."""
    per_node = int(constants["gpus_per_node"])
    return list(range(per_node, ranks, per_node)) if ranks >= 2 * per_node else list(range(1, ranks))


def split_config(staleness: int, fraction: float | None) -> str:
    """A split configuration's name: K a fraction of N, or (None) the best K."""
    return f"split S={staleness}, " + ("best K" if fraction is None else f"K = {fraction:g} N")


def simulate_split(constants: dict[str, float], workload: Workload, model: Model = QWEN25_7B,
                   world_sizes: tuple[int, ...] = WORLD_SIZES, steps: int = 32, seed: int = 1, fraction: float = 0.25,
                   overlap: bool = True) -> dict[str, dict[int, dict[str, float]]]:
    """{configuration: {N: row}}: colocated "today" and "all fixes" (as simulate), then the split layout at staleness 0
    and 1, with K the allowed value nearest fraction x N and with the K of the lowest mean step. A split row holds its
    SPLIT_PHASES' means, "step", "rollout_ranks" (K), "longest" and "kv_peak" (the fullest engine's bytes, mean over
    steps). N = 1 cannot split: its split rows are colocated "all fixes"' (K = 0)."""
    colocated = simulate(constants, workload, model, world_sizes, steps, seed, overlap)
    results = {config: colocated[config] for config in ("today", SPLIT_BASE)}
    for staleness in STALENESS:
        results |= {split_config(staleness, fraction): {}, split_config(staleness, None): {}}
    for ranks in world_sizes:
        lengths = draw_lengths(workload, ranks, steps, np.random.default_rng([seed, ranks]))
        longest = float(lengths.max(axis=(1, 2)).mean())
        if ranks == 1:
            row = colocated[SPLIT_BASE][1]
            unsplit = {**{phase: row[phase] for phase in SPLIT_PHASES if phase in row}, "transfer": row["balance"],
                       "sync_broadcast": 0.0, "step": row["step"], "rollout_ranks": 0, "longest": longest,
                       "kv_peak": float(kv_peak_bytes(lengths, workload, model).mean())}
            for config in results:
                if config not in CONFIGS:
                    results[config][1] = unsplit
            continue
        candidates = {k: split_phases(lengths, workload, model, constants, k, overlap)
                      for k in rollout_rank_choices(ranks, constants)}
        nearest = min(candidates, key=lambda k: abs(k - fraction * ranks))
        for staleness in STALENESS:
            step_s = {k: float(split_step_s(phases, staleness).mean()) for k, phases in candidates.items()}
            for config, k in ((split_config(staleness, fraction), nearest),
                              (split_config(staleness, None), min(step_s, key=step_s.get))):
                engines = rollout_engine_lengths(lengths, workload, k)
                results[config][ranks] = {
                    **{phase: float(seconds.mean()) for phase, seconds in candidates[k].items()}, "step": step_s[k],
                    "rollout_ranks": k, "longest": longest,
                    "kv_peak": float(kv_peak_bytes(engines, workload, model).max(axis=1).mean())}
    return results


# ---------------------------------------------------------------- timings mode (CPU test bed, fake engine)
def read_timings(path: Path) -> list[dict]:
    """The records of timings.jsonl after the first step (which pays one-off warm-up)."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    first = min(record["step"] for record in records)
    return [record for record in records if record["step"] > first]


def predict_record(record: dict, constants: dict[str, float], machines: int = 1) -> dict[str, float]:
    """Predicted seconds per phase of one step from its per-rank lengths and token counts (see the docstring)."""
    ranks = record["ranks"]
    contention = max(1.0, math.ceil(len(ranks) / machines) / constants["cores"])
    train = max(rank["padded_tokens"] * constants["train_s_per_padded_token"]
                + rank["micro_batches"] * constants["train_s_per_micro_batch"] for rank in ranks)
    phases = {"generate": constants["decode_step_s"] * max(rank["longest_completion"] for rank in ranks),
              "train": contention * train, "sync": contention * constants["sync_s"],
              "other": contention * constants["step_overhead_s"]}
    return {**phases, "step": sum(phases.values())}


def measured_record(record: dict) -> dict[str, float]:
    """The same phases as measured (slowest rank; the step as rank 0 logged it)."""
    ranks = record["ranks"]
    return {"generate": max(rank["generate_s"] for rank in ranks), "train": max(rank["train_s"] for rank in ranks),
            "sync": max(rank["sync_gather_s"] + rank["sync_reload_s"] for rank in ranks),
            "other": max(rank["score_s"] + rank["reduce_s"] for rank in ranks),
            "step": ranks[0]["step_s"]}


def predict_mean_step_s(records: list[dict], constants: dict[str, float], machines: int = 1) -> float:
    """Predicted mean step time over `records` (parsed timings.jsonl lines)."""
    return statistics.mean(predict_record(record, constants, machines)["step"] for record in records)


def timings_report(records: list[dict], constants: dict[str, float], machines: int) -> str:
    predicted = [predict_record(record, constants, machines) for record in records]
    measured = [measured_record(record) for record in records]
    lines = [f"{len(records)} steps, {len(records[0]['ranks'])} ranks on {machines} machine(s)", "",
             "| phase | predicted s | measured s | predicted / measured |", "|---|---|---|---|"]
    for phase in predicted[0]:
        guess = statistics.mean(p[phase] for p in predicted)
        seen = statistics.mean(m[phase] for m in measured)
        lines.append(f"| {phase} | {guess:.4f} | {seen:.4f} | {guess / seen if seen else float('nan'):.3f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- tables, CSV, plot
def efficiency_table(results: dict[str, dict[int, dict[str, float]]], base: int) -> str:
    sizes = [n for n in next(iter(results.values())) if n >= base]
    lines = [f"| efficiency from {base} | " + " | ".join(map(str, sizes)) + " |", "|---" * (len(sizes) + 1) + "|"]
    for config, scaled in efficiencies(results, base).items():
        lines.append(f"| {config} | " + " | ".join(f"{scaled[n]:.2f}" for n in sizes) + " |")
    return "\n".join(lines)


def phase_table(per_size: dict[int, dict[str, float]]) -> str:
    """Seconds per phase against N, the efficiencies, and the tail: mean longest completion of the step."""
    from_1, from_8 = efficiency(per_size, 1), efficiency(per_size, 8)
    lines = ["| N | " + " | ".join(PHASES) + " | step | eff. from 1 | eff. from 8 | longest completion |",
             "|---" * (len(PHASES) + 5) + "|"]
    for n, row in per_size.items():
        cells = [f"{row[phase]:.3f}" for phase in (*PHASES, "step")]
        cells += [f"{from_1[n]:.2f}" if n in from_1 else "", f"{from_8[n]:.2f}" if n in from_8 else "",
                  f"{row['longest']:.0f}"]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def workload_title(hardware: str, workload: Workload) -> str:
    return (f"## {hardware}, workload {workload.name} (lognormal median {workload.median:g}, sigma "
            f"{workload.sigma:g}, cap {workload.cap:,}; {workload.prompts} x {workload.generations} completions of "
            f"{workload.prompt_tokens}-token prompts per GPU)")


def report(hardware: str, workload: Workload, results: dict[str, dict[int, dict[str, float]]]) -> str:
    title = workload_title(hardware, workload)
    ranks = sorted(next(iter(results.values())))
    tail = ", ".join(f"N = {n}: {expected_longest(workload.median, workload.sigma, n * workload.completions):,.0f}"
                     for n in (ranks[0], ranks[-1]))
    parts = [title, "Model prediction, not a measurement. Seconds per step.", efficiency_table(results, 1),
             efficiency_table(results, 8),
             f"Expected longest of the step's N x {workload.completions} completions without the cap (Hazen): {tail}."]
    parts += [f"### {config}\n\n" + phase_table(per_size) for config, per_size in results.items()]
    return "\n\n".join(parts)


def split_choice_table(results: dict[str, dict[int, dict[str, float]]]) -> str:
    """Per N, each split configuration's K, then its tokens per GPU-second against colocated "all fixes" at the same
    N (the same tokens on the same GPUs: T_all fixes(N) / T(N))."""
    split = [config for config in results if config not in CONFIGS]
    sizes = list(results[SPLIT_BASE])
    lines = ["| N | " + " | ".join(map(str, sizes)) + " |", "|---" * (len(sizes) + 1) + "|"]
    for config in split:
        chosen = (results[config][n]["rollout_ranks"] for n in sizes)
        lines.append(f"| K, {config} | " + " | ".join(str(k) if k else "-" for k in chosen) + " |")
    for config in split:
        ratios = (results[SPLIT_BASE][n]["step"] / results[config][n]["step"] for n in sizes)
        lines.append(f"| throughput / all fixes', {config} | " + " | ".join(f"{ratio:.2f}" for ratio in ratios) + " |")
    return "\n".join(lines)


def split_phase_table(results: dict[str, dict[int, dict[str, float]]], config: str) -> str:
    """A split configuration's seconds per phase against N (means over steps; at staleness 1 the step is not their
    sum), its K, efficiencies, throughput against "all fixes" and the fullest engine's KV cache at its peak."""
    per_size, base = results[config], results[SPLIT_BASE]
    from_1, from_8 = efficiency(per_size, 1, base), efficiency(per_size, 8, base)
    lines = ["| N | K | " + " | ".join(SPLIT_PHASES) + " | step | eff. from 1 | eff. from 8 | throughput / all fixes' "
             "| KV peak per engine (GB) | longest completion |", "|---" * (len(SPLIT_PHASES) + 8) + "|"]
    for n, row in per_size.items():
        cells = [str(row["rollout_ranks"] or "-"), *(f"{row[phase]:.3f}" for phase in (*SPLIT_PHASES, "step"))]
        cells += [f"{from_1[n]:.2f}" if n in from_1 else "", f"{from_8[n]:.2f}" if n in from_8 else "",
                  f"{base[n]['step'] / row['step']:.2f}", f"{row['kv_peak'] / 1e9:.0f}", f"{row['longest']:.0f}"]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def split_report(hardware: str, workload: Workload, results: dict[str, dict[int, dict[str, float]]]) -> str:
    parts = [workload_title(hardware, workload),
             "Model prediction, not a measurement. Colocated rows against their own T(N0); split rows against "
             "colocated all fixes' T(N0).", efficiency_table(results, 1), efficiency_table(results, 8),
             split_choice_table(results)]
    parts += [f"### {config}\n\n" + split_phase_table(results, config) for config in results if config not in CONFIGS]
    return "\n\n".join(parts)


def split_header(command: str, constants_paths: list[Path], fraction: float) -> str:
    """one_step_off.md's opening: what the page is, the command that made it, the layout, and the constants."""
    lines = ["# One-step-off split layout, Qwen2.5-7B: a model prediction", "",
             "**Everything on this page is a model prediction, not a measurement**, made by "
             "`benchmarks/weak_scaling_sim.py` (its docstring has the formulas and what is not modelled):", "",
             f"    {command}", "",
             "K of the N GPUs only generate (an engine each: bf16 weights and KV cache), the other N - K only train "
             "(FSDP2, HSDP inside nodes, balance packing, bucketed sync, 3 bookkeeping collectives: colocated all "
             "fixes' training). The global batch is colocated's (64 completions x N): each engine decodes N / K "
             "times a colocated rank's completions at once, each trainer trains N / (N - K) times its tokens. "
             "Staleness 0 (S=0): generation, transfer, training, bookkeeping, the weights' gather, broadcast and "
             "reload in turn. Staleness 1 (S=1, one-step-off): batch t + 1 generates while batch t trains; the "
             "weights' gather, broadcast and reload and the samples' transfer do not overlap.", "",
             f"K: \"K = {fraction:g} N\" is the allowed K nearest {fraction:g} N (verl's one-step-off recipe: 4 of "
             "16 GPUs generate); allowed are whole nodes once N spans two (so at N = 16 K is 8, not 4), any "
             "1 <= K < N inside one node. \"best K\": the allowed K of the lowest mean step, per N and staleness. "
             "N = 1 cannot split: the split rows' N = 1 is colocated all fixes.", "",
             "Efficiency: today and all fixes against their own T(N0), as in tables.md; the split rows against "
             "colocated all fixes' T(N0), N0 = 1 and 8, so a split row and the all-fixes row compare directly. "
             "\"throughput / all fixes'\": tokens per GPU-second against colocated all fixes at the same N, "
             "T_all fixes(N) / T(N).", "",
             "Memory is not modelled: every engine decodes all its sequences at once (no cap on running sequences, "
             "no preemption). \"KV peak per engine\" is the cache that would need (prompts counted per sequence); "
             "an H100 has 80 GB, 15 GB of it an engine's weights.", "",
             "The curves (with --out): [one_step_off.png](one_step_off.png).", ""]
    for path in constants_paths:
        entries = json.loads(Path(path).read_text())
        lines += [f"Constants, `{path}`:", "",
                  "| constant | value | source |", "|---|---|---|"]
        lines += [f"| {name} | {entry['value']:g} | {entry['source']} |" for name, entry in entries.items()]
        lines.append("")
    return "\n".join(lines)


def write_csv(path: Path, rows: list[tuple[str, str, dict[str, dict[int, dict[str, float]]]]]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["hardware", "workload", "config", "N", *PHASES, "step_s", "efficiency_from_1",
                         "efficiency_from_8", "longest_completion"])
        for hardware, workload_name, results in rows:
            for config, per_size in results.items():
                from_1, from_8 = efficiency(per_size, 1), efficiency(per_size, 8)
                for n, row in per_size.items():
                    writer.writerow([hardware, workload_name, config, n, *(f"{row[p]:.6f}" for p in PHASES),
                                     f"{row['step']:.6f}", f"{from_1.get(n, float('nan')):.4f}",
                                     f"{from_8.get(n, float('nan')):.4f}", f"{row['longest']:.1f}"])


def plot(path: Path, rows: list[tuple[str, str, dict[str, dict[int, dict[str, float]]]]],
         title: str = "Weak scaling of one GRPO step, Qwen2.5-7B") -> bool:
    """Efficiency from 1 GPU (top) and from 8 (bottom) against N, one column per (hardware, workload); False when
    matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(2, len(rows), figsize=(4.2 * len(rows), 7), sharex=True, sharey=True, squeeze=False)
    styles = ["-", "--", ":", "-.", (0, (5, 1)), "-"]  # several configurations coincide: keep each one visible
    for column, (hardware, workload_name, results) in enumerate(rows):
        for row, base in enumerate((1, 8)):
            axis = axes[row][column]
            for style, (config, scaled) in zip(styles, efficiencies(results, base).items()):
                axis.plot(list(scaled), list(scaled.values()), linestyle=style, marker="o", markersize=3, label=config)
            axis.set_xscale("log", base=2)
            axis.set_title(f"{hardware}, {workload_name}: from {base} GPU{'s' if base > 1 else ''}", fontsize=10)
            axis.set_xlabel("GPUs")
            axis.grid(alpha=0.3)
    for row, base in enumerate((1, 8)):
        axes[row][0].set_ylabel(f"predicted T({base}) / T(N)")
    axes[0][-1].legend(fontsize=8)
    figure.suptitle(f"{title}: model prediction, not a measurement", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--constants", type=Path, nargs="+",
                        help="constants files, one hardware each (default: h100.json and h200.json in "
                             "benchmarks/scaling_constants); with --timings, the CPU test bed's")
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=["short", "long_tail"])
    parser.add_argument("--lognormal", type=float, nargs=3, metavar=("MEDIAN", "SIGMA", "CAP"),
                        help="one workload of these completion lengths instead of --workloads")
    parser.add_argument("--forward-passes", type=int, default=0,
                        help="forward-only passes per micro-batch (a reference model: 1)")
    parser.add_argument("--num-minibatches", type=int, default=1,
                        help="k: minibatches per step, an optimizer step each (GRPO's and PPO's --num-minibatches)")
    parser.add_argument("--num-iterations", type=int, default=1,
                        help="mu: passes over the step's batch (GRPO's --num-iterations, PPO's --ppo-epochs); "
                             "optimizer steps per training step: mu x k")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=list(WORLD_SIZES))
    parser.add_argument("--steps", type=int, default=32, help="simulated steps averaged per N")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-overlap", action="store_true",
                        help="FSDP's communication adds to the compute instead of hiding under it")
    parser.add_argument("--one-step-off", action="store_true",
                        help="the split layout instead: today, all fixes and the split at staleness 0 and 1, K = "
                             "--rollout-fraction x N and the best K; with --out, one_step_off.md and .png")
    parser.add_argument("--rollout-fraction", type=float, default=0.25,
                        help="with --one-step-off: K / N (default 0.25: verl's one-step-off recipe, 4 of 16 GPUs)")
    parser.add_argument("--out", type=Path, help="also write tables.md, weak_scaling.csv and efficiency.png here")
    parser.add_argument("--timings", type=Path, help="a run's timings.jsonl: predict its mean step time instead")
    parser.add_argument("--machines", type=int, default=1, help="with --timings: machines the ranks were spread over")
    args = parser.parse_args()

    if args.timings:
        if not args.constants:
            parser.error("--timings needs --constants (the CPU test bed's, e.g. scaling_constants/cpu_2core.json)")
        records = read_timings(args.timings)
        print(timings_report(records, load_constants(args.constants[0]), args.machines))
        return
    if args.lognormal:
        median, sigma, cap = args.lognormal
        workloads = [Workload("custom", median, sigma, int(cap))]
    else:
        workloads = [WORKLOADS[name] for name in args.workloads]
    workloads = [replace(workload, forward_passes=args.forward_passes, num_minibatches=args.num_minibatches,
                         num_iterations=args.num_iterations) for workload in workloads]
    rows, sections = [], []
    constants_paths = args.constants or [CONSTANTS_DIR / "h100.json", CONSTANTS_DIR / "h200.json"]
    common = {"world_sizes": tuple(sorted(args.world_sizes)), "steps": args.steps, "seed": args.seed,
              "overlap": not args.no_overlap}
    for path in constants_paths:
        constants = load_constants(path)
        for workload in workloads:
            if args.one_step_off:
                results = simulate_split(constants, workload, fraction=args.rollout_fraction, **common)
                sections.append(split_report(path.stem.upper(), workload, results))
            else:
                results = simulate(constants, workload, **common)
                sections.append(report(path.stem.upper(), workload, results))
            rows.append((path.stem.upper(), workload.name, results))
    if args.one_step_off:
        command = shlex.join(["python", "benchmarks/weak_scaling_sim.py", *sys.argv[1:]])
        text = split_header(command, constants_paths, args.rollout_fraction) + "\n\n" + "\n\n".join(sections)
        print(text)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "one_step_off.md").write_text(text + "\n")
            if not plot(args.out / "one_step_off.png", rows, "Split layout against colocated, Qwen2.5-7B"):
                print("matplotlib is not installed: no one_step_off.png")
        return
    text = "\n\n".join(sections)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tables.md").write_text(text + "\n")
        write_csv(args.out / "weak_scaling.csv", rows)
        if not plot(args.out / "efficiency.png", rows):
            print("matplotlib is not installed: no efficiency.png")


if __name__ == "__main__":
    main()
