"""The hybrid linear-attention families (Gated DeltaNet layers beside full attention: Qwen3-Next, Qwen3.5, Qwen3.5-MoE)
and the sliding-window ones under the `transformers` rollout engine: built tiny by assets/build_model_zoo.py."""

from pathlib import Path

import pytest
import torch

from assets.build_model_zoo import build_family
from common.llm.engines import HFEngine

# three prompt lengths: the shortest gets 8 columns of left padding in a batch with the longest
PROMPTS = [[3, 4, 12, 5, 13], [6, 12, 7, 8, 13, 9, 10, 11, 12, 4, 3, 5, 13], [9, 10, 11, 12, 4, 13]]
SEEDS = [11, 22, 33]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("zoo")
    return lambda family: build_family(family, root / family) if not (root / family).exists() else root / family


def forward_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The completion's logprobs from one unpadded forward of prompt + completion, as the trainer scores them."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe", "gemma3"])
def test_hf_engine_left_padding_reaches_no_state(zoo, family: str):
    """A prompt sampled alone and inside a batch with longer prompts (so behind left padding) gives the same tokens and
    logprobs, and both equal an unpadded forward of the sampled sequence: the padding enters neither a Gated DeltaNet
    layer's recurrent and convolution state nor (Gemma 3: window 4, shorter than every sequence here) a sliding
    window. The engine's cache is built from the model's config (a linear-attention layer keeps a state, no keys);
    without it the first hybrid forward failed (IndexError in update_conv_state)."""
    engine = HFEngine(str(zoo(family)), torch.float32, torch.device("cpu"))
    together = engine.generate(PROMPTS, SEEDS, max_tokens=8, temperature=1.0, eos_ids=[1])
    assert sum(len(sample.completion_ids) for sample in together) > 12  # measured: not all stopped at once
    for index, prompt in enumerate(PROMPTS):
        alone = engine.generate([prompt], [SEEDS[index]], max_tokens=8, temperature=1.0, eos_ids=[1])[0]
        assert together[index].completion_ids == alone.completion_ids
        # another batch shape rounds float32 otherwise: measured up to 4.8e-7
        torch.testing.assert_close(torch.tensor(together[index].logprobs), torch.tensor(alone.logprobs),
                                   atol=1e-6, rtol=0)
        trainer = forward_logprobs(engine.model, prompt, alone.completion_ids)
        torch.testing.assert_close(trainer, torch.tensor(alone.logprobs, dtype=torch.float64), atol=1e-6, rtol=0)


def test_unmasked_left_padding_would_enter_the_linear_attention_state(zoo, monkeypatch):
    """Negative control for the test above: the same left-padded prompt with the padding hidden from the Gated
    DeltaNet layer's mask alone (transformers' recurrent mask made None; the full-attention layer still masks it)
    moves the next token's logprobs well past float32 rounding."""
    from transformers.models.qwen3_next import modeling_qwen3_next

    model = HFEngine(str(zoo("qwen3_next")), torch.float32, torch.device("cpu")).model
    prompt, padding = PROMPTS[0], 8
    padded = torch.tensor([[1] * padding + prompt])
    mask = torch.tensor([[0] * padding + [1] * len(prompt)])
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)

    def next_token_logprobs(ids: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(ids, **kwargs).logits[0, -1].log_softmax(-1)

    alone = next_token_logprobs(torch.tensor([prompt]))
    torch.testing.assert_close(next_token_logprobs(padded, attention_mask=mask, position_ids=position_ids), alone,
                               atol=1e-6, rtol=0)
    monkeypatch.setattr(modeling_qwen3_next, "create_recurrent_attention_mask", lambda **kwargs: None)
    unmasked = next_token_logprobs(padded, attention_mask=mask, position_ids=position_ids)
    assert (unmasked - alone).abs().max() > 1e-3


def test_zoo_builds_the_hybrid_families_with_both_layer_kinds(zoo, tmp_path: Path):
    """Each hybrid zoo model holds one Gated DeltaNet layer and one full-attention layer, and the same seed gives the
    same weights."""
    from transformers import AutoModelForCausalLM

    for family in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        model = AutoModelForCausalLM.from_pretrained(zoo(family))
        assert model.config.layer_types == ["linear_attention", "full_attention"]
        assert any(type(module).__name__.endswith("GatedDeltaNet") for module in model.modules())
    again = AutoModelForCausalLM.from_pretrained(build_family("qwen3_5", tmp_path / "again"))
    first = AutoModelForCausalLM.from_pretrained(zoo("qwen3_5"))
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values()))


