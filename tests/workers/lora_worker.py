"""Run by tests/test_lora.py under plain python (world size 1) and under torchrun with 2 ranks (gloo, CPU): the embedded
model loaded by load_model with LoRA adapters (rank 8 on every attention and MLP projection), as the scripts load
it. Rank 0 writes what it found as JSON:
- `initial_hash`: the adapters' hash as loaded (the same at any world size when A is drawn before sharding);
- `base_logprobs_equal`: the adapted model's logprobs at the start (B = 0) equal, bit for bit, the unadapted model's;
- `reference_equal`: the policy's logprobs with its adapters switched off equal a separately loaded frozen reference's
  after one update moved the adapters (`moved`: they differ with the adapters on);
- `layers_with_gradient` / `adapted_layers`: the adapted layers whose A or B received a non-zero gradient;
- `trained_dtypes`, `frozen_dtypes`, `optimized`: in bfloat16, the adapters' float32 masters beside the base held in
  bfloat16 in one FSDP unit, and how many tensors AdamW holds (the adapters alone); `bf16_step`: the bfloat16 model
  took a step.

    python tests/workers/lora_worker.py SUMMARY.json
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/workers/lora_worker.py SUMMARY.json
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from transformers.utils import logging as transformers_logging

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.distributed import init_distributed  # noqa: E402
from common.llm.batching import make_batch, token_logprobs  # noqa: E402
from common.llm.lora import LoRASpec, adapters_disabled, default_targets, lora_layers  # noqa: E402
from common.llm.models import final_parameter_hash, load_model, make_optimizer, optimizer_step  # noqa: E402

TINY = str(ROOT / "assets" / "tiny-adder")
CPU = torch.device("cpu")
SPEC = LoRASpec(rank=8, alpha=16.0, targets=default_targets(TINY), seed=1)


def model_args(dtype: str) -> SimpleNamespace:
    """The fields load_model, shard_model and make_optimizer read."""
    return SimpleNamespace(dtype=dtype, gradient_checkpointing=False, reshard_after_forward=False, fsdp_shard_size=0,
                           weight_decay=0.0, warmup_steps=0, lr_schedule="constant")


def rank_batch(rank: int) -> object:
    generator = torch.Generator().manual_seed(200 + rank)
    prompts = [torch.randint(3, 15, (int(length),), generator=generator).tolist() for length in (3, 5, 4, 2)]
    completions = [torch.randint(1, 15, (int(length),), generator=generator).tolist() for length in (4, 1, 3, 6)]
    return make_batch(prompts, completions, pad_id=0, device=CPU)


def main() -> None:
    transformers_logging.disable_progress_bar()
    rank, world_size, _ = init_distributed()
    torch.manual_seed(0)
    summary: dict[str, object] = {"world_size": world_size}
    batch = rank_batch(rank)
    args = model_args("float32")
    policy = load_model(TINY, args, CPU, lora=SPEC)
    optimizer, scheduler = make_optimizer(policy, args, 1e-2, 10)  # before any forward, as the scripts: over shards
    plain = load_model(TINY, args, CPU, trainable=False)  # the unadapted model: the reference
    summary["initial_hash"] = final_parameter_hash(policy)
    with torch.no_grad():
        summary["base_logprobs_equal"] = torch.equal(token_logprobs(policy, batch, 1.0),
                                                     token_logprobs(plain, batch, 1.0))
    loss = -(token_logprobs(policy, batch, 1.0) * batch.mask).sum()
    (loss * world_size).backward()
    layers = lora_layers(policy)
    summary["adapted_layers"] = len(layers)
    summary["layers_with_gradient"] = sum(
        any(p.grad is not None and bool((p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).abs()
                                        .sum() > 0) for p in (layer.lora_A, layer.lora_B))
        for layer in layers.values())
    summary["frozen_with_gradient"] = sum(p.grad is not None for p in policy.parameters() if not p.requires_grad)
    optimizer_step(policy, optimizer, scheduler, 1.0, 1)
    with torch.no_grad():
        adapted, reference = token_logprobs(policy, batch, 1.0), token_logprobs(plain, batch, 1.0)
        with adapters_disabled(policy):
            switched_off = token_logprobs(policy, batch, 1.0)
    summary["moved"] = not torch.equal(adapted, reference)
    summary["reference_equal"] = torch.equal(switched_off, reference)

    bf16 = load_model(TINY, model_args("bfloat16"), CPU, lora=SPEC)
    bf16_optimizer, bf16_scheduler = make_optimizer(bf16, model_args("bfloat16"), 1e-2, 10)
    summary["trained_dtypes"] = sorted({str(p.dtype) for p in bf16.parameters() if p.requires_grad})
    summary["frozen_dtypes"] = sorted({str(p.dtype) for p in bf16.parameters() if not p.requires_grad})
    summary["optimized"] = sum(len(group["params"]) for group in bf16_optimizer.param_groups)
    (-(token_logprobs(bf16, batch, 1.0) * batch.mask).sum()).backward()
    norm, _ = optimizer_step(bf16, bf16_optimizer, bf16_scheduler, 1.0, 1)
    summary["bf16_step"] = norm > 0
    if rank == 0:
        Path(sys.argv[1]).write_text(json.dumps(summary))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
