"""Per-rank peak memory of one training step of grpo_llm.py, dpo_online.py and ppo_llm.py at real sizes, without a GPU.

The step runs on fake tensors (FakeTensorMode: shapes and dtypes, no data, no arithmetic) over a fake process group of
world size N (torch's `fake` backend: collectives return at once) on the CPU device, while torch's FSDPMemTracker
records every tensor alive and its kind. The models are built from their configs (no download) and sharded by
common/models.py's shard_model, as the scripts shard them; the step is the scripts' own code: token_logprobs (float32
head), PPO's predicted_values, the losses, backward, gradient clipping and AdamW, for two micro-batches (the second
one meets the gradients of the first) after one untracked warm-up step (which creates the optimizer state).

What the CPU device would get wrong about a GPU is attention: with a mask, CPU SDPA runs its math kernel, which keeps
[B, heads, L, L] scores for backward, while on GPUs SDPA's memory-efficient kernel keeps O(L). So for the GPU table
`scaled_dot_product_attention` is replaced by a stand-in that allocates what that kernel allocates (the output and a
float32 logsumexp forward, kept for backward with q, k, v; the three input gradients backward); transformers' own
code around it (its mask, its copies of the key/value heads for grouped-query attention) runs unchanged. Not counted:
the CUDA context (about 0.5 GB), cuBLAS/NCCL workspaces, allocator fragmentation, and vLLM's share of the GPU (its
weights and KV cache, written below the table as arithmetic).

    python benchmarks/memory_estimate.py                  # the table (2 models x 3 scripts x N x checkpointing)
    python benchmarks/memory_estimate.py --models qwen2.5-0.5b --scripts grpo --world-sizes 8
    python benchmarks/memory_estimate.py --validate       # the estimate against the same real step on CPU

`--validate` runs the embedded model and SmolLM2-135M-Instruct (assets/build_smollm2.py, built on first use) with
the CPU's own SDPA, once on fake tensors (the estimate) and once on real ones: the peak of the live tensors the same
tracker sees over the real step (a CPU has no counter like torch.cuda.max_memory_allocated), and the growth of the
process's peak resident memory over that step as a cross-check that includes what no tensor shows.
"""

import argparse
import contextlib
import copy
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.batching import make_batch, token_logprobs  # noqa: E402
from common.llm_run import LLMArgs  # noqa: E402
from common.models import make_optimizer, shard_model  # noqa: E402

GIB = 2**30
# Hugging Face configs of Qwen2.5-0.5B(-Instruct) and Qwen2.5-7B(-Instruct), their sizes only.
MODELS = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
# benchmarks/README.md's GPU commands: completions per micro-batch, prompt and completion lengths, which models
WORKLOADS = {
    "grpo": dict(micro_batch=8, prompt=512, completion=1024, reference=False, value=False),  # --beta 0
    "dpo": dict(micro_batch=8, prompt=512, completion=1024, reference=True, value=False),
    "ppo": dict(micro_batch=8, prompt=512, completion=256, reference=True, value=True),
}
# the tracker's kinds, grouped as the README reports them
GROUPS = {"parameters": ("Sharded Param", "Unsharded Param", "Buffer", "All Gather"),
          "gradients": ("Sharded Grad", "Unsharded Grad", "Reduce Scatter"), "optimizer": ("OptState",),
          "activations": ("Activation",), "temporaries": ("Temp", "Inputs")}


class _MemoryEfficientAttention(torch.autograd.Function):
    """The allocations of SDPA's memory-efficient CUDA kernel, without its arithmetic (fake tensors hold no values)."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        output = torch.empty_like(query)
        logsumexp = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, output, logsumexp)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, key, value, _, _ = ctx.saved_tensors
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def gpu_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: object, **kwargs: object
                  ) -> torch.Tensor:
    return _MemoryEfficientAttention.apply(query, key, value)


def fake_world(world_size: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def real_world() -> None:
    from common.distributed import init_distributed

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    if dist.is_initialized():
        dist.destroy_process_group()
    init_distributed()


def build(config: object, args: LLMArgs, trainable: bool, value_head: bool = False) -> torch.nn.Module:
    """The scripts' model, from its config on the meta device, sharded and allocated (empty) as shard_model does."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    model_class = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
    with torch.device("meta"):
        model = model_class.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    shard_model(model, args, torch.device("cpu"), trainable)
    return model.eval().requires_grad_(trainable)