# ---------------------------------------------------------------------------------------------------------------------
# vLLM-CPU: what it cannot run, refused before any model loads
# ---------------------------------------------------------------------------------------------------------------------


def test_engine_problem_names_every_reason_and_the_hf_engine(zoo, monkeypatch):
    """In float32 a Gated DeltaNet family is refused for vLLM-CPU (its kernels assert bfloat16), and a family whose
    vLLM module does not import (Qwen3.5's imports torchvision) for that too: every reason with its remedy, the
    import's first, `--rollout-engine hf` last. Qwen3-Next in bfloat16, and anything on the HF engine or on GPUs,
    passes. (The import itself is stood in for: importing vLLM costs 10 s of CPU; the test below runs it.)"""
    from transformers import AutoConfig

    from common.llm import families

    missing = "ModuleNotFoundError: No module named 'torchvision'"
    monkeypatch.setattr(families, "vllm_module_problem", lambda name: missing if name.startswith("Qwen3_5") else None)

    def problem(family: str, dtype: str, engine: str = "vllm", device_type: str = "cpu") -> str | None:
        return families.engine_problem(families.family_of(AutoConfig.from_pretrained(zoo(family))), engine, dtype,
                                       device_type)

    gdn = ("vLLM-CPU's Gated DeltaNet kernels run in bfloat16 only (vllm/model_executor/layers/mamba/ops/cpu/"
           "gdn_attention.py): pass --dtype bfloat16")
    module = (f"vLLM's module for Qwen3_5ForCausalLM does not import here ({missing}): install what it names "
              "(torchvision on CPUs comes from PyTorch's CPU index: docs/install.md)")
    assert problem("qwen3_next", "float32") == ("qwen3_next (Qwen3NextForCausalLM) cannot be sampled by vLLM here: "
                                                f"{gdn}; or pass --rollout-engine hf to sample with transformers in "
                                                "float32")
    assert problem("qwen3_5", "float32") == ("qwen3_5_text (Qwen3_5ForCausalLM) cannot be sampled by vLLM here: "
                                             f"{module}; and {gdn}; or pass --rollout-engine hf to sample with "
                                             "transformers in float32")
    assert problem("qwen3_5", "bfloat16") == ("qwen3_5_text (Qwen3_5ForCausalLM) cannot be sampled by vLLM here: "
                                              f"{module}; or pass --rollout-engine hf to sample with transformers in "
                                              "bfloat16")
    assert problem("qwen3_5_moe", "bfloat16").startswith("qwen3_5_moe_text (Qwen3_5MoeForCausalLM) cannot be")
    assert problem("qwen3_next", "bfloat16") is None and problem("qwen3", "float32") is None
    assert problem("qwen3_5", "float32", engine="hf") is None
    assert problem("qwen3_next", "float32", device_type="cuda") is None


