"""The run around the algorithm in grpo_llm.py, dpo_online.py and ppo_llm.py: the flags they share (`LLMArgs`) and
the calls their loops make in the same order, written once because the order carries rules: `prepare_run` seeds
before any engine exists; `start_training` starts the engine (which reseeds every RNG, so --seed is applied again),
then restores a checkpoint's shards and RNG states, then gives the engine its first weights by the same path as every
step's `sync_weights`; `generate` puts the engine to sleep before training; `end_step` stops on a non-finite loss
before anything is written. With --rollout-ranks K (common/layout.py) the same calls run on the trainer ranks, with
the rollout ranks behind them: `prepare_run` never returns on a rollout rank, which serves generation
(`serve_rollouts`) and exits."""

import importlib.util
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import torch
import torch.distributed as dist
import tyro

from common.batching import TokenBatch, balanced_partition, contiguous_pieces, make_batch
from common.checkpoint import (
    CheckpointWriteFailed,
    load_training_checkpoint,
    read_training_state,
    save_training_checkpoint,
)
from common.determinism import (
    effective_determinism_env,
    engine_kernels_without_engine,
    python_kernels,
    reroute_composite_autograd,
    restore_rng_states,
    seed_everything,
    seed_rngs,
)
from common.distributed import (
    all_gather_rows,
    all_ranks_ok,
    check_shared_filesystem,
    end,
    exchange,
    fail,
    init_distributed,
    local_world_size,
    nccl_record,
    reduce_stats,
)
from common.episodes import episode_sums, is_multi_turn, reply_encoder, run_episodes, score_samples
from common.layout import (
    Layout,
    RemoteRollouts,
    evaluation_due,
    receive_weights,
    send_evaluation,
    send_samples,
    split_world,
)
from common.models import final_parameter_hash, fsdp_shard_size, stream_weights
from common.preemption import (
    DEFAULT_STOP_SIGNALS,
    EXIT_PREEMPTED,
    catch_stop_signals,
    preempted,
    step_boundary,
    stop_signals_problem,
)
from common.rollout import FakeEngine, Sample, engine_kind, make_engine, sample_seed
from common.scoring import RewardModel, decode_completion, evaluate
from common.tasks import TASK_HELP, Example, Task, TaskError, check_task_fits, make_task
from common.tools import check_tools
from common.tracking import RunTracker, get_logger

EMBEDDED_MODEL = str(Path(__file__).resolve().parent.parent / "assets" / "tiny-adder")


@dataclass
class LLMArgs:
    """The flags every LLM script has, with the defaults that run the embedded task. A script's `Args` adds its
    algorithm's flags and may change a default here by declaring the field again."""
    exp_name: str = "llm"  # the run directory is {run_root}/{exp_name}__{seed}__{timestamp}
    seed: int = 1  # prompt order, per-sample sampling seeds, torch/numpy/python RNGs
    deterministic: bool = True  # deterministic kernels, batch-invariant vLLM on CUDA, TF32 off
    model_name_or_path: str = EMBEDDED_MODEL  # the policy: any HF causal LM; default: the embedded tiny adder
    task: Annotated[str, tyro.conf.arg(help=TASK_HELP)] = "addition"
    dtype: Literal["float32", "bfloat16"] = "float32"  # of rollouts and compute; master weights stay float32
    # --- the loop: steps, prompts, samples ---
    total_steps: int = 400  # steps, each: rollouts, then the update
    prompts_per_step: int = 64  # prompts per step across all ranks
    num_generations: int = 8  # G: completions sampled per prompt
    max_prompt_length: int = 512  # prompts longer than this (in tokens) are dropped from the dataset
    max_completion_length: int = 8  # maximum tokens sampled per completion (multi-turn: per episode, every turn's
    # model and environment tokens)
    max_turns: int = 4  # multi-turn tasks (tools, environments): model turns per episode; single-turn tasks ignore it
    allow_unisolated_tools: bool = False  # run a sandboxed tool (common/sandbox.py) even where this platform cannot
    # isolate it (no user namespaces): model-written code can then reach the network and read the run's files
    temperature: float = 1.0  # sampling temperature; logprobs (rollout and trainer) are taken after it
    dynamic_sampling_rounds: int = 0  # GRPO, DAPO's dynamic sampling: drop the groups whose G scores are all equal
    # (no advantage) and refill the batch with further prompts, in at most this many extra rounds; 0: off
    # --- optimizer ---
    learning_rate: float = 3e-4  # AdamW peak learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_steps: int = 5  # linear warm-up, in optimizer steps
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # after warm-up, to 0 at the last update
    max_grad_norm: float = 1.0  # gradient clipping by global norm (each trained model on its own)
    # --- memory: micro-batches and FSDP2 ---
    micro_batch_size: int = 256  # completions per forward/backward per rank; about 8 for Qwen2.5-0.5B at 1k tokens
    reshard_after_forward: bool = False  # FSDP2: gather each block again for backward (least memory: 1B+ models)
    gradient_checkpointing: bool = False  # keep only each block's input for backward, recompute the rest
    fsdp_shard_size: int = 0  # ranks that shard each model (FSDP2); the rest replicate (HSDP). 0 = ranks per
    # node (all ranks when nodes run one each)
    # --- rollout engine ---
    rollout_engine: Literal["auto", "vllm", "hf", "fake"] = "auto"  # `auto` = vLLM when installed, else
    # transformers; `fake` = random tokens of lognormal lengths after a sleep of tau0 x the longest (scaling studies)
    fake_tau0_s: float = 0.002  # fake engine: seconds per token of the longest completion on the rank
    fake_median_length: float = 6.0  # fake engine: median completion length (tokens), capped at --max-completion-length
    fake_length_sigma: float = 0.8  # fake engine: the lognormal's sigma (the spread of completion lengths)
    vllm_tp: int = 1  # tensor-parallel size of each vLLM engine (groups of contiguous ranks)
    rollout_ranks: int = 0  # K > 0: the split layout, the last K ranks only generate and the others only train;
    # 0: colocated, every rank generates and trains
    max_staleness: int = 0  # with --rollout-ranks: 1 samples batch t + 1 while batch t trains (with the weights
    # after update t - 1: one step off-policy); 0 waits for each update. The schedule is fixed either way
    vllm_kv_cache_memory_bytes: int = 64 * 2**20  # KV-cache size of the vLLM engine on CPU
    vllm_gpu_memory_utilization: float = 0.3  # share of GPU memory vLLM may take on CUDA (the trainer needs the rest)
    # --- evaluation, logs, checkpoints ---
    eval_every: int = 20  # held-out greedy evaluation every this many steps (and before the first and after the last)
    num_eval_prompts: int = 500  # held-out prompts per evaluation (0 = the whole test split)
    eval_samples: int = 0  # k > 0: also k sampled completions per held-out prompt: eval/mean@k and eval/pass@j
    eval_temperature: float = 1.0  # the sampling temperature of --eval-samples (papers: often 0.6 to 1.0)
    track: bool = False  # mirror the TensorBoard logs to Weights & Biases
    wandb_project_name: str = "rl-repro"  # the Weights & Biases project, with --track
    run_root: str = "runs"  # where run directories are created
    save_every: int = 0  # checkpoint every this many steps (0 = only at the end)
    keep_last: int = 2  # checkpoints kept (older ones are deleted after a newer one is complete); 0 keeps all
    resume: str | None = None  # a checkpoint (or checkpoints/) to continue, in its run directory, with the same args
    stop_signals: tuple[str, ...] = DEFAULT_STOP_SIGNALS  # signals that stop the run after its current step with a
    # checkpoint and exit status 3 (common/preemption.py); torchrun forwards SIGTERM, SLURM's --signal sends any