def run_step(script: str, models: dict, optimizers: list, batches: list, on_forward: object) -> None:
    """One training step of `script` over `batches` (its micro-batches), as the script runs it: the same forwards
    (with and without gradient, in the same order), losses, backward, clipping, resharding and AdamW.
    `on_forward(model)` runs before each model call (the tracker takes one forward per module otherwise)."""
    from torch.distributed.fsdp import FSDPModule

    from dpo_online import dpo_loss, sequence_logprobs
    from grpo_llm import aggregate_loss, grpo_token_loss, truncated_is_weight
    from ppo_llm import policy_loss, predicted_values, value_loss

    policy, reference, value_model = models["policy"], models.get("reference"), models.get("value")
    if script == "ppo":  # one pass without gradients first: pi_old (and its entropy), V_old, pi_ref
        with torch.no_grad():
            for batch in batches:
                on_forward(policy)
                token_logprobs(policy, batch, 1.0, with_entropy=True)
                on_forward(value_model)
                predicted_values(value_model, batch)
                on_forward(reference)
                token_logprobs(reference, batch, 1.0)
    for batch in batches:
        rows, num_tokens = batch.mask.shape[0], float(batch.head_rows.numel())  # the model's tokens (a shape)
        if script == "dpo":
            on_forward(reference)
            with torch.no_grad():
                ref_logprobs = token_logprobs(reference, batch, 1.0)
        on_forward(policy)
        logprobs = token_logprobs(policy, batch, 1.0)
        if script == "grpo":
            is_weight = truncated_is_weight(logprobs.detach(), batch.rollout_logprobs, 2.0)
            per_token = grpo_token_loss(logprobs - logprobs.detach(), is_weight, logprobs, None, torch.ones(rows, 1),
                                        0.2, 0.28, 0.0)
            loss = aggregate_loss(per_token, batch.mask, "dapo", rows, int(num_tokens), batch.mask.shape[1])
        elif script == "dpo":
            loss = dpo_loss(sequence_logprobs(logprobs, batch.mask, "sigmoid"),
                            sequence_logprobs(ref_logprobs, batch.mask, "sigmoid"), torch.ones(rows // 2), 0.1,
                            "sigmoid", rows // 2)
        else:
            on_forward(value_model)
            values = predicted_values(value_model, batch)
            is_weight = truncated_is_weight(logprobs.detach(), batch.rollout_logprobs, 2.0)
            loss = (policy_loss(torch.exp(logprobs - logprobs.detach()), is_weight, torch.ones_like(logprobs),
                                batch.mask, 0.2, num_tokens)
                    + 0.1 * value_loss(values, values.detach(), torch.zeros_like(values), batch.mask, 0.5, num_tokens))
        loss.backward()
    for model, optimizer in optimizers:  # common/models.py's optimizer_step, without reading the norm's value
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def measure(config: object, script: str, workload: dict, args: LLMArgs, fake: bool, attention: object = None
            ) -> dict[str, float]:
    """The tracked step's peak by group (bytes), and the growth of peak RSS over it (MB; real tensors only)."""
    import torch.distributed.device_mesh as device_mesh
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    mesh = device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))  # outside fake mode: it reads tensors
    make_mesh, device_mesh.init_device_mesh = device_mesh.init_device_mesh, lambda *args, **kwargs: mesh
    generator = torch.Generator().manual_seed(0)  # the batch is real (index work), the models and the step fake
    vocabulary = min(config.vocab_size, 1000)
    prompt = torch.randint(3, vocabulary, (workload["prompt"],), generator=generator).tolist()
    completion = torch.randint(3, vocabulary, (workload["completion"],), generator=generator).tolist()
    rows = workload["micro_batch"]
    # multi-turn (--env-token-fraction f): the middle f of each completion is environment tokens, attended to (the
    # activations count every token) but with loss mask 0, so the float32 head runs on the model's rows only
    env = round(workload.get("env_fraction", 0.0) * len(completion))
    first = (len(completion) - env) // 2
    loss_mask = [1] * first + [0] * env + [1] * (len(completion) - env - first) if env else None
    batch = make_batch([prompt] * rows, [completion] * rows, 0, torch.device("cpu"),
                       rollout_logprobs=[[-1.0] * len(completion)] * rows, loss_masks=[loss_mask] * rows)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if attention is not None:
        torch.nn.functional.scaled_dot_product_attention = attention
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
            models = {"policy": build(config, args, trainable=True)}
            if workload["reference"]:
                models["reference"] = build(config, args, trainable=False)
            if workload["value"]:
                value_config = copy.deepcopy(config)
                value_config.num_labels, value_config.classifier_dropout = 1, 0.0  # as ppo_llm.ValueModel
                models["value"] = build(value_config, args, trainable=True, value_head=True)
            optimizers = [(models[name], make_optimizer(models[name], args, 1e-6, 10)[0])
                          for name in ("policy", "value") if name in models]
            run_step(script, models, optimizers, [batch], lambda model: None)  # warm-up: creates the optimizer state
            tracker = FSDPMemTracker(models["policy"], optimizers[0][1])
            # the tracker follows the policy's FSDP state and whatever the step allocates; the other models' shards
            # and optimizer state exist before it and stay as they are through the step: added as they are
            others = sum(_local_bytes(model.parameters()) for name, model in models.items() if name != "policy") + \
                sum(_local_bytes(t for state in optimizer.state.values() for t in state.values()
                                 if isinstance(t, torch.Tensor)) for _, optimizer in optimizers[1:])
            rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            with tracker:
                run_step(script, models, optimizers, [batch, batch],  # a module's second forward: stats anew
                         lambda model: tracker.reset_mod_stats() if model in tracker.memory_tracking else None)
            rss_growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
            snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
        device_mesh.init_device_mesh = make_mesh
    kinds = {getattr(kind, "value", str(kind)): float(size) for kind, size in snapshot.items()}
    grouped = {group: sum(kinds.get(kind, 0.0) for kind in names) for group, names in GROUPS.items()}
    grouped["other"] = float(others)
    return {**grouped, "total": kinds.pop("Total") + others, "kinds": kinds, "rss_growth_mb": rss_growth}


