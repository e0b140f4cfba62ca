"""The run around the algorithm in grpo_llm.py, dpo_online.py and ppo_llm.py: the flags they share (`LLMArgs`) and
the calls their loops make in the same order, written once because the order carries rules: `prepare_run` seeds
before any engine exists; `start_training` starts the engine (which reseeds every RNG, so --seed is applied again),
then restores a checkpoint's shards and RNG states, then gives the engine its first weights by the same path as every
step's `sync_weights`; `generate` puts the engine to sleep before training; `end_step` stops on a non-finite loss
before anything is written."""

import importlib.util
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from common.batching import TokenBatch, make_batch
from common.checkpoint import load_training_checkpoint, read_training_state, save_training_checkpoint
from common.determinism import (
    effective_determinism_env,
    parameter_hash,
    python_kernels,
    reroute_composite_autograd,
    restore_rng_states,
    seed_everything,
    seed_rngs,
)
from common.distributed import fail, init_distributed, nccl_record
from common.models import stream_weights
from common.rollout import Sample, engine_kind, make_engine, sample_seed
from common.scoring import RewardModel, decode_completion, evaluate, task_scores
from common.tasks import Example, Task, make_task
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
    task: str = "addition"  # `addition` (embedded), `gsm8k` (openai/gsm8k), or a dataset in GSM8K's format
    dtype: Literal["float32", "bfloat16"] = "float32"  # of rollouts and compute; master weights stay float32
    # --- the loop: steps, prompts, samples ---
    total_steps: int = 400  # steps, each: rollouts, then the update
    prompts_per_step: int = 64  # prompts per step across all ranks
    num_generations: int = 8  # G: completions sampled per prompt
    max_prompt_length: int = 512  # prompts longer than this (in tokens) are dropped from the dataset
    max_completion_length: int = 8  # maximum tokens sampled per completion
    temperature: float = 1.0  # sampling temperature; logprobs (rollout and trainer) are taken after it
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
    # --- rollout engine ---
    rollout_engine: Literal["auto", "vllm", "hf"] = "auto"  # `auto` = vLLM when installed, else transformers
    vllm_tp: int = 1  # tensor-parallel size of each vLLM engine (groups of contiguous ranks)
    vllm_kv_cache_memory_bytes: int = 64 * 2**20  # KV-cache size of the vLLM engine on CPU
    vllm_gpu_memory_utilization: float = 0.3  # share of GPU memory vLLM may take on CUDA (the trainer needs the rest)
    # --- evaluation, logs, checkpoints ---
    eval_every: int = 20  # held-out greedy evaluation every this many steps (and before the first and after the last)
    num_eval_prompts: int = 500  # held-out prompts per evaluation (0 = the whole test split)
    track: bool = False  # mirror the TensorBoard logs to Weights & Biases
    wandb_project_name: str = "rl-repro"  # the Weights & Biases project, with --track
    run_root: str = "runs"  # where run directories are created
    save_every: int = 0  # checkpoint every this many steps (0 = only at the end)
    keep_last: int = 2  # checkpoints kept (older ones are deleted after a newer one is complete); 0 keeps all
    resume: str | None = None  # a checkpoint (or checkpoints/) to continue, in its run directory, with the same args


# Arguments a resumed run may change: where and how it reports, not what it computes.
MAY_CHANGE_ON_RESUME = ("resume", "run_root", "exp_name", "track", "wandb_project_name", "eval_every",
                        "num_eval_prompts", "save_every", "keep_last", "vllm_kv_cache_memory_bytes",
                        "vllm_gpu_memory_utilization")  # not the engine: vLLM and transformers draw other samples