# Arguments a resumed run may change: where and how it reports, not what it computes (so not --rollout-engine: vLLM
# and transformers draw other samples).
MAY_CHANGE_ON_RESUME = ("resume", "run_root", "exp_name", "track", "wandb_project_name", "eval_every",
                        "num_eval_prompts", "eval_samples", "eval_temperature", "save_every", "keep_last",
                        "vllm_kv_cache_memory_bytes", "vllm_gpu_memory_utilization", "allow_unisolated_tools",
                        "stop_signals")


def check_llm_args(args: LLMArgs, world_size: int) -> None:
    """The checks every LLM script shares; each script adds its own. Runs on every rank before any collective."""
    for name in ("total_steps", "prompts_per_step", "num_generations", "micro_batch_size", "max_completion_length",
                 "vllm_tp", "max_prompt_length", "learning_rate", "temperature", "max_turns"):
        if not getattr(args, name) > 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.rollout_ranks < 0 or args.max_staleness not in (0, 1):
        fail(f"--rollout-ranks must be non-negative and --max-staleness 0 or 1, got {args.rollout_ranks} and "
             f"{args.max_staleness}")
    if args.max_staleness and not args.rollout_ranks:
        fail("--max-staleness 1 needs --rollout-ranks: one-step-off generation runs on ranks of its own")
    trainers, generators = world_size - args.rollout_ranks, args.rollout_ranks or world_size
    if args.rollout_ranks and trainers < 1:
        fail(f"--rollout-ranks {args.rollout_ranks} leaves no trainer rank in a world of {world_size}: use at most "
             f"{world_size - 1}")
    for ranks, what in ((trainers, "trainer ranks" if args.rollout_ranks else "world size"),
                        (generators, "rollout ranks")):
        if args.prompts_per_step % ranks:
            fail(f"--prompts-per-step {args.prompts_per_step} must be divisible by the {what} {ranks}")
    if generators % args.vllm_tp:
        fail(f"--vllm-tp {args.vllm_tp} must divide the {'rollout ranks' if args.rollout_ranks else 'world size'} "
             f"{generators}")
    per_node, tp = local_world_size(), args.vllm_tp  # a group: tp consecutive ranks from the first generator on
    if engine_kind(args.rollout_engine) == "vllm" and any(first // per_node != (first + tp - 1) // per_node
                                                          for first in range(world_size - generators, world_size, tp)):
        fail(f"--vllm-tp {tp} would put a tensor-parallel group across nodes: each node runs {per_node} rank(s) "
             f"(torchrun --nproc_per_node) and a group is {tp} consecutive ranks of the "
             f"{'last ' + str(generators) if args.rollout_ranks else str(world_size)}; vLLM-CPU's shared-memory "
             "communicator cannot span nodes, and on GPUs it would be slow. Use a --vllm-tp that divides "
             "--nproc_per_node (and, split, --rollout-ranks a multiple of both)")
    shard_size = fsdp_shard_size(args.fsdp_shard_size, trainers)
    if shard_size < 1 or trainers % shard_size:
        fail(f"--fsdp-shard-size {args.fsdp_shard_size} (0 = ranks per node) gives shard size {shard_size}, which "
             f"must divide the {'trainer ranks' if args.rollout_ranks else 'world size'} {trainers}")
    if min(args.eval_every, args.save_every, args.keep_last, args.num_eval_prompts, args.warmup_steps,
           args.eval_samples) < 0:
        fail("--eval-every, --save-every, --keep-last, --num-eval-prompts, --eval-samples and --warmup-steps must be "
             "non-negative")
    if args.dynamic_sampling_rounds < 0 or (args.dynamic_sampling_rounds and args.num_generations < 2):
        fail(f"--dynamic-sampling-rounds must be non-negative, and needs --num-generations of at least 2 (a group of "
             f"one never varies), got {args.dynamic_sampling_rounds} and {args.num_generations}")
    if args.eval_samples and not args.eval_temperature > 0:
        fail(f"--eval-temperature must be positive with --eval-samples, got {args.eval_temperature}")
    if args.track and importlib.util.find_spec("wandb") is None:
        fail("--track needs Weights & Biases: pip install wandb")
    if problem := stop_signals_problem(args.stop_signals):
        fail(problem)
    path = args.model_name_or_path
    if not os.path.isdir(path) and (os.path.exists(path) or path.startswith(("/", "./", "../"))):
        fail(f"--model-name-or-path {path!r} is not a model directory")