def _local_bytes(tensors: object) -> int:
    """Bytes this rank holds of `tensors` (a DTensor's local shard)."""
    return sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in tensors)


def qwen_config(name: str) -> object:
    from transformers import AutoConfig

    return AutoConfig.for_model("qwen2", **MODELS[name], max_position_embeddings=32768, rope_theta=1e6,
                                rms_norm_eps=1e-6)


def gib(size: float) -> str:
    return f"{size / GIB:.2f}"


def table(model_names: list[str], scripts: list[str], world_sizes: list[int], out: Path, env_fraction: float = 0.0
          ) -> None:
    rows = []
    for model_name in model_names:
        config = qwen_config(model_name)
        for script in scripts:
            for world_size in world_sizes:
                fake_world(world_size)
                for checkpointing in (False, True):
                    args = LLMArgs(dtype="bfloat16", reshard_after_forward=True,
                                   gradient_checkpointing=checkpointing)
                    started = time.time()
                    peak = measure(config, script, {**WORKLOADS[script], "env_fraction": env_fraction}, args,
                                   fake=True, attention=gpu_attention)
                    rows.append({"model": model_name, "script": script, "world_size": world_size,
                                 "gradient_checkpointing": checkpointing, **peak,
                                 "seconds": round(time.time() - started, 1)})
                    print(json.dumps(rows[-1]), flush=True)
    write_table(rows, out)


