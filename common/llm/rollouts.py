"""Rollouts, one step's samples on this rank: which prompts (`prompts_for_rank`, `rank_rows`: fixed per seed and step),
sampled by the engine (`sample_prompts`, with DAPO's dynamic sampling), decoded and scored by the task (`score_rows`),
assembled with every rank's lengths (`generate`); the judge's scores (`judge`); the policy's weights streamed into the
engine after each update (`sync_weights`). The trainers hold their rollouts as `LocalRollouts` (this rank's engine)
or, in the split layout, `RemoteRollouts` (common/llm/layout.py: the rollout ranks', whose loop is
`serve_rollouts` in common/llm/lifecycle.py); both have the same methods, so the step loop never asks which.
"""

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from common.distributed import (
    all_gather_rows,
    all_ranks_ok,
    fail,
    keeping_trainer_nccl_env,
    reduce_stats,
    run_before_leaving,
)
from common.llm.engines import FakeEngine, make_engine, sample_seed
from common.llm.episodes import episode_sums, run_episodes, start_seed
from common.llm.evaluation import evaluate
from common.llm.lora import (
    is_adapter,
    lora_layers,
    lora_scales,
    lora_spec,
    merged_weights,
    serves_adapters,
    unserved_targets_problem,
)
from common.llm.models import stream_weights
from common.llm.routing import moe_layers, replays_routes
from common.llm.run import LLMRun, Rollout, Sample
from common.llm.scoring import RewardModel, decode_completion, sample_scores


def start_engine(run: LLMRun) -> object:
    """This rank's rollout engine. Colocated on a GPU it sleeps while the trainer works; split, it has its GPU."""
    args = run.args
    longest = run.prompt_limit if run.task.environment_prompts else max(map(len, run.train_ids + run.test_ids))
    max_model_len = longest + args.max_completion_length  # an environment writing prompts may go to its limit
    if run.device.type == "cuda":  # loading held one full tensor at a time; vLLM sizes itself from free memory
        torch.cuda.empty_cache()
    if args.rollout_engine == "fake":
        return FakeEngine(len(run.tokenizer), args.fake_tau0_s, args.fake_median_length, args.fake_length_sigma)
    engine = keeping_trainer_nccl_env(lambda: make_engine(
        args.rollout_engine, args.model_name_or_path, args.dtype, args.vllm_tp, max_model_len, run.device,
        args.vllm_kv_cache_memory_bytes, args.vllm_gpu_memory_utilization, colocated=run.layout is None,
        lora=lora_spec(args) if serves_adapters(run) else None, prefix_cache=args.prefix_cache,
        routes=(moe_layers(args.model_name_or_path), run.family.experts_per_token)
        if replays_routes(args, run.family) else None))
    run_before_leaving(engine.close)  # a run stopped by `fail` shuts its engine down while the group exists
    if getattr(engine, "served_lora_modules", None) and \
            (problem := unserved_targets_problem(lora_spec(args).targets, engine.served_lora_modules)):
        fail(problem)
    return engine


