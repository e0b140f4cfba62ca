"""Models: loading and FSDP2 sharding, the optimizer and its schedule, and full weights streamed out of the shards (into
the rollout engine every step, into safetensors files at a checkpoint). A 7B policy is 28 GB in float32 and its Adam
state 56 GB more, so no rank holds the whole model: weights leave the shards SYNC_BUCKET_BYTES at a time."""

import functools
import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from common.determinism import hash_named_tensors
from common.distributed import all_gather_rows, fail, local_world_size, save_group
from common.llm.attention import (
    PACKED_ATTENTION,
    PADDED_ATTENTION,
    register_packed_attention,
    register_padded_attention,
)
from common.llm.lora import LoRASpec, apply_lora, lora_scales, merged_weights
from common.llm.routing import recompute_context
from common.llm.run import LLMArgs
from common.tracking import get_logger

EXPORT_SHARD_BYTES = 2 * 2**30  # safetensors file size of an exported model
SYNC_BUCKET_BYTES = 256 * 2**20  # full tensors gathered per collective while streaming weights (in the target dtype)
# FSDP2's meshes, one per (process group, device type, shard size): a 2-D mesh creates process groups, and the policy,
# reference, value and reward models all shard over the same one.
_meshes: dict[tuple[object, str, int], DeviceMesh] = {}