def write_table(rows: list[dict], out: Path) -> None:
    """results.json and table.md in `out`; rows from earlier runs there (other models, scripts or N) are kept."""
    out.mkdir(parents=True, exist_ok=True)
    key = ("model", "script", "world_size", "gradient_checkpointing")
    if (out / "results.json").exists():
        earlier = json.loads((out / "results.json").read_text())["rows"]
        rows = [row for row in earlier if tuple(row[k] for k in key) not in {tuple(r[k] for k in key) for r in rows}] \
            + rows
    order = {name: index for index, name in enumerate([*MODELS, *WORKLOADS])}
    rows.sort(key=lambda row: (order[row["model"]], order[row["script"]], row["world_size"],
                               row["gradient_checkpointing"]))
    (out / "results.json").write_text(json.dumps({"command": "python benchmarks/memory_estimate.py",
                                                  "workloads": WORKLOADS, "models": MODELS, "rows": rows},
                                                 indent=1) + "\n")
    lines = ["| model | script | N | checkpointing | parameters | gradients | optimizer | activations | temporaries "
             "| other models' shards and optimizer state | peak (GiB) |", "|---" * 11 + "|"]
    for row in rows:
        lines.append(f"| {row['model']} | {row['script']} | {row['world_size']} | "
                     f"{'on' if row['gradient_checkpointing'] else 'off'} | "
                     + " | ".join(gib(row[group]) for group in [*GROUPS, "other"]) + f" | {gib(row['total'])} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


# CPU-sized steps for --validate: the real step runs here with the CPU's SDPA, which keeps [B, heads, L, L] scores
VALIDATION_WORKLOADS = {"grpo": dict(micro_batch=4, prompt=64, completion=192, reference=False, value=False),
                        "dpo": dict(micro_batch=4, prompt=64, completion=192, reference=True, value=False),
                        "ppo": dict(micro_batch=4, prompt=64, completion=192, reference=True, value=True)}


VALIDATION_MODELS = {"embedded": ROOT / "assets" / "tiny-adder",
                     "smollm2-135m": ROOT / "assets" / ".cache" / "smollm2-135m-instruct"}


def validate(names: list[str], scripts: list[str], out: Path) -> None:
    from transformers import AutoConfig

    if "smollm2-135m" in names and not (VALIDATION_MODELS["smollm2-135m"] / "config.json").exists():
        import subprocess

        subprocess.run([sys.executable, "-m", "assets.build_smollm2"], cwd=ROOT, check=True)
    rows = []
    for name in names:
        config = AutoConfig.from_pretrained(VALIDATION_MODELS[name])
        for script in scripts:
            workload = VALIDATION_WORKLOADS[script]
            for checkpointing in (False, True):
                args = LLMArgs(dtype="float32", reshard_after_forward=True, gradient_checkpointing=checkpointing)
                fake_world(1)
                estimate = measure(config, script, workload, args, fake=True)
                real_world()
                measured = measure(config, script, workload, args, fake=False)
                rows.append({"model": name, "script": script, "gradient_checkpointing": checkpointing,
                             "estimate": estimate, "measured": measured,
                             "error": estimate["total"] / measured["total"] - 1})
                print(json.dumps(rows[-1]), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "validation.json").write_text(json.dumps({"command": " ".join(sys.argv), "workloads":
                                                     VALIDATION_WORKLOADS, "rows": rows}, indent=1) + "\n")
    lines = ["| model | script | checkpointing | estimate (MiB) | measured: live tensors (MiB) | error | "
             "measured: peak RSS growth over the step (MiB) |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['model']} | {row['script']} | {'on' if row['gradient_checkpointing'] else 'off'} | "
                     f"{row['estimate']['total'] / 2**20:.1f} | {row['measured']['total'] / 2**20:.1f} | "
                     f"{100 * row['error']:+.1f}% | {row['measured']['rss_growth_mb']:.0f} |")
    (out / "validation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--scripts", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64, 1024])
    parser.add_argument("--validate", nargs="*", choices=list(VALIDATION_MODELS),
                        help="the estimate against the same real step on CPU, for these models (default: both)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "memory_estimate")
    parser.add_argument("--env-token-fraction", type=float, default=0.0,
                        help="multi-turn: the share of each completion that is environment tokens (loss mask 0)")
    options = parser.parse_args()
    torch.manual_seed(0)
    if options.validate is not None:
        validate(options.validate or list(VALIDATION_MODELS), options.scripts, options.out)
    else:
        table(options.models, options.scripts, options.world_sizes, options.out, options.env_token_fraction)