def check_llm_args(args: LLMArgs, world_size: int) -> None:
    """The checks every LLM script shares; each script adds its own. Runs on every rank before any collective."""
    for name in ("total_steps", "prompts_per_step", "num_generations", "micro_batch_size", "max_completion_length",
                 "vllm_tp", "max_prompt_length", "learning_rate", "temperature"):
        if not getattr(args, name) > 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.prompts_per_step % world_size:
        fail(f"--prompts-per-step {args.prompts_per_step} must be divisible by the world size {world_size}")
    if world_size % args.vllm_tp:
        fail(f"--vllm-tp {args.vllm_tp} must divide the world size {world_size}")
    if min(args.eval_every, args.save_every, args.keep_last, args.num_eval_prompts, args.warmup_steps) < 0:
        fail("--eval-every, --save-every, --keep-last, --num-eval-prompts and --warmup-steps must be non-negative")
    if args.track and importlib.util.find_spec("wandb") is None:
        fail("--track needs Weights & Biases: pip install wandb")
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
    pad_id: int
    resume_dir: Path | None
    resume_state: dict | None  # the checkpoint's trainer_state.pt: step, args, world size, RNG states, extra state


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
    determinism = seed_everything(args.seed, args.deterministic)
    args.rollout_engine = engine_kind(args.rollout_engine)  # recorded and compared on resume as the engine that ran
    rank, world_size, device = init_distributed()
    resume_dir, resume_state = read_training_state(args, world_size, MAY_CHANGE_ON_RESUME) if args.resume else \
        (None, None)
    try:
        AutoConfig.from_pretrained(args.model_name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    except (OSError, ValueError) as error:
        fail(f"cannot load model {args.model_name_or_path!r}: {error}")
    try:
        task = make_task(args.task)
    except Exception as error:  # datasets raises many types for a missing dataset
        fail(f"cannot load task {args.task!r}: {error}")

    def encode(examples: list[Example]) -> list[list[int]]:
        texts = [task.format_prompt(tokenizer, example) for example in examples]
        return tokenizer(texts, add_special_tokens=not getattr(tokenizer, "chat_template", None)).input_ids

    train_ids = encode(task.train)
    keep = [i for i, ids in enumerate(train_ids) if len(ids) <= args.max_prompt_length]
    if len(keep) < args.prompts_per_step:
        fail(f"only {len(keep)} training prompts fit --max-prompt-length {args.max_prompt_length}")
    eos_ids = eos_token_ids(args.model_name_or_path, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    return LLMRun(args, rank, world_size, device, determinism, task, tokenizer, [task.train[i] for i in keep],
                  [train_ids[i] for i in keep], task.test, [ids[-args.max_prompt_length:] for ids in encode(task.test)],
                  eos_ids, pad_id, resume_dir, resume_state)


def start_training(run: LLMRun, trained: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]],
                   schedulers: list[torch.optim.lr_scheduler.LambdaLR], updates_per_step: int
                   ) -> tuple[object, RunTracker, int]:
    """This rank's rollout engine, the checkpoint resumed from (shards back into the models and optimizers of
    `trained`, the schedules fast-forwarded, this rank's RNG states), the run directory, and the engine's first
    weights. Returns the engine, the tracker and the last completed step (0 for a fresh run)."""
    args = run.args
    max_model_len = max(map(len, run.train_ids + run.test_ids)) + args.max_completion_length
    if run.device.type == "cuda":  # loading held one full tensor at a time; vLLM sizes itself from free memory
        torch.cuda.empty_cache()
    engine = make_engine(args.rollout_engine, args.model_name_or_path, args.dtype, args.vllm_tp, max_model_len,
                         run.device, args.vllm_kv_cache_memory_bytes, args.vllm_gpu_memory_utilization)
    seed_rngs(args.seed)  # starting vLLM reseeded python, numpy and torch with the engine's seed
    rerouted = reroute_composite_autograd(run.device.type)  # vLLM's kernels for linear / matmul (GPUs of SM 8.x)
    start_step = run.resume_state["step"] if run.resume_state else 0
    if start_step:  # after the engine, whose start would overwrite the restored RNG states
        load_training_checkpoint(run.resume_dir, trained)
        for scheduler in schedulers:  # a pure function of the update count
            for _ in range(start_step * updates_per_step):
                scheduler.step()
        restore_rng_states(run.resume_state["rng"][run.rank])
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
    log.info(f"world size {run.world_size}, {type(engine).__name__} (model runner {runner}), {len(run.train_ids)} "
             f"train / {len(run.test_ids)} test prompts, starting after step {start_step}")
    if start_step:  # the same weight path into the engine as the uninterrupted run took
        sync_weights(engine, trained["policy"][0], args.dtype)
    else:
        metrics = evaluate(engine, run, args.num_eval_prompts, args.max_completion_length)
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
    task_scores: torch.Tensor  # [rows] the task's verifiable reward of each completion (1.0 = correct)
    started: float  # wall clock at the start of the step
    seconds: float  # generation time, this rank