@dataclass
class LLMRun:
    """What the loop needs besides its models."""
    args: LLMArgs
    rank: int
    world_size: int
    device: torch.device
    determinism: dict[str, object]  # the settings seed_everything applied, for the manifest
    task: Task
    tokenizer: object
    train: list[Example]  # the training prompts that fit --max-prompt-length, and their token ids
    train_ids: list[list[int]]
    test: list[Example]  # the held-out prompts (cut to --max-prompt-length from the left), and their token ids
    test_ids: list[list[int]]
    eos_ids: list[int]  # every id that ends a completion, for both engines and for decoding
    templated: bool  # the prompts (and a multi-turn task's replies) are written by the tokenizer's chat template
    pad_id: int
    resume_dir: Path | None
    resume_state: dict | None  # trainer_state.pt as this rank needs it: step, args, world size, extra, its RNG states
    layout: Layout | None  # the split layout's groups (--rollout-ranks); rank and world_size are then this side's


def eos_token_ids(model_path: str, tokenizer: object) -> list[int]:
    """The generation config's EOS ids (Qwen2.5-Instruct lists two) together with the tokenizer's."""
    from transformers import GenerationConfig

    try:
        configured = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        configured = None
    ids = set([configured] if isinstance(configured, int) else configured or []) | {tokenizer.eos_token_id}
    return sorted(ids - {None})


def prepare_run(args: LLMArgs) -> LLMRun:
    """Seeds and deterministic kernels (their environment flags must exist before any engine or CUDA starts), the
    process group, the checkpoint to resume from (checked against `args`), tokenizer, task, encoded prompts and EOS
    ids. Every failure here stops every rank with a message, before any model is loaded."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a weight-loading bar per model and rank, interleaved
    catch_stop_signals(args.stop_signals)  # from the start: a signal during start-up stops after the first step
    determinism = seed_everything(args.seed, args.deterministic, colocated=not args.rollout_ranks)
    args.rollout_engine = engine_kind(args.rollout_engine)  # recorded and compared on resume as the engine that ran
    rank, world_size, device = init_distributed()
    check_shared_filesystem(Path(args.resume or args.run_root), create=not args.resume)  # where this run writes
    trainers = world_size - args.rollout_ranks  # a checkpoint records the trainers' world
    resume_dir, resume_state = read_training_state(args, trainers, MAY_CHANGE_ON_RESUME) if args.resume else \
        (None, None)
    problem = None  # each rank reads the model's files and the task itself: decided together, so none hangs
    try:
        AutoConfig.from_pretrained(args.model_name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    except (OSError, ValueError) as error:
        problem = f"cannot load model {args.model_name_or_path!r}: {error}"
    try:
        task = make_task(args.task)
        if not task.train or not task.test:
            raise TaskError(f"it has {len(task.train)} training and {len(task.test)} test examples; it needs both")
    except TaskError as error:
        problem = problem or f"task {args.task!r}: {error}"
    except Exception as error:  # datasets raises many types for a missing dataset
        problem = problem or f"cannot load task {args.task!r}: {error!r}"
    if not all_ranks_ok(problem is None):
        fail(problem or "another rank cannot load the model or the task; its message says why")
    templated = task.chat_template and bool(getattr(tokenizer, "chat_template", None))

    def encode(examples: list[Example]) -> list[list[int]]:
        texts = [task.format_prompt(tokenizer, example) for example in examples]
        return tokenizer(texts, add_special_tokens=not templated).input_ids

    try:  # a chat template may refuse the task's messages (e.g. no system role), a user's format_prompt may raise
        train_ids, test_ids = encode(task.train), encode(task.test)
        probe = task.train[:32] + task.test[:32]  # the same prompts on every rank
        check_task_fits(task, args.task, tokenizer, args.model_name_or_path,
                        [task.format_prompt(tokenizer, e) for e in probe], train_ids[:32] + test_ids[:32],
                        args.max_completion_length)
    except TaskError as error:
        problem = str(error)
    except Exception as error:
        problem = f"task {args.task!r}: its prompts cannot be formatted for {args.model_name_or_path!r}: {error!r}"
    if not all_ranks_ok(problem is None):
        fail(problem or "another rank cannot format the task's prompts; its message says why")
    eos_ids = eos_token_ids(args.model_name_or_path, tokenizer)
    try:
        multi_turn = is_multi_turn(task)
    except Exception as error:  # a user's environment() that cannot start
        multi_turn, problem = False, f"task {args.task!r}: its environment() failed: {error!r}"
    if not all_ranks_ok(problem is None):
        fail(problem or "another rank cannot make the task's environment; its message says why")
    if multi_turn:  # before any engine: the replies can be encoded, the sandboxed tools can be isolated
        hidden = [args.run_root] + ([args.resume] if args.resume else [])  # from code the model writes
        problem = check_tools(task, args.allow_unisolated_tools, hidden)
        try:
            reply_encoder(tokenizer, templated, eos_ids)("0")
        except TaskError as error:
            problem = problem or f"task {args.task!r} with model {args.model_name_or_path!r}: {error}"
        if not all_ranks_ok(problem is None):
            fail(problem or "another rank cannot run the task's tools; its message says why")
    keep = [i for i, ids in enumerate(train_ids) if len(ids) <= args.max_prompt_length]
    if len(keep) < args.prompts_per_step:
        fail(f"only {len(keep)} training prompts fit --max-prompt-length {args.max_prompt_length}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    layout = split_world(args.rollout_ranks, args.max_staleness) if args.rollout_ranks else None
    if layout is not None:
        rank, world_size = dist.get_rank(), dist.get_world_size()
    run = LLMRun(args, rank, world_size, device, determinism, task, tokenizer, [task.train[i] for i in keep],
                 [train_ids[i] for i in keep], task.test, [ids[-args.max_prompt_length:] for ids in test_ids],
                 eos_ids, templated, pad_id, resume_dir, resume_state, layout)
    if layout is not None and layout.is_rollout:
        serve_rollouts(run)
        sys.exit(0)
    return run


def start_engine(run: LLMRun) -> object:
    """This rank's rollout engine. Colocated on a GPU it sleeps while the trainer works; split, it has its GPU."""
    args = run.args
    max_model_len = max(map(len, run.train_ids + run.test_ids)) + args.max_completion_length
    if run.device.type == "cuda":  # loading held one full tensor at a time; vLLM sizes itself from free memory
        torch.cuda.empty_cache()
    if args.rollout_engine == "fake":
        return FakeEngine(len(run.tokenizer), args.fake_tau0_s, args.fake_median_length, args.fake_length_sigma)
    return make_engine(args.rollout_engine, args.model_name_or_path, args.dtype, args.vllm_tp, max_model_len,
                       run.device, args.vllm_kv_cache_memory_bytes, args.vllm_gpu_memory_utilization,
                       colocated=run.layout is None)