def load_model(path: str, args: LLMArgs, device: torch.device, trainable: bool = True, model_class: object = None,
               attn_implementation: str = PADDED_ATTENTION, lora: LoRASpec | None = None,
               keep_trainable: tuple[str, ...] = ()) -> torch.nn.Module:
    """A HF model sharded with FSDP2 per transformer block (the classes in the model's `_no_split_modules`, e.g.
    Qwen2DecoderLayer) and at the root, computing in `args.dtype` and reducing gradients in float32. Trained models
    keep float32 master weights; frozen ones (reference, reward model) hold their weights in `args.dtype`.
    `attn_implementation`: attention.PADDED_ATTENTION (SDPA for padded rows, and packed ones on CPU),
    PACKED_ATTENTION for packed rows on GPUs, or a name of transformers'.

    Only rank 0 reads the checkpoint, into host memory in float32; every rank builds the model on the meta device (no
    memory), shards it, allocates its own shard and receives its slice of each tensor by broadcast, one full tensor on
    the device at a time (the memory at 7B: docs/scaling.md, "Memory and bandwidth"). Buffers (rotary tables) come
    from rank 0's copy too, so all ranks and a plain `from_pretrained` agree bit for bit. With
    `args.gradient_checkpointing` a trained model's blocks keep only their inputs for backward and recompute the rest.
    Exports store the checkpoint's own dtype (`config.dtype`; `args.dtype` when the checkpoint names none).

    With `lora` (common/llm/lora.py) the targeted linear layers get adapters, which alone train (with the modules
    named in `keep_trainable`, e.g. a value head): rank 0 draws them on its full copy, so every rank receives the same
    start at any world size, and the frozen base is held in `args.dtype` like a frozen model's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    compute_dtype = getattr(torch, args.dtype)
    if attn_implementation == PACKED_ATTENTION:
        register_packed_attention()
    if attn_implementation == PADDED_ATTENTION:
        register_padded_attention()
    text_config = AutoConfig.from_pretrained(path).get_text_config()
    if model_class is None and (getattr(text_config, "final_logit_softcapping", None)
                                or getattr(text_config, "logit_scale", 1.0) not in (None, 1.0)):
        fail(f"{path}: the model transforms its logits after the LM head (soft cap or scale), which token_logprobs "
             "replaces by its own float32 head; not supported")
    if getattr(text_config, "attn_logit_softcapping", None):
        fail(f"{path}: the model soft-caps its attention logits (attn_logit_softcapping, e.g. Gemma 2), which the "
             "trainer's attention (SDPA, FlexAttention) does not apply; not supported")
    source = shape = None
    if dist.get_rank() == 0:  # the one reader: a failure here must reach the ranks waiting for its broadcast
        try:
            source = (model_class or AutoModelForCausalLM).from_pretrained(path, dtype=torch.float32,
                                                                            attn_implementation=attn_implementation)
            if lora is not None:
                apply_lora(source, lora, keep_trainable)
            shape = (type(source), source.config, getattr(source, "generation_config", None),
                     text_config.dtype or compute_dtype)
        except Exception as error:  # a damaged or incomplete checkpoint raises many types
            shape = f"rank 0 cannot load {path}: {type(error).__name__}: {error}"
    shape = _broadcast_object(shape)
    if isinstance(shape, str):
        fail(shape)
    model_type, config, generation_config, export_dtype = shape
    with torch.device("meta"):
        model = model_type._from_config(config, dtype=torch.float32)
    if lora is not None:
        apply_lora(model, lora, keep_trainable)
    warning = float32_warning(sum(parameter.numel() for parameter in model.parameters()), device.type, args.dtype)
    if warning and dist.get_rank() == 0:
        get_logger(0).warning(f"{path}: {warning}")
    model.config.dtype = export_dtype  # what export_pretrained writes (building set it to the masters' float32)
    if generation_config is not None:  # the checkpoint's (e.g. both EOS ids), not one derived from the config
        model.generation_config = generation_config
    shard_model(model, args, device, trainable)
    set_model_state_dict(model, source.state_dict() if source is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    source_buffers = dict(source.named_buffers()) if source is not None else {}
    for name, buffer in model.named_buffers():  # the rotary tables are not in a state dict
        if source is not None:
            buffer.copy_(source_buffers[name])
        dist.broadcast(buffer, src=0)
    model.eval()  # no dropout anywhere: the engine and the reference have none
    return model


FLOAT32_WARN_PARAMETERS = 100_000_000


def float32_warning(num_parameters: int, device_type: str, dtype: str) -> str | None:
    """What to say when a model of real size computes in float32 on a GPU (the default --dtype, right on the CPU):
    every GEMM on CUDA cores (TF32 stays off for determinism), no FlashAttention in vLLM, no CUDA graphs under batch
    invariance (issue 39 estimates about 10x slower than bfloat16; not measured here). None otherwise."""
    if device_type != "cuda" or dtype != "float32" or num_parameters < FLOAT32_WARN_PARAMETERS:
        return None
    return (f"{num_parameters / 1e6:.0f}M parameters computing in float32 on a GPU (the default --dtype): every "
            "matrix product on CUDA cores, no FlashAttention, no CUDA graphs; pass --dtype bfloat16 unless float32 is "
            "meant (master weights and the loss's head stay float32 either way)")


def fsdp_shard_size(requested: int, world_size: int) -> int:
    """The ranks that shard each model: `--fsdp-shard-size`, or for 0 the ranks per node as torchrun launched them
    (HSDP across nodes), except with one rank per node, where that would replicate whole models (DDP: 122 GB per rank
    at 7B): then every rank shards (flat FSDP), as when the ranks fit in one node (the split layout's trainers).
    Resolved here, not in the arguments (they are compared on resume as given): a resume at the same world size on
    another node layout with 0 shards differently (the checkpoint reads back; the results are not bit for bit)."""
    return requested or (local_world_size() if 1 < local_world_size() < world_size else world_size)


def training_mesh(device_type: str, shard_size: int) -> DeviceMesh:
    """FSDP2's device mesh, built once per process: 1-D over all ranks when `shard_size` is the world size (plain
    FSDP), else ("replicate", "shard") = (world / shard_size, shard_size) for HSDP. torchrun numbers ranks node by
    node, so with shard_size = ranks per node each "shard" group is one node."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (dist.group.WORLD, device_type, shard_size)
    if key not in _meshes:
        world_size = dist.get_world_size()
        if shard_size == world_size:
            _meshes[key] = init_device_mesh(device_type, (world_size,))
        else:
            _meshes[key] = init_device_mesh(device_type, (world_size // shard_size, shard_size),
                                            mesh_dim_names=("replicate", "shard"))
    return _meshes[key]


def shard_model(model: torch.nn.Module, args: LLMArgs, device: torch.device, trainable: bool) -> None:
    """A model built on the meta device, sharded as load_model describes, its shards allocated on `device` (empty):
    frozen parameters cast to the compute dtype, block checkpointing, FSDP2 per block and at the root.

    Each parameter is split over `fsdp_shard_size(args.fsdp_shard_size)` ranks (default: one node's) and replicated
    over the other groups (HSDP): a block's all-gather and its gradient reduce-scatter stay within the node, and only
    the all-reduce of the reduced gradient shard (1 / shard size of the gradients) crosses nodes. The price: a rank
    holds parameters / shard size, not / world size, however many nodes join (at 7B: docs/scaling.md, "Memory and
    bandwidth"). With shard size = world size the mesh is flat (plain FSDP)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    compute_dtype = getattr(torch, args.dtype)
    if not trainable:
        model.requires_grad_(False)
    for parameter in model.parameters():  # frozen (a reference, a LoRA base): half the memory in bfloat16; buffers
        if not parameter.requires_grad:  # stay float32 as built
            parameter.data = parameter.data.to(compute_dtype)
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in block_classes]
    if trainable and args.gradient_checkpointing:  # around the block's forward, inside the FSDP hooks that gather it
        for block in blocks:
            block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=False,
                                              context_fn=functools.partial(recompute_context, model))  # MoE routes
    mesh = training_mesh(device.type, fsdp_shard_size(args.fsdp_shard_size, dist.get_world_size()))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    # a frozen model never runs the backward that would reshard it: kept gathered, it would hold a full copy all run
    reshard_after_forward = args.reshard_after_forward or not trainable
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    if not trainable:  # after FSDP2's own forward hook, which records the forward order a backward would clear
        model.register_forward_hook(lambda module, inputs, output: forget_forward_order(module))
    model.to_empty(device=device)


def _param_groups(model: torch.nn.Module) -> list[object]:
    from torch.distributed.fsdp import FSDPModule

    return [group for module in model.modules() if isinstance(module, FSDPModule)
            for group in module._get_fsdp_state()._fsdp_param_groups]


def forward_order_lengths(model: torch.nn.Module) -> dict[str, int]:
    """What FSDP2 (torch 2.13) records at each forward of the sharded `model` for a backward's prefetches, cleared at
    a backward's end only (_fsdp_param_group.py `_record_post_forward`, `finalize_backward`; _fsdp_state.py): the
    root's `post_forward_order` (an entry per unit and forward) and the units' `_post_forward_indices`, summed."""
    return {"post_forward_order": len(model._get_fsdp_state()._comm_ctx.post_forward_order),
            "post_forward_indices": sum(len(group._post_forward_indices) for group in _param_groups(model))}


def forget_forward_order(model: torch.nn.Module) -> None:
    """Clear what `forward_order_lengths` measures, as a backward's end does (after each forward of a frozen model)."""
    model._get_fsdp_state()._comm_ctx.post_forward_order.clear()
    for group in _param_groups(model):
        group._post_forward_indices.clear()


def _broadcast_object(value: object) -> object:
    """Rank 0's `value` on every rank (a collective)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def learning_rate_factor(update: int, warmup_steps: int, total_updates: int, lr_schedule: str) -> float:
    """Linear warm-up to 1, then constant, linear or cosine decay to 0 at `total_updates`."""
    if update < warmup_steps:
        return (update + 1) / warmup_steps
    progress = (update - warmup_steps) / max(1, total_updates - warmup_steps)
    if lr_schedule == "linear":
        return max(0.0, 1 - progress)
    if lr_schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return 1.0


def make_optimizer(model: torch.nn.Module, args: LLMArgs, learning_rate: float, total_updates: int
                   ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the shards of the model's trained parameters (all of them; with LoRA, the adapters) (foreach: one
    op per step for all of them) and the warm-up + decay schedule."""
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=learning_rate, weight_decay=args.weight_decay, foreach=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: learning_rate_factor(
        update, args.warmup_steps, total_updates, args.lr_schedule))
    return optimizer, scheduler


