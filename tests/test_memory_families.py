"""benchmarks/memory_estimate.py's per-family sizes (--family-sizes) against the tiny zoo's real models
(assets/build_model_zoo.py): the parameter split against the models' named parameters, the KV cache and the Gated
DeltaNet state against the cache tensors transformers allocates in a real forward."""

import importlib.util
from pathlib import Path

import pytest
import torch

from assets.build_model_zoo import build_family
from common.llm.families import family_of

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("memory_estimate", ROOT / "benchmarks" / "memory_estimate.py")
memory_estimate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(memory_estimate)
FAMILY_MODELS, family_config, parameter_split = (memory_estimate.FAMILY_MODELS, memory_estimate.family_config,
                                                 memory_estimate.parameter_split)
kv_cache_values, linear_attention_state_values = (memory_estimate.kv_cache_values,
                                                  memory_estimate.linear_attention_state_values)

TOKENS = 11  # longer than the zoo's window (4 tokens), so that the sliding layers' cap binds


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM

    root, built = tmp_path_factory.mktemp("zoo"), {}

    def model(family: str) -> torch.nn.Module:
        if family not in built:
            built[family] = AutoModelForCausalLM.from_pretrained(build_family(family, root / family),
                                                                 dtype=torch.float32, attn_implementation="eager")
        return built[family]

    return model


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "qwen3_next", "qwen3"])
def test_parameter_split_equals_the_named_parameters(zoo, family: str):
    model = zoo(family)
    named = dict(model.named_parameters())
    routed = sum(p.numel() for name, p in named.items() if ".mlp.experts." in name)  # not a shared_expert
    per_token = model.config.num_experts_per_tok if routed else 0
    experts = getattr(model.config, "num_experts", None) or getattr(model.config, "num_local_experts", 1)
    split = parameter_split(model)
    assert split["parameters"] == sum(p.numel() for p in named.values())
    assert split["expert_parameters"] == routed
    assert split["active_parameters"] == split["parameters"] - routed + routed * per_token // experts
    assert split["active_without_input_embedding"] == split["active_parameters"] - (
        0 if model.config.tie_word_embeddings else named["model.embed_tokens.weight"].numel())
    assert (split["expert_parameters"] > 0) == (family != "qwen3")
    if family == "qwen3_next":  # the shared expert is always active
        assert any("shared_expert" in name for name in named)


def _cache_after_forward(model: torch.nn.Module) -> object:
    ids = torch.randint(3, model.config.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True).past_key_values


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "gemma3", "qwen3_next"])
def test_kv_cache_equals_transformers_cache(zoo, family: str):
    """Full-attention layers hold every token; a sliding layer W tokens at most: transformers keeps W - 1 after a
    forward (what the next token reads besides itself), the engine W (it writes a token's keys before attending); a
    linear-attention layer holds no keys."""
    model = zoo(family)
    cache = _cache_after_forward(model)
    kinds = family_of(model.config).layer_types
    held = [layer.keys.numel() + layer.values.numel() if getattr(layer, "keys", None) is not None else 0
            for layer in cache.layers]
    per_layer_token = 2 * model.config.num_key_value_heads * model.config.head_dim
    sliding = kinds.count("sliding_attention")
    assert sum(held[i] for i, kind in enumerate(kinds) if kind == "full_attention") == \
        per_layer_token * TOKENS * kinds.count("full_attention")
    assert kv_cache_values(model.config, TOKENS) == sum(held) + sliding * per_layer_token
    assert (sliding > 0) == (family in ("gpt_oss", "gemma3"))
    assert all(held[i] == 0 for i, kind in enumerate(kinds) if kind == "linear_attention")


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_linear_attention_state_equals_transformers_cache(zoo, family: str):
    """transformers keeps the convolution's last kernel inputs (vLLM kernel - 1) and the recurrent state."""
    model = zoo(family)
    cache = _cache_after_forward(model)
    conv = [state for layer in cache.layers for state in (getattr(layer, "conv_states", None) or {}).values()
            if state is not None]
    recurrent = [state for layer in cache.layers for state in (getattr(layer, "recurrent_states", None) or {}).values()
                 if state is not None]
    assert len(conv) == len(recurrent) == family_of(model.config).layer_types.count("linear_attention") > 0
    expected = linear_attention_state_values(model.config, model.config.linear_conv_kernel_dim)
    assert (sum(state.numel() for state in conv), sum(state.numel() for state in recurrent)) == expected


def test_published_sizes_are_the_model_cards():
    """The configs as written build the totals the model cards state, to their first decimal (truncated there):
    Qwen3-30B-A3B 30.5B with 3.3B active, gpt-oss-20b 20.9B with 3.6B active (its paper, arXiv:2508.10925: 20.91B,
    3.61B), Qwen3-Next-80B-A3B 80B."""
    from transformers import AutoModelForCausalLM

    stated = {"qwen3-30b-a3b": (30.5e9, 3.3e9), "gpt-oss-20b": (20.9e9, 3.6e9), "qwen3-next-80b-a3b": (79.6e9, None)}
    for name in FAMILY_MODELS:
        with torch.device("meta"):
            split = parameter_split(AutoModelForCausalLM.from_config(family_config(name), dtype=torch.float32))
        total, active = stated[name]
        assert total <= split["parameters"] < total + 0.1e9
        if active:  # gpt-oss counts no input embedding
            counted = split["active_without_input_embedding" if name == "gpt-oss-20b" else "active_parameters"]
            assert active <= counted < active + 0.1e9