def serve_rollouts(run: LLMRun) -> None:
    """A rollout rank's whole run in the split layout (the schedule in common/layout.py): generate and score its
    share of each step's prompts, send the rows to the trainers that train them, load each update's weights, and
    evaluate when due. Its prompts and sample seeds are those of the colocated layout at its world size."""
    args, layout = run.args, run.layout
    os.environ.update(RANK=str(run.rank), WORLD_SIZE=str(run.world_size))  # vLLM's external_launcher reads these
    engine = start_engine(run)
    start_step = run.resume_state["step"] if run.resume_state else 0
    idle = 0.0  # seconds in transfers since the last generation: the engine's wait for the trainers

    def transfer(action: object, *arguments: object) -> None:
        nonlocal idle
        started = time.time()
        action(*arguments)
        idle += time.time() - started

    def produce(step: int, version: int) -> None:
        nonlocal idle
        rows = score_rows(run, sample_prompts(engine, run, step))
        samples = rows.samples
        scores, correct = zip(*rows.judged)
        timings = {"generate_s": rows.generate_s, "score_s": rows.score_s, "rollout_wait_s": idle,
                   "longest_completion": float(max(len(s.completion_ids) for s in samples)),
                   "completions": float(len(samples)), **{f"refill_{k}": v for k, v in rows.refill.items()}}
        idle = 0.0
        transfer(send_samples, layout, args.prompts_per_step * args.num_generations, samples,
                 [float(score) for score in scores], [float(right) for right in correct], version, timings,
                 rows.indices if args.dynamic_sampling_rounds else None)

    def load_weights() -> None:
        transfer(lambda: engine.update_weights(receive_weights(layout, run.device)))

    if start_step:
        load_weights()
    else:
        metrics = evaluate(engine, run, args.num_eval_prompts, args.max_completion_length)
        send_evaluation(layout, metrics if run.rank == 0 else None)
        if layout.max_staleness:
            produce(1, 0)
    for step in range(start_step + 1, args.total_steps + 1):
        if not layout.max_staleness:
            produce(step, step - 1)
        elif step < args.total_steps:
            produce(step + 1, step - 1)
        load_weights()
        if evaluation_due(step, args.eval_every, args.total_steps):
            metrics = evaluate(engine, run, args.num_eval_prompts, args.max_completion_length)
            send_evaluation(layout, metrics if run.rank == 0 else None)
        stopping = step_boundary(None, layout.world, engine.close) and step < args.total_steps  # as end_step's
        if stopping or checkpoint_due(args, step):
            step_boundary(None, layout.world, engine.close)  # the trainers wrote their checkpoint, or failed to
        if stopping:
            engine.close()
            end(EXIT_PREEMPTED)
    engine.close()