def all_reduce_at_last(last: bool, *models: torch.nn.Module) -> None:
    """Call before each micro-batch's backward. With HSDP (--fsdp-shard-size below the world size), FSDP2 reduce-
    scatters a backward's gradients within the shard group (a node) and then all-reduces the shards across the
    replicas (the nodes), by default after every backward: with M micro-batches per optimizer step, M cross-node
    all-reduces (3.8 GB per rank each at 7B and shard size 8) where one, of their sum, gives the same gradient. So the
    micro-batches before the last of an optimizer step only reduce-scatter and accumulate, and the last all-reduces
    the sum (FSDP2's set_requires_all_reduce). The sum is formed in another order than by an all-reduce per
    micro-batch, so the bits differ from that way's; a flat mesh has no all-reduce."""
    from torch.distributed.fsdp import FSDPModule

    for model in models:
        if isinstance(model, FSDPModule):
            model.set_requires_all_reduce(last)


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LambdaLR, max_grad_norm: float, step: int
                   ) -> tuple[float, float]:
    """Clip by the global gradient norm, step, advance the schedule, free the gradients (before the engine wakes); a
    non-finite norm (the same on every rank) stops the run before the weights change. Returns norm and rate used."""
    from torch.distributed.fsdp import FSDPModule

    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    if not math.isfinite(grad_norm):
        fail(f"non-finite gradient at step {step} (grad norm {grad_norm}); the last checkpoint is left as it was")
    learning_rate = scheduler.get_last_lr()[0]
    for module in model.modules():  # a forward without gradient after the last backward leaves blocks gathered, and
        if isinstance(module, FSDPModule):  # the next forward would reuse that copy of the old weights: drop it
            module.reshard()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, learning_rate