def test_grpo_refuses_qwen3_5_on_vllm_cpu_before_any_model_loads(zoo):
    """`grpo_llm.py` with a Qwen3.5 model and vLLM (float32, the default): exit 2 with the message, from prepare_run on
    every rank, before the policy or the engine exists (neither the run's engine line nor vLLM's weight loading)."""
    from conftest import run_script

    result = run_script("grpo_llm.py", ["--model-name-or-path", str(zoo("qwen3_5")), "--rollout-engine", "vllm",
                                        "--total-steps", "1", "--run-root", str(zoo("qwen3_5").parent / "runs")],
                        timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: qwen3_5_text (Qwen3_5ForCausalLM) cannot be sampled by vLLM here: ")
    assert error.endswith("or pass --rollout-engine hf to sample with transformers in float32")
    assert "VLLMEngine" not in result.stdout + result.stderr and "Loading weights" not in result.stdout + result.stderr
    assert not (zoo("qwen3_5").parent / "runs").exists()


# ---------------------------------------------------------------------------------------------------------------------
# Training with the transformers engine
# ---------------------------------------------------------------------------------------------------------------------


def test_qwen3_5_moe_trains_with_the_hf_engine_and_its_logprobs_match_the_trainer(zoo, tmp_path: Path):
    """Qwen3.5-MoE (a Gated DeltaNet layer, a full-attention layer, routed and shared experts), which vLLM-CPU cannot
    run here, trains with `--rollout-engine hf` in float32 with real gradients (a length penalty), and the engine's
    logprobs equal the trainer's to float32 rounding at step 1 and after a sync at step 2 (measured: mean 1.3e-7,
    max 4.8e-7; the trainer scores padded rows, each completion alone)."""
    from conftest import check, only_run_dir, read_metrics, run_script

    result = run_script("grpo_llm.py", ["--model-name-or-path", str(zoo("qwen3_5_moe")), "--rollout-engine", "hf",
                                        "--task", "tests/length_penalty_task.py:LengthPenaltyTask",
                                        "--total-steps", "2", "--prompts-per-step", "4", "--num-generations", "4",
                                        "--num-eval-prompts", "8", "--eval-every", "0",
                                        "--run-root", str(tmp_path / "runs")])
    check(result)
    assert "--share-prompts is off for this model: qwen3_5_moe_text's linear-attention layers" in result.stdout
    steps = [m for m in read_metrics(only_run_dir(tmp_path / "runs")) if "train/grad_norm" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for metrics in steps:
        assert metrics["train/grad_norm"] > 0.1
        assert metrics["mismatch/logprob_abs_diff_mean"] < 1e-6 and metrics["mismatch/logprob_abs_diff_max"] < 1e-5


# ---------------------------------------------------------------------------------------------------------------------
# vLLM-CPU in bfloat16: the weight sync
# ---------------------------------------------------------------------------------------------------------------------


def test_qwen3_next_weight_sync_reaches_vllm_cpu(zoo, tmp_path: Path):
    """Qwen3-Next on vLLM-CPU in bfloat16 (tests/workers/hybrid_sync_worker.py): a sync of the unchanged weights leaves
    every sample and logprob as it was, bit for bit, where A_log goes in float32 (vLLM holds it so:
    qwen_gdn_linear_attn.py); without the MoE repack after the reload the same sync moves them (measured: mean 0.048,
    max 0.225: the issue's step-2 jump of 0.100); with A_log rounded to bfloat16, as a bfloat16 run's sync sends it and
    as the trainer computes with it, they move by that rounding alone (measured: at most 1.9e-3). Synced with another
    seed's model, the engine samples that model: its logprobs are that model's within bfloat16 rounding, far from the
    first model's."""
    import json

    from conftest import check, run_script

    other = build_family("qwen3_next", tmp_path / "other", seed=1)
    out = tmp_path / "samples.json"
    check(run_script("tests/workers/hybrid_sync_worker.py", [str(zoo("qwen3_next")), str(other), str(out)]))
    result = json.loads(out.read_text())
    samples = result["samples"]

    def gap(first: list[list], second: list[list]) -> torch.Tensor:
        """|logprob difference| of each token of the samples whose tokens agree."""
        return torch.tensor([a - b for (tokens, x), (same, y) in zip(first, second) if tokens == same
                             for a, b in zip(x, y)]).abs()

    assert sum(len(tokens) for tokens, _ in samples["at load"]) > 40
    assert samples["unchanged"] == samples["at load"]
    assert gap(samples["unchanged without repack"], samples["at load"]).mean() > 1e-2
    assert [tokens for tokens, _ in samples["as trained"]] == [tokens for tokens, _ in samples["at load"]]
    assert 0 < gap(samples["as trained"], samples["at load"]).max() < 1e-2
    own, first = (gap(samples["other"], [[tokens, scores] for (tokens, _), scores in
                                         zip(samples["other"], result[key])])
                  for key in ("other scored by other", "other scored by model"))
    assert own.mean() < 5e-3 and own.max() < 2e-2  # measured: 1.2e-3, 3.4e-3 (against a float32 head)
    assert first.mean() > 0.1  # measured: 0.27