def start_training(run: LLMRun, trained: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]],
                   schedulers: list[torch.optim.lr_scheduler.LambdaLR], updates_per_step: int
                   ) -> tuple[object, RunTracker, int]:
    """This rank's rollout engine, the checkpoint resumed from (shards back into the models and optimizers of
    `trained`, the schedules fast-forwarded, this rank's RNG states), the run directory, and the engine's first
    weights. Returns the engine, the tracker and the last completed step (0 for a fresh run)."""
    args = run.args
    start_step = run.resume_state["step"] if run.resume_state else 0
    if run.layout is None:
        engine = start_engine(run)
    else:  # the rollout ranks' engines, behind the schedule; with S = 1 the checkpoint holds the batch in flight
        engine = RemoteRollouts(run.layout, args.prompts_per_step * args.num_generations, args.total_steps,
                                run.resume_state.get("in_flight") if start_step else None)
        engine_kernels_without_engine(run.device.type, args.rollout_engine)  # a colocated trainer's kernels
    seed_rngs(args.seed)  # starting vLLM reseeded python, numpy and torch with the engine's seed
    rerouted = reroute_composite_autograd(run.device.type)  # vLLM's kernels for linear / matmul (GPUs of SM 8.x)
    if start_step:  # after the engine, whose start would overwrite the restored RNG states
        load_training_checkpoint(run.resume_dir, trained)
        for scheduler in schedulers:  # a pure function of the update count
            for _ in range(start_step * updates_per_step):
                scheduler.step()
        restore_rng_states(run.resume_state["rng"])
    runner = getattr(engine, "model_runner", None)
    tracker = RunTracker(args, run.rank, run.world_size,
                         {**run.determinism, **effective_determinism_env(), "vllm_model_runner": runner,
                          "kernel_overrides": python_kernels(run.device.type), "autograd_rerouted": rerouted,
                          "nccl": nccl_record()},
                         run.resume_dir, start_step)
    log = get_logger(run.rank)
    if runner == "v1" and run.device.type == "cuda":
        log.warning("vLLM runs its V1 model runner, which samples seeded requests one by one in Python; "
                    "unset VLLM_USE_V2_MODEL_RUNNER=0 or use a model the V2 runner supports")
    split = f" trainers, {args.rollout_ranks} rollout ranks" if run.layout else ""
    log.info(f"world size {run.world_size}{split}, {type(engine).__name__} (model runner {runner}), "
             f"{len(run.train_ids)} train / {len(run.test_ids)} test prompts, starting after step {start_step}")
    if start_step:  # the same weight path into the engine as the uninterrupted run took
        sync_weights(engine, trained["policy"][0], args.dtype)
    else:
        metrics = evaluation(engine, run)
        tracker.log(0, metrics)
        tracker.write_json("eval_before.json", metrics)
        log.info(f"held-out greedy accuracy before training: {metrics['eval/accuracy']:.4f}")
    return engine, tracker, start_step


