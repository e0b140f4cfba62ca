"""The embedded models `assets/tiny-adder/` (the default), `assets/tiny-countdown/` and `assets/tiny-calculator/`:
each loads, its held-out accuracy is what its build_info.json says (the calculator's: of its tool episodes, and how
it uses the tool), and the build script is bitwise reproducible (same seed, same hash; other seed, other hash)."""

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from conftest import check, run_script
from transformers import AutoModelForCausalLM, AutoTokenizer

from assets.build_tiny_model import Args, episode_metrics, greedy_accuracy, sampled_tool_call_probability
from tasks import TASKS

ROOT = Path(__file__).resolve().parent.parent
# each committed model and the build arguments that made it (python -m assets.build_tiny_model [those arguments])
MODELS = {"tiny-adder": Args(),
          "tiny-countdown": Args(task="countdown_tiny", output_dir="assets/tiny-countdown", steps=750),
          "tiny-calculator": Args(task="calculator_tiny", output_dir="assets/tiny-calculator", steps=600,
                                  tool_fraction=0.3)}
SINGLE_TURN = ["tiny-adder", "tiny-countdown"]
SAMPLE_PROMPTS = {"tiny-adder": "12+34=", "tiny-countdown": "3,5,7->22:", "tiny-calculator": "37*58:"}
# flags the build script gained after a model was built; that model's build never reads them (another task's)
FLAGS_ADDED_LATER = {"tool_fraction"}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("name", MODELS)
def test_committed_model_matches_build_info(name: str) -> None:
    model_dir, build_info = ROOT / "assets" / name, json.loads((ROOT / "assets" / name / "build_info.json").read_text())
    assert sha256(model_dir / "model.safetensors") == build_info["model_safetensors_sha256"]
    recorded, expected = build_info["args"], asdict(MODELS[name])
    assert recorded == {key: value for key, value in expected.items() if key in recorded}  # built with these
    assert set(expected) - set(recorded) <= FLAGS_ADDED_LATER
    assert sum(path.stat().st_size for path in model_dir.iterdir()) < 10 * 2**20


def load(name: str) -> tuple[AutoModelForCausalLM, AutoTokenizer, dict]:
    """The committed model as a run loads it (Auto classes), checked for what every run relies on."""
    model_dir, build_info = ROOT / "assets" / name, json.loads((ROOT / "assets" / name / "build_info.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = SAMPLE_PROMPTS[name]
    assert tokenizer.chat_template is None and tokenizer.decode(tokenizer.encode(prompt)) == prompt
    assert model.config.eos_token_id == tokenizer.eos_token_id != tokenizer.pad_token_id
    assert len(tokenizer) == model.config.vocab_size  # AutoTokenizer (Qwen2Tokenizer) added no token
    return model, tokenizer, build_info


@pytest.mark.parametrize("name", SINGLE_TURN)
def test_committed_model_heldout_accuracy(name: str) -> None:
    model, tokenizer, build_info = load(name)
    task = TASKS[MODELS[name].task]()
    accuracy = greedy_accuracy(model, tokenizer, task.test[:100], task)  # the Auto-loaded model, not the builder's
    assert abs(accuracy - build_info["heldout_greedy_accuracy_first_100"]) <= 0.02
    assert 0.30 <= build_info["heldout_greedy_accuracy"] <= 0.75  # weak enough to leave room for RL
    assert 0.25 <= accuracy <= 0.80


def test_committed_calculator_model_uses_the_tool_as_recorded() -> None:
    """Greedy episodes (call, reply, answer) score what build_info says; the model calls the tool now and then when
    sampling (RL's room), cannot multiply by itself, and copies the tool's result when it calls."""
    model, tokenizer, build_info = load("tiny-calculator")
    task = TASKS["calculator_tiny"]()
    for reply in (task.environment().format_reply("2146"), task.environment().format_reply("?")):
        assert tokenizer.decode(tokenizer.encode(reply)) == reply  # the replies are in its alphabet (`=?;` too)
    accuracy = greedy_accuracy(model, tokenizer, task.test[:100], task)
    assert abs(accuracy - build_info["heldout_greedy_accuracy_first_100"]) <= 0.02
    probability = sampled_tool_call_probability(model, tokenizer, task.test)  # one forward pass of 500 prompts
    assert abs(probability - build_info["heldout_sampled_tool_call_probability"]) <= 1e-3
    assert 0.2 <= probability <= 0.4
    assert build_info["heldout_greedy_tool_call_rate"] <= 0.3 and build_info["heldout_direct_answer_accuracy"] < 0.15
    assert episode_metrics(model, tokenizer, task.test[:100], task, first="call")["accuracy"] >= 0.9
    assert build_info["heldout_tool_path_accuracy"] >= 0.9


def build(output_dir: Path, seed: int) -> str:
    check(run_script("assets/build_tiny_model.py", ["--steps", "20", "--seed", str(seed), "--output-dir",
                                                    str(output_dir)], launcher="warm", timeout=300))
    return sha256(output_dir / "model.safetensors")


def test_build_is_bitwise_reproducible(tmp_path: Path) -> None:
    first, second = build(tmp_path / "a", seed=1), build(tmp_path / "b", seed=1)
    assert first == second
    assert json.loads((tmp_path / "a" / "build_info.json").read_text())["model_safetensors_sha256"] == first
    assert build(tmp_path / "c", seed=2) != first  # negative control: the hash does depend on the seed
