"""The embedded default model `assets/tiny-adder/`: it loads, its held-out accuracy is what build_info.json says, and
its build script is bitwise reproducible (same seed, same hash; other seed, other hash)."""

import hashlib
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from assets.build_tiny_model import Args, greedy_accuracy
from common.tasks import AdditionTask

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "assets" / "tiny-adder"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def build_info() -> dict:
    return json.loads((MODEL_DIR / "build_info.json").read_text())


def test_committed_model_matches_build_info(build_info: dict) -> None:
    assert sha256(MODEL_DIR / "model.safetensors") == build_info["model_safetensors_sha256"]
    assert build_info["args"] == asdict(Args())  # built by `python -m assets.build_tiny_model` with today's defaults
    assert sum(path.stat().st_size for path in MODEL_DIR.iterdir()) < 10 * 2**20


def test_committed_model_heldout_accuracy(build_info: dict) -> None:
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    assert tokenizer.chat_template is None and tokenizer.decode(tokenizer.encode("12+34=")) == "12+34="
    assert model.config.eos_token_id == tokenizer.eos_token_id != tokenizer.pad_token_id
    assert len(tokenizer) == model.config.vocab_size  # AutoTokenizer (Qwen2Tokenizer) added no token
    accuracy = greedy_accuracy(model, tokenizer, AdditionTask().test[:100])  # the Auto-loaded model, not the builder's
    assert abs(accuracy - build_info["heldout_greedy_accuracy_first_100"]) <= 0.02
    assert 0.30 <= build_info["heldout_greedy_accuracy"] <= 0.75  # weak enough to leave room for RL
    assert 0.25 <= accuracy <= 0.80


def build(output_dir: Path, seed: int) -> str:
    command = [sys.executable, "-m", "assets.build_tiny_model", "--steps", "20", "--seed", str(seed)]
    subprocess.run([*command, "--output-dir", str(output_dir)], cwd=ROOT, check=True, capture_output=True, timeout=300)
    return sha256(output_dir / "model.safetensors")


def test_build_is_bitwise_reproducible(tmp_path: Path) -> None:
    first, second = build(tmp_path / "a", seed=1), build(tmp_path / "b", seed=1)
    assert first == second
    assert json.loads((tmp_path / "a" / "build_info.json").read_text())["model_safetensors_sha256"] == first
    assert build(tmp_path / "c", seed=2) != first  # negative control: the hash does depend on the seed