def prompts_for_rank(step: int, seed: int, num_prompts: int, prompts_per_step: int, rank: int, world_size: int
                     ) -> tuple[list[int], int]:
    """This rank's prompt indices for `step` (1-based), and the position of the first of them in the step's global
    batch: a fixed permutation per epoch, cut into consecutive steps, each step split into contiguous rank slices."""
    epoch, position = divmod(step - 1, num_prompts // prompts_per_step)  # steps per epoch
    order = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    per_rank = prompts_per_step // world_size
    first = position * prompts_per_step + rank * per_rank
    return order[first:first + per_rank].tolist(), rank * per_rank


@dataclass
class Rollout:
    """One step's samples on this rank: G consecutive rows per prompt."""
    prompts: list[list[int]]  # each row's prompt token ids
    examples: list[Example]  # each row's task example (prompt text, reference answer)
    samples: list[Sample]  # each row's completion ids, the engine's logprobs of them, whether it hit the length limit
    completions: list[list[int]]  # each row's completion ids (as in samples)
    texts: list[str]  # each completion decoded, as the judge reads it
    task_scores: torch.Tensor  # [rows] the task's verifiable reward of each completion
    correct: torch.Tensor  # [rows] 1.0 where the task counts the completion correct, else 0.0
    lengths: torch.Tensor  # [world size, rows, 2] every rank's (prompt, completion) lengths, gathered once
    started: float  # wall clock at the start of the step
    seconds: float  # generation time, this rank (split layout: the slowest rollout rank)
    timings: dict[str, float]  # this rank's phases of the step so far (seconds) and token counts, for timings.jsonl
    step: int
    version: int  # the weights that sampled it: after update `version` (0 = the starting model)
    rollout_timings: list[dict[str, float]]  # the split layout: each rollout rank's timings of this batch
    rollout_metrics: dict[str, float] = field(default_factory=dict)  # the batch's episode/... and dynamic/... metrics


def evaluation(engine: object, run: LLMRun) -> dict[str, float]:
    """Held-out greedy accuracy of the current weights: this rank's engine, or (split) the rollout ranks'."""
    if isinstance(engine, RemoteRollouts):
        return engine.evaluation()
    return evaluate(engine, run, run.args.num_eval_prompts, run.args.max_completion_length)


def rank_rows(run: LLMRun, step: int, refill_round: int = 0) -> tuple[list[int], list[int]]:
    """This rank's rows of `step` (G per prompt): each row's index into the training prompts and its sampling seed,
    the seed from the sample's global coordinates (step, prompt, sample), so no sample depends on which rank draws
    it. A refill round r > 0 (--dynamic-sampling-rounds) draws as many further prompts from a permutation of its own,
    a function of (seed, step, r) alone (so a resumed run draws the same), at coordinates r x prompts-per-step on."""
    args = run.args
    indices, first = prompts_for_rank(step, args.seed, len(run.train_ids), args.prompts_per_step, run.rank,
                                      run.world_size)
    if refill_round:
        order = torch.randperm(len(run.train_ids), generator=torch.Generator().manual_seed(
            sample_seed(args.seed, step, -1 - refill_round, -1)))  # -1: no sample's (nor PPO's shuffle's) coordinates
        indices = order[first:first + len(indices)].tolist()
    group, offset = range(args.num_generations), refill_round * args.prompts_per_step + first
    seeds = [sample_seed(args.seed, step, offset + p, i) for p in range(len(indices)) for i in group]
    return [i for i in indices for _ in group], seeds


@dataclass
class SampledRows:
    """This rank's rows of a step: G consecutive rows per prompt. `texts` and `judged` are None until scored."""
    indices: list[int]  # each row's index into the training prompts
    samples: list[Sample]
    texts: list[str] | None  # each completion decoded, as the judge reads it
    judged: list[tuple[float, bool]] | None  # the task's (score, correct) of each row
    generate_s: float
    score_s: float
    refill: dict[str, float]  # --dynamic-sampling-rounds: this rank's counts (rounds, groups sampled, varied, filler)


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

    def sampled(indices: list[int], seeds: list[int]) -> SampledRows:
        samples = run_episodes(engine, run, [run.train_ids[i] for i in indices], [run.train[i] for i in indices],
                               seeds, args.max_completion_length, args.temperature)
        return SampledRows(indices, samples, None, None, time.time() - started, 0.0, {})

    indices, seeds = rank_rows(run, step)
    if not args.dynamic_sampling_rounds:
        return sampled(indices, seeds)
    size, rows_per_rank, kept, dropped, rounds = args.num_generations, len(indices), [], [], 0
    for refill_round in range(args.dynamic_sampling_rounds + 1):
        wanted = len(kept) * size < rows_per_rank
        if refill_round and all_ranks_ok(not wanted):  # a round for all or none: scoring is a collective
            break
        rows = score_rows(run, sampled(*(rank_rows(run, step, refill_round) if wanted else ([], []))))
        rounds += wanted
        for first in range(0, len(rows.indices), size):
            group = [column[first:first + size] for column in (rows.indices, rows.samples, rows.texts, rows.judged)]
            (kept if len({score for score, _ in group[3]}) > 1 else dropped).append(group)
    chosen = (kept + dropped)[:rows_per_rank // size]
    refill = {"rounds": rounds, "sampled_groups": len(kept) + len(dropped), "varied_groups": len(kept),
              "filler_groups": max(0, rows_per_rank // size - len(kept))}
    return SampledRows(*([row for group in chosen for row in group[c]] for c in range(4)), time.time() - started,
                       0.0, refill)


def score_rows(run: LLMRun, rows: SampledRows) -> SampledRows:
    """Decode and score the rows by the task (a collective on every rank), unless that is done."""
    if rows.judged is None:
        started = time.time()
        rows.texts = [decode_completion(run.tokenizer, sample.completion_ids, run.eos_ids) for sample in rows.samples]
        rows.judged = score_samples(run.task, [run.train[i] for i in rows.indices], rows.samples, rows.texts)
        rows.score_s += time.time() - started
    return rows


def generate(engine: object, run: LLMRun, step: int) -> Rollout:
    """This rank's rows of `step` (`sample_prompts`), then the engine sleeps (on CUDA this frees its memory for
    training) and the task scores every completion. Split layout: the same rows, sampled and scored by the rollout
    ranks."""
    started = time.time()
    version, rollout_timings, refill = step - 1, [], None
    if isinstance(engine, RemoteRollouts):
        payloads = engine.batch(step)
        indices = [i for payload in payloads for i in payload["indices"]] if "indices" in payloads[0] else \
            rank_rows(run, step)[0]  # the rows of the step's own prompts, unless dynamic sampling refilled them
        samples = [sample for payload in payloads for sample in payload["samples"]]
        version, rollout_timings = payloads[0]["version"], [payload["timings"] for payload in payloads]
        seconds = max(timings["generate_s"] for timings in rollout_timings)
    else:
        rows = sample_prompts(engine, run, step)
        indices, samples, seconds, refill = rows.indices, rows.samples, rows.generate_s, rows.refill
        engine.sleep()
    prompts, examples = [run.train_ids[i] for i in indices], [run.train[i] for i in indices]
    generated = time.time()
    # The step's first collective: every rank's lengths (for token balancing and the timings); this rank waits here
    # for the slowest generator
    mine = torch.tensor([[len(p), len(s.completion_ids)] for p, s in zip(prompts, samples)])
    lengths = all_gather_rows(mine)
    gathered = time.time()
    if rollout_timings:  # scored on the rollout ranks (a checkpoint older than `correct`: scores of 1 are correct)
        texts = [decode_completion(run.tokenizer, sample.completion_ids, run.eos_ids) for sample in samples]
        judged = [pair for payload in payloads for pair in zip(payload["scores"], payload.get(
            "correct", [score >= 1 for score in payload["scores"]]))]
        score_s = time.time() - gathered
    else:
        rows = score_rows(run, rows)
        texts, judged, score_s = rows.texts, rows.judged, rows.score_s
    scores = torch.tensor([float(score) for score, _ in judged])
    correct = torch.tensor([float(right) for _, right in judged])
    timings = {"generate_s": generated - started, "wait_s": gathered - generated, "score_s": score_s,
               "longest_completion": float(mine[:, 1].max()), "completions": float(len(samples))}
    return Rollout(prompts, examples, samples, [s.completion_ids for s in samples], texts, scores, correct, lengths,
                   started, seconds, timings, step, version, rollout_timings,
                   rollout_metrics(run, samples, refill, rollout_timings))


def rollout_metrics(run: LLMRun, samples: list[Sample], refill: dict[str, float] | None,
                    rollout_timings: list[dict[str, float]]) -> dict[str, float]:
    """The batch's multi-turn statistics (turns, tool calls and failures, environment tokens, truncations, per
    episode) and dynamic sampling's: rounds per generating rank, the share of sampled groups that varied, the share of
    the batch filled with dropped groups because the rounds ran out, prompts sampled. One collective each, on every
    rank. Split layout: the refill counts come with each rollout rank's timings, all of which trainer 0 (the one that
    logs) receives."""
    args, metrics = run.args, {}
    if is_multi_turn(run.task):
        sums = reduce_stats(episode_sums(samples, run.task.environment().event_names))
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


def split(rows: list[int] | range, size: int) -> list[list[int] | range]:
    """Consecutive pieces of at most `size` rows (micro-batches; the last may be smaller), like `Tensor.split`."""
    return [rows[start:start + size] for start in range(0, len(rows), size)]


def balance_tokens(rollout: Rollout, run: LLMRun, per_row: torch.Tensor, unit: int, micro_batch_size: int,
                   micro_batch_tokens: int) -> tuple[Rollout, torch.Tensor, list[list[int]]]:
    """Move rows between ranks so that every rank trains on nearly the same number of tokens (FSDP runs in lock step:
    each micro-batch costs the slowest rank's time), and cut each rank's rows into micro-batches. Units of `unit`
    consecutive rows (GRPO's packed groups) move whole; `per_row` [rows, k] (e.g. advantages) travels with them.

    The plan needs nothing but every rank's lengths, gathered by `generate`, so every rank computes the same plan:
    `balanced_partition` of all units by tokens (heaviest unit <= mean + the largest), each rank's units ordered by
    length (similar lengths pad less together), then the same number M of micro-batches on every rank (the lock
    step): M = the most any rank needs for `micro_batch_tokens` padded tokens each (else `micro_batch_size` rows),
    at most the fewest units any rank holds. The rows move point to point between the pairs of ranks that exchange
    any, over gloo (`exchange`), never an all-to-all over the world. The loss is unchanged: every normaliser counts
    the whole batch. Returns this rank's rollout, per_row and pieces."""
    world, rows, _ = rollout.lengths.shape
    lengths = rollout.lengths.view(world * rows // unit, unit, 2)  # [global units, unit, (prompt, completion)]
    weights = (lengths[:, :, 0] + lengths[:, :, 1]).sum(1).tolist()
    parts = balanced_partition(weights, world)
    for part in parts:
        part.sort(key=lambda u: (weights[u], u))
    mine, units_per_rank = parts[run.rank], rows // unit
    # --- move: each rank sends its units to their new ranks, in the order the receiver keeps them
    tokens = [rollout.prompts[r] + rollout.completions[r] for r in range(rows)]
    floats = [[*rollout.samples[r].logprobs, *rollout.samples[r].model_mask(), float(rollout.samples[r].truncated),
               *per_row[r].tolist()] for r in range(rows)]  # a completion's logprobs and loss mask, then per row

    def rows_of(u: int) -> range:
        return range((u % units_per_rank) * unit, (u % units_per_rank + 1) * unit)

    def size(u: int, extra: int) -> int:  # a unit's entries in the token or the float stream
        return int(lengths[u].sum()) if extra < 0 else 2 * int(lengths[u, :, 1].sum()) + unit * extra

    sent = [[u for u in part if u // units_per_rank == run.rank] for part in parts]
    received = [[u for u in mine if u // units_per_rank == source] for source in range(world)]
    extra = 1 + per_row.shape[1]
    moved = [exchange([[value for u in part for r in rows_of(u) for value in stream[r]] for part in sent],
                      [sum(size(u, width) for u in part) for part in received], dtype)
             for stream, dtype, width in ((tokens, torch.long, -1), (floats, torch.float64, extra))]
    token_at, float_at = {}, {}  # where each unit starts in the received streams (in sender order)
    offsets = [0, 0]
    for u in (u for part in received for u in part):
        token_at[u], float_at[u] = offsets[0], offsets[1]
        offsets[0] += size(u, -1)
        offsets[1] += size(u, extra)
    prompts, samples, values = [], [], []
    for u in sorted(mine, key=lambda u: (weights[u], u)):
        t, f = token_at[u], float_at[u]
        for prompt_length, completion_length in lengths[u].tolist():
            prompts.append(moved[0][t:t + prompt_length])
            completion = moved[0][t + prompt_length:t + prompt_length + completion_length]
            record = moved[1][f:f + 2 * completion_length + extra]
            loss_mask = [int(m) for m in record[completion_length:2 * completion_length]]
            samples.append(Sample(completion, record[:completion_length], bool(record[2 * completion_length]),
                                  loss_mask if 0 in loss_mask else None))
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
    unit_pieces = contiguous_pieces([weights[u] for u in mine], count) if mine else []
    pieces = [[i * unit + j for i in piece for j in range(unit)] for piece in unit_pieces]
    balanced = Rollout(prompts, [], samples, [s.completion_ids for s in samples], [], torch.empty(0), torch.empty(0),
                       rollout.lengths, rollout.started, rollout.seconds, rollout.timings, rollout.step,
                       rollout.version, rollout.rollout_timings, rollout.rollout_metrics)
    return balanced, torch.tensor(values, dtype=per_row.dtype).reshape(len(samples), -1), pieces


def micro_batches(rollout: Rollout, pieces: list[list[int] | range], run: LLMRun, share_prompts: bool = False
                  ) -> list[TokenBatch]:
    """One TokenBatch per list of rows, on the device, with the engine's logprobs of those rows' tokens. Counts the
    tokens it lays out, real and padded, into the step's timings."""
    batches = [make_batch([rollout.prompts[r] for r in rows], [rollout.samples[r].completion_ids for r in rows],
                          run.pad_id, run.device, share_prompts, [rollout.samples[r].logprobs for r in rows],
                          [rollout.samples[r].loss_mask for r in rows])
               for rows in pieces]
    counts = rollout.timings
    counts["micro_batches"] = counts.get("micro_batches", 0) + len(batches)
    counts["tokens"] = counts.get("tokens", 0) + sum(  # real tokens: a packed row holds its prompt once
        int((b.segment_ids != -2).sum() if b.attention_mask is None else b.attention_mask.sum()) for b in batches)
    counts["padded_tokens"] = counts.get("padded_tokens", 0) + sum(b.input_ids.numel() for b in batches)
    return batches


def sync_weights(engine: object, policy: torch.nn.Module, dtype: str, rollout: Rollout | None = None) -> float:
    """Stream the policy's full weights from the FSDP shards into the rollout engine, in the rollout dtype. Returns
    the seconds it took; with `rollout`, adds its two parts to the step's timings: gathering (the generator's own
    time: casts, collectives, slicing) and reloading (the engine's; split layout: the broadcast to the rollout ranks
    and their reload). Split layout with --max-staleness 1: the next batch is received first, in the schedule's
    order (common/layout.py)."""
    if rollout is not None and isinstance(engine, RemoteRollouts):
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

    engine.update_weights(timed(stream_weights(policy, getattr(torch, dtype))))
    seconds = time.time() - started
    if rollout is not None:
        rollout.timings.update(sync_gather_s=gathering, sync_reload_s=seconds - gathering, synced_at=time.time())
    return seconds


def end_step(run: LLMRun, engine: object, tracker: RunTracker, step: int, rollout: Rollout,
             metrics: dict[str, float], trained: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]],
             extra: dict | None = None) -> None:
    """After the update and the weight sync: stop on a non-finite loss (the last checkpoint is left as it was),
    evaluate when due, log the step, and checkpoint when due (`extra`: state the algorithm carries between steps).
    Every rank (the split layout: the rollout ranks too) meets at the step boundary (common/preemption.py): a failed
    log write stops them all with its message, and a stop signal that reached any of them writes a checkpoint now
    and ends the run with the line that resumes it. After a checkpoint they meet again, so that a failed one stops
    them all too (in the split layout the rollout ranks wait for it, where they would otherwise sample on)."""
    args = run.args
    metrics["perf/step_s"] = time.time() - rollout.started
    reduce_s = time.time() - rollout.timings.pop("synced_at")  # the statistics' collectives, waits included
    if isinstance(engine, RemoteRollouts):  # the split layout's staleness and idle times
        rollout.timings["trainer_wait_s"] = metrics["perf/trainer_wait_s"] = engine.wait_s
        metrics["perf/rollout_wait_s"] = sum(t["rollout_wait_s"] for t in rollout.rollout_timings) / len(
            rollout.rollout_timings)
        metrics.update({"rollout/weight_version": rollout.version, "rollout/staleness": step - 1 - rollout.version})
    tracker.log_timings(step, {**rollout.timings, "train_s": metrics.get("perf/train_s", 0.0), "reduce_s": reduce_s,
                               "step_s": metrics["perf/step_s"]}, rollout.rollout_timings)
    if not all(math.isfinite(value) for name, value in metrics.items() if name.endswith("loss")):
        engine.close()  # before the process group goes: its shutdown needs it
        fail(f"non-finite loss at step {step}; the last checkpoint is left as it was")
    metrics.update(rollout.rollout_metrics)
    if evaluation_due(step, args.eval_every, args.total_steps):
        metrics.update(evaluation(engine, run))
    tracker.log(step, metrics)
    shown = {"score": "train/score", "acc": "train/accuracy", "eval_acc": "eval/accuracy",
             "tok/s": "perf/rollout_tokens_per_s"}
    tracker.progress(step, args.total_steps, {label: metrics[key] for label, key in shown.items() if key in metrics})
    group = run.layout.world if run.layout else None  # the split layout: the rollout ranks meet here too
    stop = step_boundary(tracker.write_failure, group, engine.close)
    stopping = stop is not None and step < args.total_steps
    if stopping or checkpoint_due(args, step):
        started = time.time()
        try:
            saved, failure = save_training_checkpoint(tracker.run_dir / "checkpoints", step, trained, run.tokenizer,
                                                      args, extra, getattr(engine, "in_flight", None)), None
        except CheckpointWriteFailed as error:
            saved, failure = None, str(error)
        step_boundary(failure, group, engine.close)  # every rank, the rollout ranks too, learns how it went
        if run.rank == 0:  # a preemption's grace period must cover a step (perf/step_s) and this
            get_logger(0).info(f"checkpoint {saved.name} written in {time.time() - started:.1f} s")
    if stopping:
        preempted(stop, step, saved, run.rank, tracker.write_json, lambda: shut_down(run, engine, tracker))


def checkpoint_due(args: LLMArgs, step: int) -> bool:
    return bool(args.save_every and step % args.save_every == 0) or step == args.total_steps


def shut_down(run: LLMRun, engine: object, tracker: RunTracker) -> None:
    """Logs closed, the engine stopped, the process group left."""
    tracker.close()
    engine.close()
    if dist.is_initialized():  # vLLM's shutdown may already have taken the group down
        dist.destroy_process_group()


def finish(run: LLMRun, engine: object, tracker: RunTracker, policy: torch.nn.Module,
           metrics: dict[str, float]) -> None:
    """final.json (the last step's metrics and the sha256 of the final parameters), then an orderly shutdown (a
    failed write stops every trainer rank with its message)."""
    final_hash = final_parameter_hash(policy)
    tracker.write_json("final.json", {"step": run.args.total_steps, "parameter_sha256": final_hash, **metrics})
    tracker.close()
    step_boundary(tracker.write_failure, before_exit=engine.close)
    get_logger(run.rank).info(f"done: held-out greedy accuracy {metrics.get('eval/accuracy', float('nan')):.4f}, "
                              f"parameters sha256 {final_hash[:16]}")
    shut_down(run, engine, tracker)
