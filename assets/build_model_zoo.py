"""Tiny random-weight models of the families users train, for the tests: each with the embedded tokenizer (the
addition task's characters, assets/build_tiny_model.py), seeded, a few hundred thousand parameters, built in about a
second. Nothing here is committed as weights: a test builds what it needs under its temporary directory.

Each family keeps the parts that make it differ from a plain Llama block (sliding windows and their layer pattern,
tied embeddings, QK norms, fused projections, attention sinks, linear-attention layers, experts and their router), at
the smallest shapes vLLM-CPU accepts (head_dim 64: its attention kernel refuses smaller). Adding a family is one entry
in FAMILIES.

    python -m assets.build_model_zoo --family gemma3 --output-dir /tmp/zoo/gemma3
"""

from dataclasses import dataclass
from pathlib import Path

import torch

# The shapes every family shares: two heads of 64, two layers (so a hybrid family has one of each kind).
COMMON = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
          "num_hidden_layers": 2, "intermediate_size": 256, "max_position_embeddings": 128,
          "rms_norm_eps": 1e-6}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
# Gated DeltaNet at the smallest shapes vLLM-CPU runs: its chunked kernel (chunk_gated_delta_rule_cpu) needs key and
# value head dims equal and a multiple of 32, and refuses 32 ("Unexpected head dim size"); 2 value heads per key head
# as the real models group them; a convolution of width 4, the one vLLM-CPU prepacks on CPUs with AVX512-BF16.
LINEAR_ATTENTION = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                    "linear_num_key_heads": 1, "linear_num_value_heads": 2,
                    "layer_types": ["linear_attention", "full_attention"]}
SLIDING = 4  # a window shorter than a prompt plus its completion, so that it binds in the tests

# family -> (transformers config class, its settings beyond COMMON)
FAMILIES: dict[str, tuple[str, dict]] = {
    "qwen2.5": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True}),
    "qwen3_moe": ("Qwen3MoeConfig", {**MOE, "norm_topk_prob": True}),
    "llama3": ("LlamaConfig", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 64}}),
    "mistral": ("MistralConfig", {}),
    "phi3": ("Phi3Config", {}),
    "gemma3": ("Gemma3TextConfig", {"tie_word_embeddings": True, "sliding_window": SLIDING,
                                    "layer_types": ["sliding_attention", "full_attention"],
                                    "query_pre_attn_scalar": 64}),
    "olmo2": ("Olmo2Config", {}),
    "olmo3": ("Olmo3Config", {"sliding_window": SLIDING, "layer_types": ["sliding_attention", "full_attention"]}),
    # RMSNorm eps 1e-5: vLLM's gpt-oss module fixes it (common/llm/families.py, GPT_OSS_IN_VLLM)
    "gpt_oss": ("GptOssConfig", {"rms_norm_eps": 1e-5, "num_local_experts": 4, "num_experts_per_tok": 2,
                                 "intermediate_size": 64,
                                 "sliding_window": SLIDING, "layer_types": ["sliding_attention", "full_attention"],
                                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 2.0,
                                                     "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                                     "beta_slow": 1.0}}),
    "qwen3_next": ("Qwen3NextConfig", {**MOE, **LINEAR_ATTENTION, "shared_expert_intermediate_size": 64}),
    "qwen3_5": ("Qwen3_5TextConfig", {**LINEAR_ATTENTION, "tie_word_embeddings": True}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", {**MOE, **LINEAR_ATTENTION, "shared_expert_intermediate_size": 64}),
}


@dataclass
class Args:
    family: str = "qwen3"
    """one of FAMILIES"""
    output_dir: str = "zoo/qwen3"
    """where the model and its tokenizer go"""
    seed: int = 0
    """seed of the random weights"""


def build_family(family: str, output_dir: str | Path, seed: int = 0) -> Path:
    """A tiny random `family` model and the embedded tokenizer in `output_dir`, loadable by `transformers` and
    vLLM. The same seed gives the same weights."""
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    from assets.build_tiny_model import build_tokenizer

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; the families are {', '.join(FAMILIES)}")
    config_name, settings = FAMILIES[family]
    tokenizer = build_tokenizer()
    ids = {"bos_token_id": tokenizer.eos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    config = getattr(transformers, config_name)(vocab_size=len(tokenizer), dtype="float32",
                                                **{**COMMON, **settings, **ids})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(**ids)
    output = Path(output_dir)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    return output


if __name__ == "__main__":
    import tyro

    args = tyro.cli(Args)
    print(build_family(args.family, args.output_dir, args.seed))