def generate(engine: object, run: LLMRun, step: int) -> Rollout:
    """This rank's prompts of `step`, each sampled G times with its own seed from its global coordinates (step,
    prompt, sample), so no sample depends on which rank draws it or beside whom; then the engine sleeps (on CUDA
    this frees its memory for training) and the task scores every completion."""
    args, started = run.args, time.time()
    indices, first = prompts_for_rank(step, args.seed, len(run.train_ids), args.prompts_per_step, run.rank,
                                      run.world_size)
    group = range(args.num_generations)
    prompts = [run.train_ids[i] for i in indices for _ in group]
    examples = [run.train[i] for i in indices for _ in group]
    seeds = [sample_seed(args.seed, step, first + p, i) for p in range(len(indices)) for i in group]
    samples = engine.generate(prompts, seeds, args.max_completion_length, args.temperature, run.eos_ids)
    engine.sleep()
    seconds = time.time() - started
    texts = [decode_completion(run.tokenizer, sample.completion_ids, run.eos_ids) for sample in samples]
    scores = torch.tensor(task_scores(run.task.reward, examples, texts))
    return Rollout(prompts, examples, samples, [s.completion_ids for s in samples], texts, scores, started, seconds)


def judge(reward_model: RewardModel | None, rollout: Rollout) -> torch.Tensor:
    """One score per completion: the reward model's when there is one, else the task's verifiable reward."""
    return rollout.task_scores if reward_model is None else reward_model(rollout.examples, rollout.texts)


def split(rows: list[int] | range, size: int) -> list[list[int] | range]:
    """Consecutive pieces of at most `size` rows (micro-batches; the last may be smaller), like `Tensor.split`."""
    return [rows[start:start + size] for start in range(0, len(rows), size)]


def micro_batches(rollout: Rollout, pieces: list[list[int] | range], run: LLMRun, share_prompts: bool = False
                  ) -> list[TokenBatch]:
    """One TokenBatch per list of rows, on the device, with the engine's logprobs of those rows' tokens."""
    return [make_batch([rollout.prompts[r] for r in rows], [rollout.samples[r].completion_ids for r in rows],
                       run.pad_id, run.device, share_prompts, [rollout.samples[r].logprobs for r in rows])
            for rows in pieces]


def sync_weights(engine: object, policy: torch.nn.Module, dtype: str) -> float:
    """Stream the policy's full weights from the FSDP shards into the rollout engine, in the rollout dtype. Returns
    the seconds it took."""
    started = time.time()
    engine.update_weights(stream_weights(policy, getattr(torch, dtype)))
    return time.time() - started


def end_step(run: LLMRun, engine: object, tracker: RunTracker, step: int, rollout: Rollout,
             metrics: dict[str, float], trained: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]],
             extra: dict | None = None) -> None:
    """After the update and the weight sync: stop on a non-finite loss (the last checkpoint is left as it was),
    evaluate when due, log the step, and checkpoint when due (`extra`: state the algorithm carries between steps)."""
    args = run.args
    metrics["perf/step_s"] = time.time() - rollout.started
    if not all(math.isfinite(value) for name, value in metrics.items() if name.endswith("loss")):
        fail(f"non-finite loss at step {step}; the last checkpoint is left as it was")
    if step == args.total_steps or (args.eval_every and step % args.eval_every == 0):
        metrics.update(evaluate(engine, run, args.num_eval_prompts, args.max_completion_length))
    tracker.log(step, metrics)
    shown = {"score": "train/score", "acc": "train/accuracy", "eval_acc": "eval/accuracy",
             "tok/s": "perf/rollout_tokens_per_s"}
    tracker.progress(step, args.total_steps, {label: metrics[key] for label, key in shown.items() if key in metrics})
    if (args.save_every and step % args.save_every == 0) or step == args.total_steps:
        save_training_checkpoint(tracker.run_dir / "checkpoints", step, trained, run.tokenizer, args, extra)


def finish(run: LLMRun, engine: object, tracker: RunTracker, policy: torch.nn.Module,
           metrics: dict[str, float]) -> None:
    """final.json (the last step's metrics and the sha256 of the final parameters), then an orderly shutdown."""
    final_hash = parameter_hash(policy)
    tracker.write_json("final.json", {"step": run.args.total_steps, "parameter_sha256": final_hash, **metrics})
    get_logger(run.rank).info(f"done: held-out greedy accuracy {metrics.get('eval/accuracy', float('nan')):.4f}, "
                              f"parameters sha256 {final_hash[:16]}")
    tracker.close()
    engine.close()
    if dist.is_initialized():  # vLLM's shutdown may already have taken the group down
        dist.destroy_process_group()