def prompts_for_rank(step: int, seed: int, num_prompts: int, prompts_per_step: int, rank: int, world_size: int
                     ) -> tuple[list[int], int]:
    """This rank's prompt indices for `step` (1-based), and the position of the first of them in the step's global
    batch: a fixed permutation per epoch, cut into consecutive steps, each step split into contiguous rank slices."""
    epoch, position = divmod(step - 1, num_prompts // prompts_per_step)  # steps per epoch
    order = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    per_rank = prompts_per_step // world_size
    first = position * prompts_per_step + rank * per_rank
    return order[first:first + per_rank].tolist(), rank * per_rank


def rank_rows(run: LLMRun, step: int, refill_round: int = 0) -> tuple[list[int], list[int], list[int]]:
    """This rank's rows of `step` (G per prompt): each row's index into the training prompts, its sampling seed and
    its environment's start seed, the sampling seed from the sample's global coordinates (step, prompt, sample), so no
    sample depends on which rank draws it, the start seed from (step, prompt): a prompt's G samples start alike. A
    refill round r > 0 (--dynamic-sampling-rounds) draws as many further prompts from a permutation of its own, a
    function of (seed, step, r) alone (so a resumed run draws the same), at coordinates r x prompts-per-step on."""
    args = run.args
    indices, first = prompts_for_rank(step, args.seed, len(run.train_ids), args.prompts_per_step, run.rank,
                                      run.world_size)
    if refill_round:
        order = torch.randperm(len(run.train_ids), generator=torch.Generator().manual_seed(
            sample_seed(args.seed, step, -1 - refill_round, -1)))  # -1: no sample's (nor PPO's shuffle's) coordinates
        indices = order[first:first + len(indices)].tolist()
    group, offset = range(args.num_generations), refill_round * args.prompts_per_step + first
    seeds = [sample_seed(args.seed, step, offset + p, i) for p in range(len(indices)) for i in group]
    starts = [start_seed(args.seed, step, offset + p) for p in range(len(indices)) for _ in group]
    return [i for i in indices for _ in group], seeds, starts


@dataclass
class SampledRows:
    """This rank's rows of a step: G consecutive rows per prompt. `texts` and `judged` are None until scored."""
    indices: list[int]  # each row's index into the training prompts
    samples: list[Sample]
    texts: list[str] | None  # each completion decoded, as the judge reads it
    judged: list[tuple[float, bool]] | None  # the task's (score, correct) of each row
    generate_s: float
    score_s: float
    refill: dict[str, float] | None  # --dynamic-sampling-rounds: this rank's counts (rounds, groups sampled, varied,
    # filler); None in the split layout, where they come with `rollout_timings`
    version: int  # the weights that sampled them: after update `version` (0: the initial weights)
    rollout_timings: list[dict[str, float]] = field(default_factory=list)  # split layout: each rollout rank's


def sample_prompts(engine: object, run: LLMRun, step: int) -> SampledRows:
    """This rank's rows of `step` sampled by `engine` (scored later by `score_rows`). With --dynamic-sampling-rounds
    R (DAPO, Yu et al., arXiv:2503.14476, eq. 11, which keeps the groups that are neither all right nor all wrong;
    here: whose task scores are not all equal, the same for 0/1 rewards), each round is scored at once; a group whose G
    scores are all equal has no advantage to learn from the task: it is dropped, and up to R further rounds of
    prompts (`rank_rows`) refill this rank's share. Varied groups are kept in the order they were drawn. When the
    rounds run out first, dropped groups fill the rest, so every rank trains on the same shapes (only the overlong
    penalty and the KL term, when on, can still move them); `refill` counts it. A refill round runs on every rank
    while any rank still lacks groups (one small all-reduce per round); a rank already full joins it with no prompts.
    generate_s then includes the rounds' scoring and those waits."""
    args, started = run.args, time.time()

    def sampled(indices: list[int], seeds: list[int], starts: list[int]) -> SampledRows:
        samples = run_episodes(engine, run, [run.train_ids[i] for i in indices], [run.train[i] for i in indices],
                               seeds, args.max_completion_length, args.temperature, starts)
        return SampledRows(indices, samples, None, None, time.time() - started, 0.0, {}, step - 1)

    own = rank_rows(run, step)
    if not args.dynamic_sampling_rounds:
        return sampled(*own)
    size, rows_per_rank, kept, dropped, rounds = args.num_generations, len(own[0]), [], [], 0
    for refill_round in range(args.dynamic_sampling_rounds + 1):
        wanted = len(kept) * size < rows_per_rank
        if refill_round and all_ranks_ok(not wanted):  # a round for all or none: scoring is a collective
            break
        rows = score_rows(run, sampled(*(rank_rows(run, step, refill_round) if wanted else ([], [], []))))
        rounds += wanted
        for first in range(0, len(rows.indices), size):
            group = [column[first:first + size] for column in (rows.indices, rows.samples, rows.texts, rows.judged)]
            (kept if len({score for score, _ in group[3]}) > 1 else dropped).append(group)
    chosen = (kept + dropped)[:rows_per_rank // size]
    refill = {"rounds": rounds, "sampled_groups": len(kept) + len(dropped), "varied_groups": len(kept),
              "filler_groups": max(0, rows_per_rank // size - len(kept))}
    return SampledRows(*([row for group in chosen for row in group[c]] for c in range(4)), time.time() - started,
                       0.0, refill, step - 1)


def score_rows(run: LLMRun, rows: SampledRows) -> SampledRows:
    """Decode the rows' completions and score them by the task (a collective on every rank), unless that is done (the
    split layout's rows come scored)."""
    if rows.texts is None or rows.judged is None:
        started = time.time()
        rows.texts = [decode_completion(run.tokenizer, sample.completion_ids, run.eos_ids) for sample in rows.samples]
        if rows.judged is None:
            rows.judged = sample_scores(run, [run.train[i] for i in rows.indices], rows.samples, rows.texts)
        rows.score_s += time.time() - started
    return rows


class LocalRollouts:
    """The trainer's rollouts from this rank's own engine (the colocated layout). The split layout's trainers hold
    `RemoteRollouts` (common/llm/layout.py) with the same methods and attributes."""

    in_flight = None  # no batch is sampled ahead of its step

    def __init__(self, engine: object, run: LLMRun) -> None:
        self.engine, self.run = engine, run
        self.model_runner = getattr(engine, "model_runner", None)
        self.serves_adapters = getattr(engine, "serves_adapters", False)  # the engine takes LoRA adapters alone

    def rows(self, step: int) -> SampledRows:
        """This rank's rows of `step` (`sample_prompts`), then the engine sleeps (on CUDA this frees its memory for
        training)."""
        rows = sample_prompts(self.engine, self.run, step)
        self.engine.sleep()
        return rows

    def receive_next(self, step: int) -> None:
        """Nothing arrives between steps: each step samples its own batch."""

    def update_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.engine.update_weights(weights)

    def update_adapter(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.engine.update_adapter(weights)

    def evaluate(self) -> dict[str, float]:
        """The held-out evaluation of the engine's current weights (common/llm/evaluation.py)."""
        return evaluate(self.engine, self.run, self.run.args.num_eval_prompts, self.run.args.max_completion_length)

    def step_metrics(self, rollout: Rollout, step: int) -> dict[str, float]:
        """No staleness, no idle times: the engine samples with the weights of the update just made."""
        return {}

    def close(self) -> None:
        self.engine.close()


def generate(rollouts: object, run: LLMRun, step: int) -> Rollout:
    """This rank's rows of `step` from `rollouts` (its engine's, or in the split layout the rollout ranks'), every
    rank's lengths, and the task's score of every completion (the split layout's come scored)."""
    started = time.time()
    rows = rollouts.rows(step)
    samples = rows.samples
    prompts = [s.prompt_ids if s.prompt_ids is not None else run.train_ids[i] for i, s in zip(rows.indices, samples)]
    examples = [run.train[i] for i in rows.indices]
    generated = time.time()
    # The step's first collective: every rank's lengths (for token balancing and the timings); this rank waits here
    # for the slowest generator
    mine = torch.tensor([[len(p), len(s.completion_ids)] for p, s in zip(prompts, samples)])
    lengths = all_gather_rows(mine)
    gathered = time.time()
    rows = score_rows(run, rows)
    scores = torch.tensor([float(score) for score, _ in rows.judged])
    correct = torch.tensor([float(right) for _, right in rows.judged])
    timings = {"generate_s": generated - started, "wait_s": gathered - generated, "score_s": rows.score_s,
               "longest_completion": float(mine[:, 1].max()), "completions": float(len(samples))}
    return Rollout(prompts, examples, samples, [s.completion_ids for s in samples], rows.texts, scores, correct,
                   lengths, started, rows.generate_s, timings, step, rows.version, rows.rollout_timings,
                   rollout_metrics(run, samples, rows.refill, rows.rollout_timings))


def rollout_metrics(run: LLMRun, samples: list[Sample], refill: dict[str, float] | None,
                    rollout_timings: list[dict[str, float]]) -> dict[str, float]:
    """The batch's multi-turn statistics (turns, tool calls and failures, environment tokens, truncations, per
    episode) and dynamic sampling's: rounds per generating rank, the share of sampled groups that varied, the share of
    the batch filled with dropped groups because the rounds ran out, prompts sampled. One collective each, on every
    rank. Split layout: the refill counts come with each rollout rank's timings, all of which trainer 0 (the one that
    logs) receives."""
    args, metrics = run.args, {}
    if run.multi_turn:
        sums = reduce_stats(episode_sums(samples, run.event_names))
        metrics = {name: value / (args.prompts_per_step * args.num_generations) for name, value in sums.items()}
    if args.dynamic_sampling_rounds:
        names = ("rounds", "sampled_groups", "varied_groups", "filler_groups")
        sums = reduce_stats(refill) if refill is not None else {
            name: sum(timings[f"refill_{name}"] for timings in rollout_timings) for name in names}
        generators = run.world_size if refill is not None else len(rollout_timings)
        metrics.update({"dynamic/rounds": sums["rounds"] / generators,
                        "dynamic/varied_fraction": sums["varied_groups"] / sums["sampled_groups"],
                        "dynamic/filler_fraction": sums["filler_groups"] / args.prompts_per_step,
                        "dynamic/sampled_prompts": sums["sampled_groups"]})
    return metrics


def judge(reward_model: RewardModel | None, rollout: Rollout) -> torch.Tensor:
    """One score per completion: the reward model's when there is one, else the task's verifiable reward."""
    return rollout.task_scores if reward_model is None else reward_model(rollout.examples, rollout.texts)


def sync_weights(engine: object, policy: torch.nn.Module, dtype: str, rollout: Rollout | None = None) -> float:
    """Stream the policy's full weights from the FSDP shards into the rollout engine, in the rollout dtype; a LoRA
    policy's adapters alone to an engine that serves them, its merged weights to any other. Returns
    the seconds it took; with `rollout`, adds its two parts to the step's timings: gathering (the generator's own
    time: casts, collectives, slicing) and reloading (the engine's; split layout: the broadcast to the rollout ranks
    and their reload). Split layout with --max-staleness 1: the next batch is received first, in the schedule's
    order (common/llm/layout.py)."""
    if rollout is not None:
        engine.receive_next(rollout.step)
    started, gathering = time.time(), 0.0

    def timed(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal gathering
        while True:
            before = time.time()
            item = next(weights, None)
            gathering += time.time() - before
            if item is None:
                return
            yield item

    rollout_dtype = getattr(torch, dtype)
    if getattr(engine, "serves_adapters", False):
        engine.update_adapter(timed(stream_weights(policy, rollout_dtype, only=is_adapter)))
    elif lora_layers(policy):
        engine.update_weights(timed(merged_weights(stream_weights(policy, torch.float32), lora_scales(policy),
                                                   rollout_dtype)))
    else:
        engine.update_weights(timed(stream_weights(policy, rollout_dtype)))
    seconds = time.time() - started
    if rollout is not None:
        rollout.timings.update(sync_gather_s=gathering, sync_reload_s=seconds - gathering, synced_at=time.time())
    return seconds

