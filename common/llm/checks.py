"""The checks every LLM script shares: `check_llm_args` refuses bad flags on every rank before any collective (each
script adds its own after it), and `mismatch_alarm` watches, at every step, that the trainer and the rollout engine
compute the same model."""

import importlib.util
import os

import torch

from common.distributed import fail, local_world_size
from common.llm.engines import engine_kind, nvlinked, tensor_parallel_problem
from common.llm.lora import VLLM_MAX_LORA_RANKS, targets_problem
from common.llm.models import fsdp_shard_size
from common.llm.run import LLMArgs, LLMRun, Rollout
from common.preemption import stop_signals_problem


def check_llm_args(args: LLMArgs, world_size: int, device_type: str | None = None) -> None:
    """The checks every LLM script shares; each script adds its own. Runs on every rank before any collective.
    `device_type`: where the run will compute (None: CUDA when a GPU is visible, as init_distributed decides)."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
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
    if engine_kind(args.rollout_engine) == "vllm" and args.deterministic and tp > 2 and torch.cuda.is_available():
        node = int(os.environ.get("RANK", "0")) // per_node  # this node's groups: every rank of a node asks the same
        local_groups = [range(first % per_node, first % per_node + tp)  # as devices: torchrun's LOCAL_RANK
                        for first in range(world_size - generators, world_size, tp) if first // per_node == node]
        if problem := tensor_parallel_problem(tp, all(nvlinked(list(group)) for group in local_groups)):
            fail(problem)
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
    if args.lora_rank < 0 or (args.lora_rank and not args.lora_alpha > 0):
        fail(f"--lora-rank must be non-negative and --lora-alpha positive, got {args.lora_rank} and {args.lora_alpha}")
    if (args.lora_merge or args.export_merged) and not args.lora_rank:
        fail("--lora-merge and --export-merged merge LoRA adapters: they need --lora-rank")
    if args.lora_rank > VLLM_MAX_LORA_RANKS[-1] and not args.lora_merge and engine_kind(args.rollout_engine) == "vllm":
        fail(f"--lora-rank {args.lora_rank}: vLLM serves adapters up to rank {VLLM_MAX_LORA_RANKS[-1]} (its "
             f"max_lora_rank takes {', '.join(map(str, VLLM_MAX_LORA_RANKS))}); use a smaller rank or --lora-merge")
    if args.lora_rank and (problem := targets_problem(None, tuple(args.lora_target_modules))):
        fail(problem)
    if args.lora_rank and not args.lora_merge and engine_kind(args.rollout_engine) == "vllm" and \
            device_type == "cuda" and args.dtype == "float32":  # the CPU serves LoRA with torch ops, any dtype
        fail("--lora-rank with --dtype float32 on a GPU: vLLM serves adapters there with Triton kernels that take "
             "float16 or bfloat16 only (vllm 0.32 asserts it in vllm/lora/ops/triton_ops/lora_shrink_op.py). Pass "
             "--dtype bfloat16 (the adapters and their optimizer stay float32), or --lora-merge (the engine gets "
             "merged weights, in float32)")



# Mean |log pi_trainer - log pi_engine| of the sampled tokens beyond which the two do not compute the same model:
# about 100 times what rounding gives where they do (float32: 1e-7 to 1e-6 on every family vLLM-CPU runs in float32
# here; bfloat16: about 2e-3; docs/models.md has each family's).
MISMATCH_LIMITS = {"float32": 1e-3, "bfloat16": 2e-2}


def mismatch_alarm(run: LLMRun, step: int, rollout: Rollout, metrics: dict[str, float]) -> str | None:
    """What to say, once per run, when the engine's logprobs of its own samples leave the trainer's by more than the
    dtype explains (MISMATCH_LIMITS), with the likely causes; None otherwise, and for samples of older weights (the
    split layout one step off, whose gap is the update's). The metrics are reduced already: every rank decides
    alike."""
    mean = metrics.get("mismatch/logprob_abs_diff_mean")
    if mean is None or rollout.version != step - 1 or run.mismatch_warned:
        return None
    if mean <= MISMATCH_LIMITS[run.args.dtype]:
        run.mismatch_clean_steps += 1
        return None
    run.mismatch_warned = True
    synced = step > 1 or run.resume_dir is not None  # a fresh run's first samples come from the files themselves
    causes = [f"a weight the sync did not reach (the {run.mismatch_clean_steps} step(s) before agreed)"
              if run.mismatch_clean_steps and synced else "the engine and the trainer computing the model "
              "differently from the same weights (an attention variant, a kernel, the dtype)"]
    if run.family.num_experts:
        causes.append("MoE routing: the engine's experts are not the trainer's (--routing-replay)")
    if run.family.sliding_window or run.family.attention_sinks:
        causes.append("the family's attention in packed rows (compare --no-share-prompts)")
    return (f"step {step}: the trainer's logprobs of the engine's samples differ from the engine's by "
            f"{mean:.2e} on average (max {metrics.get('mismatch/logprob_abs_diff_max', float('nan')):.2e}), beyond "
            f"the {MISMATCH_LIMITS[run.args.dtype]:g} that {run.args.dtype} rounding explains, for "
            f"{run.family.describe()}; likely: {'; '.join(causes)}")
