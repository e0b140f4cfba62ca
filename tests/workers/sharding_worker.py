"""Run by tests/test_sharding.py under torchrun with 4 ranks (gloo, CPU): the embedded model loaded by load_model with
flat FSDP2 (shard size 4) and with HSDP (2 replicas x shard size 2, twice), the same forward/backward on each, and
stream_weights / export_pretrained from both, counting the all-gathers. Rank 0 writes what it found as JSON.

    python -m torch.distributed.run --standalone --nproc_per_node 4 tests/workers/sharding_worker.py \
        SUMMARY.json EXPORT_DIR
"""

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from transformers.utils import logging as transformers_logging

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.distributed import init_distributed  # noqa: E402
from common.llm import models  # noqa: E402
from common.llm.batching import make_batch, token_logprobs  # noqa: E402

TINY = str(ROOT / "assets" / "tiny-adder")
CPU = torch.device("cpu")
SMALL_BUCKET_BYTES = 256 * 2**10  # the tiny model is 3.4 MB in float32: about a dozen buckets


def sharding_args(shard_size: int) -> SimpleNamespace:
    """The fields load_model and shard_model read."""
    return SimpleNamespace(dtype="float32", gradient_checkpointing=False, reshard_after_forward=False,
                           fsdp_shard_size=shard_size)


def rank_batch(rank: int) -> object:
    """A fixed batch per rank (different ranks, different data: the gradient is averaged over all four)."""
    generator = torch.Generator().manual_seed(100 + rank)
    prompts = [torch.randint(3, 15, (int(length),), generator=generator).tolist() for length in (3, 5, 4, 2)]
    completions = [torch.randint(1, 15, (int(length),), generator=generator).tolist() for length in (4, 1, 3, 6)]
    return make_batch(prompts, completions, pad_id=0, device=CPU)


class CountedAllGathers:
    """Counts calls of dist.all_gather_single / all_gather_into_tensor (whichever name stream_weights uses) while
    active."""

    names = ("all_gather_single", "all_gather_into_tensor")

    def __init__(self) -> None:
        self.calls = 0
        self.originals = {name: getattr(dist, name) for name in self.names if hasattr(dist, name)}

    def __enter__(self) -> "CountedAllGathers":
        for name, original in self.originals.items():
            setattr(dist, name, self._counted(original))
        return self

    def _counted(self, original: object) -> object:
        def counted(*args: object, **kwargs: object) -> object:
            self.calls += 1
            return original(*args, **kwargs)
        return counted

    def __exit__(self, *exc: object) -> None:
        for name, original in self.originals.items():
            setattr(dist, name, original)