def stream_weights(model: torch.nn.Module, dtype: torch.dtype, tied_aliases: bool = True,
                   only: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's full tensors in `dtype`, in named_parameters' order (a collective: every rank iterates to the end),
    or those whose names `only` accepts (a LoRA model's adapters).
    Parameters go in buckets of about SYNC_BUCKET_BYTES (full tensors in `dtype`), and each bucket is gathered in ONE
    all-gather over the shard group (see _gather_bucket), so the collectives per sync are the buckets, however many
    tensors there are. A tied tensor is gathered once and, with `tied_aliases`, yielded under its other names right
    after (vLLM rebuilds a layer that gets no weights from its old copy). Buffers (rotary tables) are left out:
    engines compute their own.

    A rank holds at once one bucket's local slices, the gathered bucket and the full tensors copied out of it, plus
    whatever the consumer still keeps of earlier buckets; the arithmetic at 7B is in docs/scaling.md ("The weight
    sync's buckets")."""
    aliases: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(parameter), []).append(name)
    parameters = [(name, parameter) for name, parameter in model.named_parameters() if only is None or only(name)]
    for bucket in _weight_buckets(parameters, dtype):
        for (name, parameter), tensor in zip(bucket, _gather_bucket([parameter for _, parameter in bucket], dtype)):
            for alias in aliases[id(parameter)] if tied_aliases else [name]:
                yield alias, tensor


def _weight_buckets(parameters: list[tuple[str, torch.Tensor]], dtype: torch.dtype
                    ) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive parameters, a bucket closed as soon as its full tensors reach SYNC_BUCKET_BYTES in `dtype`: every
    bucket but the last holds at least that, so a model of B bytes takes at most B // SYNC_BUCKET_BYTES + 1."""
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    bucket_bytes = 0
    for name, parameter in parameters:
        if bucket_bytes >= SYNC_BUCKET_BYTES:
            buckets.append([])
            bucket_bytes = 0
        buckets[-1].append((name, parameter))
        bucket_bytes += parameter.numel() * dtype.itemsize
    return [bucket for bucket in buckets if bucket]


def _gather_bucket(parameters: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Each parameter's full tensor in `dtype`: FSDP2's shards (DTensors) gathered together, plain tensors (an
    unsharded model) cast only."""
    from torch.distributed.tensor import DTensor

    sharded = [parameter.detach() for parameter in parameters if isinstance(parameter, DTensor)]
    gathered = iter(_gather_shards(sharded, dtype) if sharded else [])
    return [next(gathered) if isinstance(parameter, DTensor) else parameter.detach().to(dtype)
            for parameter in parameters]


def _gather_shards(sharded: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """The full tensors of FSDP2 DTensors (one mesh) in `dtype`, in one all-gather over the mesh dimension that
    shards them (with HSDP the in-node "shard" group; the "replicate" groups hold the same shards, so nothing crosses
    nodes). FSDP2 splits dim 0 like torch.chunk: rank k holds rows from k * ceil(rows / shard size), trailing ranks
    fewer or none, so each slice is sent padded to ceil(rows / shard size) rows, every rank's slices cast and back to
    back; the rank-major result is copied out into the tensors in one op, and the padding rows are dropped. A gather
    is a copy: the values are bitwise those of DTensor.full_tensor()."""
    shard_dim = next(dim for dim, placement in enumerate(sharded[0].placements) if placement.is_shard(0))
    group = sharded[0].device_mesh.get_group(shard_dim)  # shard_model puts every parameter on the same mesh
    ranks = dist.get_world_size(group)
    padded_shapes = [(math.ceil(tensor.shape[0] / ranks), *tensor.shape[1:]) for tensor in sharded]
    slice_sizes = [math.prod(shape) for shape in padded_shapes]
    send = torch.zeros(sum(slice_sizes), dtype=dtype, device=sharded[0].to_local().device)
    for piece, tensor in zip(send.split(slice_sizes), sharded):
        local = tensor.to_local()
        piece[:local.numel()].copy_(local.reshape(-1))  # casts on the way in
    received = all_gather_rows(send, group)  # [ranks, every slice of one rank]
    padded = [send.new_empty((ranks * shape[0], *shape[1:])) for shape in padded_shapes]
    torch.split_with_sizes_copy(received, slice_sizes, dim=1, out=[tensor.view(ranks, -1) for tensor in padded])
    return [full[:tensor.shape[0]] for full, tensor in zip(padded, sharded)]


def final_parameter_hash(model: torch.nn.Module) -> str:
    """parameter_hash(model) of an FSDP2 model, computed by rank 0 alone and sent to the others: each tensor is
    gathered within rank 0's shard group, one at a time, and the other shard groups (HSDP's other nodes, whose
    replicas hold the same shards) gather nothing. DTensor.full_tensor() on every rank would gather the whole
    float32 model into every rank and each would copy it to the host and hash it: at 7B, 30.5 GB per rank. Frozen
    parameters (a LoRA model's base, named by its fingerprint instead) are left out: the hash is of what trained."""
    from torch.distributed.tensor import DTensor

    frozen = {name for name, parameter in model.named_parameters(remove_duplicate=False)
              if not parameter.requires_grad}
    state = {name: tensor for name, tensor in model.state_dict().items() if name not in frozen}
    sharded = [tensor for tensor in state.values() if isinstance(tensor, DTensor)]
    group = sharded[0].device_mesh.get_group(sharded[0].device_mesh.ndim - 1) if sharded else None
    gathered = ((name, _gather_shards([state[name].detach()], state[name].dtype)[0]
                 if isinstance(state[name], DTensor) else state[name]) for name in sorted(state))
    box = [None]
    if dist.get_rank() == 0:
        box[0] = hash_named_tensors(gathered)
    elif group is not None and 0 in dist.get_process_group_ranks(group):
        for _ in gathered:  # the all-gathers rank 0 waits for
            pass
    dist.broadcast_object_list(box, src=0, group=save_group())
    return box[0]


def export_pretrained(model: torch.nn.Module, tokenizer: object, directory: Path, merge_lora: bool = False) -> None:
    """`save_pretrained`'s layout (config, safetensors shards, index, tokenizer) from a streamed gather: rank 0
    holds at most one shard file's worth of tensors; weights are stored in the config's dtype. Every rank calls it.
    A write that fails on rank 0 (a full disk) is raised only after the stream ends, since the stream's gathers are
    collectives the other ranks are in. A LoRA model is written merged (`merge_lora`: its adapters folded in, in
    float32, rounded once to the config's dtype)."""
    from safetensors.torch import save_file

    config = model.config
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, str(config.dtype or "float32"))
    is_writer = dist.get_rank() == 0
    shard, shard_bytes, files, weight_map, failed = {}, 0, [], {}, None

    def flush() -> None:
        nonlocal shard, shard_bytes
        name = f"part-{len(files):05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        files.append((name, list(shard)))
        shard, shard_bytes = {}, 0

    weights = merged_weights(stream_weights(model, torch.float32, tied_aliases=False), lora_scales(model), dtype) \
        if merge_lora else stream_weights(model, dtype, tied_aliases=False)
    for name, tensor in weights:
        if is_writer and failed is None:
            shard[name] = tensor.cpu().contiguous()
            shard_bytes += tensor.numel() * tensor.element_size()
            if shard_bytes >= EXPORT_SHARD_BYTES:
                try:
                    flush()
                except Exception as error:  # safetensors' own error type for a full disk; the others stay in step
                    failed, shard = error, {}
    if not is_writer:
        return
    if failed is not None:
        raise failed
    if shard or not files:
        flush()
    if len(files) == 1:
        os.replace(directory / files[0][0], directory / "model.safetensors")
    else:
        for index, (name, keys) in enumerate(files):
            final = f"model-{index + 1:05d}-of-{len(files):05d}.safetensors"
            os.replace(directory / name, directory / final)
            weight_map.update(dict.fromkeys(keys, final))
        index_file = {"metadata": {}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2) + "\n")
    config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