def full_parameters(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every parameter name (tied ones too) and its full tensor, as stream_weights used to gather them."""
    return {name: parameter.detach().to(dtype).full_tensor()
            for name, parameter in model.named_parameters(remove_duplicate=False)}


def check_stream(model: torch.nn.Module) -> dict[str, dict[str, object]]:
    """stream_weights against full_tensor() in both rollout dtypes, with small buckets and with one bucket."""
    found = {}
    for dtype in (torch.float32, torch.bfloat16):
        expected = full_parameters(model, dtype)
        parameters = list(model.named_parameters())
        total_bytes = sum(parameter.numel() * dtype.itemsize for _, parameter in parameters)
        for bucket_bytes in (SMALL_BUCKET_BYTES, 2**40):
            models.SYNC_BUCKET_BYTES = bucket_bytes
            with CountedAllGathers() as counter:
                streamed = list(models.stream_weights(model, dtype))
            once = [name for name, _ in models.stream_weights(model, dtype, tied_aliases=False)]
            found[f"{dtype}".removeprefix("torch.") + f"/{bucket_bytes}"] = {
                "bitwise_equal": bool(streamed) and all(
                    tensor.dtype == dtype and torch.equal(tensor, expected[name]) for name, tensor in streamed),
                "names_as_state": sorted(name for name, _ in streamed) == sorted(expected),
                "order_as_parameters": once == [name for name, _ in parameters],
                "collectives": counter.calls, "buckets": len(models._weight_buckets(parameters, dtype)),
                "tensors": len(parameters), "total_bytes": total_bytes, "bucket_bytes": bucket_bytes}
    models.SYNC_BUCKET_BYTES = SMALL_BUCKET_BYTES
    return found


def train_step(shard_size: int) -> tuple[dict[str, object], dict[str, torch.Tensor], torch.nn.Module]:
    """Load, two micro-batches of forward/backward on this rank's batch (half the loss each: with HSDP the replicas
    all-reduce after the second only, all_reduce_at_last); the loss, gradient norm and shard sizes, full gradients."""
    model = models.load_model(TINY, sharding_args(shard_size), CPU)
    streamed = check_stream(model)
    batch = rank_batch(dist.get_rank())
    loss = torch.zeros(())
    for micro_batch in range(2):
        models.all_reduce_at_last(micro_batch == 1, model)
        logprobs = token_logprobs(model, batch, 1.0)
        half = -(logprobs * batch.mask).sum() / batch.mask.sum() / 2
        half.backward()
        loss += half.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)  # the total norm, clips nothing
    gradients = {name: parameter.grad.full_tensor() for name, parameter in model.named_parameters()}
    mesh = model.model.embed_tokens.weight.device_mesh
    summary = {"loss": loss.item(), "grad_norm": grad_norm.full_tensor().item(), "mesh_shape": list(mesh.shape),
               "local_numel": sum(parameter.to_local().numel() for parameter in model.parameters()),
               "total_numel": sum(parameter.numel() for parameter in model.parameters()), "stream": streamed}
    return summary, gradients, model


def uneven_shards() -> bool:
    """Shards of 2, 2, 1 and 0 rows (and 1, 1, 0, 0): stream_weights still equals the unsharded values."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # the same values on every rank
    module = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    before = {name: parameter.detach().clone() for name, parameter in module.named_parameters()}
    fully_shard(module, mesh=models.training_mesh("cpu", 4))
    return all(torch.equal(tensor, before[name]) for name, tensor in models.stream_weights(module, torch.float32))


def exported_equal(model: torch.nn.Module, directory: Path) -> bool | None:
    """export_pretrained's safetensors hold the model's full float32 tensors (rank 0's answer; None elsewhere)."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    expected = full_parameters(model, torch.float32)
    models.export_pretrained(model, AutoTokenizer.from_pretrained(TINY), directory)
    if dist.get_rank() != 0:
        return None
    stored = load_file(directory / "model.safetensors")
    return set(stored) == set(expected) - {"lm_head.weight"} and all(
        torch.equal(tensor, expected[name]) for name, tensor in stored.items())


def main() -> None:
    summary_path, export_dir = Path(sys.argv[1]), Path(sys.argv[2])
    transformers_logging.disable_progress_bar()  # a weight-loading bar per model, as prepare_run does
    rank, world_size, _ = init_distributed()
    assert world_size == 4, world_size
    torch.manual_seed(0)
    models.SYNC_BUCKET_BYTES = SMALL_BUCKET_BYTES
    found: dict[str, object] = {
        "default_is_flat": models.training_mesh("cpu", models.fsdp_shard_size(0, 4)) is models.training_mesh("cpu", 4),
        "hsdp_mesh_reused": models.training_mesh("cpu", 2) is models.training_mesh("cpu", 2),
        "uneven_shards_equal": uneven_shards()}
    flat, flat_gradients, _ = train_step(4)
    hsdp, hsdp_gradients, hsdp_model = train_step(2)
    again, again_gradients, _ = train_step(2)
    found["export_equal"] = exported_equal(hsdp_model, export_dir)
    found["hsdp_repeat_bitwise"] = (hsdp["loss"] == again["loss"] and hsdp["grad_norm"] == again["grad_norm"]
                                    and all(torch.equal(hsdp_gradients[n], again_gradients[n]) for n in hsdp_gradients))
    found["gradient_max_abs_diff"] = max((flat_gradients[n] - hsdp_gradients[n]).abs().max().item()
                                         for n in flat_gradients)
    found["gradient_max_abs"] = max(gradient.abs().max().item() for gradient in flat_gradients.values())
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, {"flat": flat, "hsdp": hsdp, **found})
    if rank == 0:
        summary_path.write_text(json.dumps(per_rank, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
