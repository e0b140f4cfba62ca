"""LoRA (common/llm/lora.py) in the LLM scripts: the layer and its merge by hand, the adapters' start (seeded,
the same at world sizes 1 and 2, the base model's logprobs bit for bit, in the engine too), every adapted layer
trained, the reference as the adapters switched off, the same bits twice and after a resume (colocated and split one
step off), PPO with a LoRA value model, online DPO, episodes with GSPO's ratio, the export vLLM loads, and the bad
input refused before any model loads."""

import filecmp
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import ROOT, check, only_run_dir, read_metrics, run_script
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

import grpo_llm
from assets.build_model_zoo import FAMILIES, build_family
from common.llm.lora import (
    LoRALinear,
    LoRASpec,
    adapter_serving_problem,
    adapters_disabled,
    apply_lora,
    default_targets,
    family_targets,
    is_adapter,
    lora_layers,
    lora_scales,
    merged_weights,
    meta_model,
    targets_problem,
    write_peft_adapter,
)

TINY = ROOT / "assets" / "tiny-adder"
QWEN2_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPEC = LoRASpec(rank=8, alpha=16.0, targets=QWEN2_TARGETS, seed=1)
SHORT = ["--task", "tests/small_addition_task.py:SmallAdditionTask", "--prompts-per-step", "16", "--num-generations",
         "4", "--micro-batch-size", "16", "--num-eval-prompts", "32", "--eval-every", "2", "--total-steps", "4",
         "--save-every", "2", "--keep-last", "0", "--seed", "1"]
LORA = ["--lora-rank", "8", "--learning-rate", "3e-3"]


def final(run_dir: Path) -> dict:
    return json.loads((run_dir / "final.json").read_text())


# ---------------------------------------------------------------------------------------------------------------------
# The layer, by hand
# ---------------------------------------------------------------------------------------------------------------------


def test_the_layer_adds_the_scaled_low_rank_update_and_trains_only_it():
    base = torch.nn.Linear(3, 2)
    model = torch.nn.Sequential(base)
    apply_lora(model, LoRASpec(rank=1, alpha=4.0, targets=("0",), seed=1))
    layer = model[0]
    assert isinstance(layer, LoRALinear) and layer.scale == 4.0
    assert [name for name, p in model.named_parameters() if p.requires_grad] == ["0.lora_A", "0.lora_B"]
    with torch.no_grad():
        layer.lora_A.copy_(torch.tensor([[1.0, 0.0, 2.0]]))
        layer.lora_B.copy_(torch.tensor([[0.5], [-1.0]]))
    x = torch.tensor([[1.0, 2.0, 3.0]])
    a, b = torch.tensor([[1.0, 0.0, 2.0]]), torch.tensor([[0.5], [-1.0]])
    by_hand = x @ base.weight.T + base.bias + 4.0 * (x @ a.T) @ b.T
    assert torch.allclose(model(x), by_hand)  # 7 = 1 + 6 times B, times alpha / r = 4: +14 and -28
    with adapters_disabled(model):
        assert torch.equal(model(x), base(x))
    assert layer.adapter_enabled


def test_a_is_drawn_from_the_seed_and_the_name_and_b_starts_at_zero():
    def adapters(spec: LoRASpec) -> dict[str, torch.Tensor]:
        model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
        apply_lora(model, spec)
        return {name: p.detach() for name, p in model.named_parameters() if "lora_" in name}

    first, again = adapters(SPEC), adapters(SPEC)
    assert all(torch.equal(first[name], again[name]) for name in first) and len(first) == 2 * 4 * 7
    assert all(not p.any() for name, p in first.items() if name.endswith("lora_B"))
    a_matrices = [p for name, p in first.items() if name.endswith("lora_A")]
    assert not torch.equal(a_matrices[0], a_matrices[1])  # each module its own draw
    bound = 1 / 128 ** 0.5  # in_features of q_proj
    assert a_matrices[0].abs().max() <= bound and a_matrices[0].std() > bound / 3
    other_seed = adapters(LoRASpec(8, 16.0, QWEN2_TARGETS, seed=2))
    value_model = adapters(LoRASpec(8, 16.0, QWEN2_TARGETS, seed=1, model="value"))
    name = next(iter(first))
    assert not torch.equal(first[name], other_seed[name]) and not torch.equal(first[name], value_model[name])


def test_merged_weights_are_the_adapted_layer_rounded_once():
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    apply_lora(model, SPEC)
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.normal_(std=0.02)
    named = [(name, p.detach()) for name, p in model.named_parameters()]
    merged = dict(merged_weights(iter(named), lora_scales(model), torch.bfloat16))
    assert not any("lora_" in name for name in merged) and len(merged) == len(named) - 2 * 28
    layer = model.model.layers[1].mlp.down_proj
    exact = layer.weight + layer.scale * layer.lora_B @ layer.lora_A
    assert torch.equal(merged["model.layers.1.mlp.down_proj.weight"], exact.detach().to(torch.bfloat16))
    plain = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    plain.load_state_dict({name: tensor.float() for name, tensor in dict(
        merged_weights(iter(named), lora_scales(model), torch.float32)).items()}, strict=False)
    ids = torch.tensor([[4, 5, 13, 6, 7, 14]])
    with torch.no_grad():
        assert torch.allclose(plain(ids).logits, model(ids).logits, atol=1e-5)  # the merged model is the adapted one


# ---------------------------------------------------------------------------------------------------------------------
# Bad input, before any model loads
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("changes", "message"), [
    ({"lora_rank": 600}, "vLLM serves adapters up to rank 512 (its max_lora_rank takes 1, 8, 16, 32, 64, 128, 256, "
                         "320, 512)"),
    ({"lora_merge": True}, "--lora-merge and --export-merged merge LoRA adapters: they need --lora-rank"),
    ({"lora_rank": 8, "lora_target_modules": ("q_proj", "lm_head")}, "--lora-target-modules lm_head is refused: vLLM "
                                                                     "leaves an adapter on the LM head"),
    ({"lora_rank": 8, "lora_target_modules": ("embed_tokens",)}, "embed_tokens is refused: the embedding is a lookup"),
    ({"lora_rank": -1}, "--lora-rank must be non-negative"),
])
def test_bad_lora_flags_are_refused(changes: dict, message: str, capsys):
    with pytest.raises(SystemExit) as exit_info:
        grpo_llm.check_args(grpo_llm.Args(**changes, rollout_engine="vllm"), 2)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
GATED_DELTANET = ("out_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
FAMILY_TARGETS = {  # the defaults each family resolves to (zoo models: layer 0 linear attention in the hybrids)
    **dict.fromkeys(("qwen2.5", "qwen3", "llama3", "mistral", "gemma3", "olmo2", "olmo3"), QWEN2_TARGETS),
    "phi3": ("o_proj", "qkv_proj", "gate_up_proj", "down_proj"),
    "qwen3_moe": ATTENTION, "gpt_oss": ATTENTION,  # MoE: attention only
    "qwen3_next": ("in_proj_qkvz", "in_proj_ba", "out_proj", *ATTENTION),
    "qwen3_5": (*GATED_DELTANET, "gate_proj", "up_proj", "down_proj", *ATTENTION),
    "qwen3_5_moe": (*GATED_DELTANET, *ATTENTION),
}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A zoo family's tiny model (assets/build_model_zoo.py), built once per module under its temporary directory."""
    root = tmp_path_factory.mktemp("zoo")
    return lambda family: root / family if (root / family).is_dir() else build_family(family, root / family)


def test_the_default_targets_are_the_familys_projections_and_leave_the_experts_frozen(zoo: Callable, capsys):
    """--lora-target-modules left empty: the embedded Qwen2 gets its seven projections (so LoRA runs keep their
    bits), every zoo family its own names; a MoE model's feed-forward slot (experts, router, shared experts) is left
    out, and vLLM-CPU gives a MoE model's engine merged weights."""
    assert default_targets(str(TINY)) == QWEN2_TARGETS
    assert set(FAMILY_TARGETS) == set(FAMILIES)
    resolved = {family: family_targets(meta_model(str(zoo(family)))) for family in FAMILIES}
    assert resolved == FAMILY_TARGETS
    assert adapter_serving_problem(4, "cpu").startswith("vLLM-CPU 0.32 cannot enable LoRA on a MoE model")
    assert adapter_serving_problem(0, "cpu") is None and adapter_serving_problem(4, "cuda") is None
    grpo_llm.check_args(grpo_llm.Args(lora_rank=8, rollout_engine="vllm"), 2)  # the empty default passes the checks
    assert "error" not in capsys.readouterr().err


def test_the_export_of_every_family_loads_in_peft_with_equal_logits(zoo: Callable, tmp_path: Path):
    """Each zoo family with its default targets and B drawn away from zero: PEFT 0.21's `PeftModel.from_pretrained`
    over the base loads our adapter export and gives our forward's logits exactly (max |difference| 0.0), which
    differ from the base's. Every default target is adapted in every block that holds it."""
    from peft import PeftModel

    ids = torch.tensor([[4, 5, 13, 6, 7, 14, 3, 9, 13, 8, 14]])
    generator = torch.Generator().manual_seed(0)
    for family in FAMILIES:
        directory = zoo(family)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        spec = LoRASpec(rank=8, alpha=16.0, targets=family_targets(model), seed=1)
        adapted = apply_lora(model, spec)
        blocks = model.get_decoder().layers
        assert len(adapted) == sum(1 for block in blocks for name, _ in block.named_modules()
                                   if name.rsplit(".", 1)[-1] in spec.targets), family
        with torch.no_grad():
            for layer in lora_layers(model).values():
                layer.lora_B.copy_(0.05 * torch.randn(layer.lora_B.shape, generator=generator))
        adapter = tmp_path / family
        write_peft_adapter(adapter, {name: p.detach() for name, p in model.named_parameters() if is_adapter(name)},
                           spec, str(directory))
        base = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        with torch.no_grad():
            base_logits = base(ids).logits
            ours = model(ids).logits
            theirs = PeftModel.from_pretrained(base, adapter)(ids).logits
        assert torch.equal(theirs, ours), (family, (theirs - ours).abs().max().item())
        assert (ours - base_logits).abs().max() > 0.1, family


def test_a_target_the_model_lacks_is_named_with_the_ones_it_has():
    problem = targets_problem(meta_model(str(TINY)), ("q_proj", "c_attn"))
    assert problem == ("--lora-target-modules c_attn: the model has no linear layer of that name; its linear layers "
                       "are down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj")


def test_the_output_layer_is_refused_whatever_its_name():
    """BioGPT's output layer is `output_projection`: refused as lm_head is (the trainer's float32 head reads its base
    weight), while its other linear layers may be adapted."""
    from transformers import BioGptConfig, BioGptForCausalLM

    with torch.device("meta"):
        model = BioGptForCausalLM(BioGptConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                               intermediate_size=128, vocab_size=32))
    problem = targets_problem(model, ("q_proj", "output_projection"))
    assert problem.startswith("--lora-target-modules output_projection is refused: it is the model's output layer")
    assert targets_problem(model, ("q_proj", "fc1")) is None


@pytest.mark.parametrize(("changes", "message"), [
    ({"value_lora_rank": 4, "lora_target_modules": ("q_proj", "c_attn")},
     "--lora-target-modules (with --value-lora-rank) c_attn: the model has no linear layer of that name; its linear "
     "layers are down_proj, gate_proj, k_proj, o_proj, q_proj, score, up_proj, v_proj"),
    ({"value_lora_rank": 4, "lora_target_modules": ("q_proj", "score")},
     "--lora-target-modules (with --value-lora-rank) score is refused: it trains whole"),
    ({"value_lora_rank": 4, "value_model": "assets/tiny-adder-teacher", "lora_target_modules": ("lm_head",)},
     "--lora-target-modules (with --value-lora-rank) lm_head is refused"),
])
def test_value_lora_targets_are_checked_against_the_value_model(changes: dict, message: str, capsys):
    """PPO's --value-lora-rank adapts the value model (a token classifier: its head is `score`, which trains whole),
    so its targets are checked against that model's own layers before any model loads, as the policy's are."""
    import ppo_llm

    with pytest.raises(SystemExit) as exit_info:
        ppo_llm.check_args(ppo_llm.Args(**changes, rollout_engine="vllm"), 2)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    ppo_llm.check_args(ppo_llm.Args(value_lora_rank=4, rollout_engine="vllm"), 2)  # the default targets: accepted


@pytest.mark.parametrize(("changes", "refused"), [
    ({}, True),
    ({"dtype": "bfloat16"}, False),
    ({"lora_merge": True}, False),
    ({"rollout_engine": "hf"}, False),
])
def test_lora_in_float32_on_a_gpu_engine_is_refused_before_any_model_loads(changes: dict, refused: bool, capsys):
    """vLLM 0.32 serves adapters on GPUs with Triton kernels that assert float16 or bfloat16
    (vllm/lora/ops/triton_ops/lora_shrink_op.py): the default --dtype float32 is refused there, naming both ways
    out; merged weights, the transformers engine, or the CPU (torch ops) are fine."""
    from common.llm.checks import check_llm_args
    from common.llm.run import LLMArgs

    args = {"lora_rank": 8, "rollout_engine": "vllm", **changes}
    if refused:
        with pytest.raises(SystemExit) as exit_info:
            check_llm_args(LLMArgs(**args), 2, device_type="cuda")
        message = capsys.readouterr().err
        assert exit_info.value.code == 2 and "--lora-rank with --dtype float32 on a GPU" in message
        assert "Pass --dtype bfloat16" in message and "or --lora-merge" in message
    else:
        check_llm_args(LLMArgs(**args), 2, device_type="cuda")
    check_llm_args(LLMArgs(**args), 2, device_type="cpu")


class SleepModeLLM:
    """A stand-in for vLLM 0.32's LLM in sleep mode, which needs CUDA: it records the calls and keeps the state rules
    of the installed source, so a call out of order fails here. It checks our call order only; what the calls do on a
    GPU is vLLM's (vllm/v1/engine/core.py EngineCore.sleep, release_kv_cache_memory, wake_up;
    vllm/v1/executor/abstract.py Executor.sleep, wake_up, discard; vllm/device_allocator/cumem.py)."""

    def __init__(self) -> None:
        self.calls, self.paused, self.sleeping = [], False, set()
        self.llm_engine = self  # add_lora and remove_lora are the engine's

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep({level})")
        self.paused = True  # every level pauses the scheduler
        if level >= 1:
            self.sleeping |= {"weights", "kv_cache"}

    def release_kv_cache_memory(self) -> None:
        self.calls.append("release_kv_cache_memory")
        if not self.paused or self.sleeping:  # EngineCore.release_kv_cache_memory's two RuntimeErrors
            raise RuntimeError("release_kv_cache_memory() requires a completed pause and resident memory")
        self.sleeping.add("kv_cache")

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(f"wake_up({tags})")
        if not self.sleeping or any(tag not in self.sleeping for tag in tags or ()):
            raise AssertionError(f"vLLM warns and does nothing: tags {tags}, asleep {self.sleeping}")
        self.sleeping -= set(tags or self.sleeping)
        self.paused = bool(self.sleeping)  # the scheduler resumes once all memory is resident
        return not self.sleeping

    def collective_rpc(self, method: str | object, kwargs: dict | None = None) -> None:
        assert "weights" not in self.sleeping, "reload (or repack) into released weights"
        if method == "reload_weights":
            list(kwargs["weights_iterator"])
        self.calls.append(method if isinstance(method, str) else method.__name__)

    def add_lora(self, request: object) -> None:
        assert not self.sleeping and not self.paused, "an adapter loaded into an engine not awake"
        self.calls.append(f"add_lora({request.lora_int_id})")

    def remove_lora(self, lora_id: int) -> None:
        self.calls.append(f"remove_lora({lora_id})")

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")


def sleeping_engine(serves_adapters: bool) -> object:
    """A colocated CUDA engine's state around a SleepModeLLM (the constructor would start vLLM)."""
    from common.llm.engines import VLLMEngine
    from common.llm.families import checkpoint_tensors

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.checkpoint_tensors = checkpoint_tensors(str(TINY))
    engine.llm, engine.sleeps, engine.asleep, engine.serves_adapters = SleepModeLLM(), True, [], serves_adapters
    engine.lora, engine.model_path, engine.adapter, engine.adapter_dir = SPEC, str(TINY), None, None
    return engine


def test_the_engine_serving_adapters_releases_the_kv_cache_alone_and_wakes_what_it_released():
    """Our call order around vLLM's sleep mode (CUDA only; checked against SleepModeLLM's rules, not a GPU): with
    adapters, the engine keeps its base on the device and releases only the KV cache (sleep level 0, then
    release_kv_cache_memory), and the update wakes that tag alone; the first update of a resumed run, before any
    sleep, wakes nothing. Full weights: level 2, the weights woken before the reload and the KV cache after it."""
    adapters = [("model.layers.0.self_attn.q_proj.lora_A", torch.zeros(8, 128)),
                ("model.layers.0.self_attn.q_proj.lora_B", torch.zeros(128, 8))]
    engine = sleeping_engine(serves_adapters=True)
    engine.update_adapter(iter(adapters))  # a resume's first sync: the engine never slept
    for _ in range(2):
        engine.sleep()
        engine.update_adapter(iter(adapters))
    engine.close = lambda: None
    assert engine.llm.calls == [
        "add_lora(1)", "reset_prefix_cache",
        "sleep(0)", "release_kv_cache_memory", "wake_up(['kv_cache'])", "add_lora(2)", "remove_lora(1)",
        "reset_prefix_cache",
        "sleep(0)", "release_kv_cache_memory", "wake_up(['kv_cache'])", "add_lora(3)", "remove_lora(2)",
        "reset_prefix_cache"]
    assert not engine.asleep and not engine.llm.sleeping and not engine.llm.paused
    shutil.rmtree(engine.adapter_dir)

    engine = sleeping_engine(serves_adapters=False)
    engine.sleep()
    engine.update_weights(iter([("model.norm.weight", torch.ones(128))]))
    assert engine.llm.calls == ["sleep(2)", "wake_up(['weights'])", "reload_weights", "repack_after_reload",
                                "wake_up(['kv_cache'])", "reset_prefix_cache"]
    assert not engine.asleep and not engine.llm.sleeping and not engine.llm.paused


def test_the_base_fingerprint_reads_pytorch_bin_weights(tmp_path: Path):
    """A base stored as pytorch_model.bin (no safetensors) is fingerprinted by its bytes, not as an empty set of
    files: other weights give another fingerprint."""
    from common.llm.lora import base_fingerprint

    base = tmp_path / "base"
    shutil.copytree(TINY, base, ignore=shutil.ignore_patterns("*.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(TINY)
    torch.save(model.state_dict(), base / "pytorch_model.bin")
    assert torch.equal(AutoModelForCausalLM.from_pretrained(base).model.norm.weight, model.model.norm.weight)
    before = base_fingerprint(str(base))
    with torch.no_grad():
        model.model.norm.weight.add_(0.01)
    torch.save(model.state_dict(), base / "pytorch_model.bin")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert before != base_fingerprint(str(base)) and before != base_fingerprint(str(empty))


def test_a_resume_on_another_value_model_base_is_refused(tmp_path: Path):
    """PPO with --value-lora-rank: the checkpoint names the value model's base too (LLMArgs.adapted_bases), and a
    resume whose --value-model holds other weights is refused, naming it."""
    from dataclasses import asdict

    import ppo_llm
    from common.llm.checkpoint import resume_mismatch
    from common.llm.lora import base_fingerprint
    from common.llm.run import MAY_CHANGE_ON_RESUME

    value = tmp_path / "value"
    shutil.copytree(TINY, value)
    args = ppo_llm.Args(value_lora_rank=4, value_model=str(value), total_steps=4)
    assert args.adapted_bases() == {"value": str(value)}
    bases = {role: {"path": path, "sha256": base_fingerprint(path)} for role, path in args.adapted_bases().items()}
    state = {"world_size": 1, "args": asdict(args), "step": 2, "lora_bases": bases}
    assert resume_mismatch(tmp_path, state, args, 1, MAY_CHANGE_ON_RESUME) is None
    model = AutoModelForCausalLM.from_pretrained(value)
    with torch.no_grad():
        model.model.norm.weight.add_(0.01)
    model.save_pretrained(value)
    problem = resume_mismatch(tmp_path, state, args, 1, MAY_CHANGE_ON_RESUME)
    assert f"holds LoRA adapters trained on the base {str(value)!r} (the value's" in problem
    assert problem.endswith("the adapters would act on another model")


# ---------------------------------------------------------------------------------------------------------------------
# Sharded, on 1 and 2 ranks; the engine at the start
# ---------------------------------------------------------------------------------------------------------------------


def test_adapters_start_the_same_at_any_world_size_and_every_layer_trains(tmp_path: Path):
    """tests/workers/lora_worker.py at world sizes 1 and 2: the same initial adapters; the start is the base model bit
    for bit; each of the 28 adapted layers gets a gradient (the frozen base none); with the adapters switched off the
    policy's logprobs equal a separately loaded reference's after an update moved it; in bfloat16 the base is held in
    bfloat16 and the adapters in float32 in the same FSDP units, and AdamW holds the adapters alone."""
    summaries = []
    for nproc in (0, 2):
        path = tmp_path / f"summary{nproc}.json"
        check(run_script("tests/workers/lora_worker.py", [str(path)], nproc=nproc, timeout=300))
        summaries.append(json.loads(path.read_text()))
    assert summaries[0]["initial_hash"] == summaries[1]["initial_hash"]
    for summary in summaries:
        assert summary["base_logprobs_equal"] and summary["moved"] and summary["reference_equal"]
        assert summary["adapted_layers"] == summary["layers_with_gradient"] == 28
        assert summary["frozen_with_gradient"] == 0
        assert summary["trained_dtypes"] == ["torch.float32"] and summary["frozen_dtypes"] == ["torch.bfloat16"]
        assert summary["optimized"] == 2 * 28 and summary["bf16_step"]


def test_the_engine_serving_fresh_adapters_samples_as_the_engine_without_lora(tmp_path: Path):
    results = {}
    for mode in ("base", "fresh"):
        check(run_script("tests/workers/lora_engine_worker.py", [str(tmp_path / f"{mode}.json"), mode], timeout=300))
        results[mode] = json.loads((tmp_path / f"{mode}.json").read_text())
    assert results["fresh"] == results["base"]  # tokens and logprobs, bit for bit
    assert len({str(sample[0]) for sample in results["base"]}) > 3  # the samples are not all alike


# ---------------------------------------------------------------------------------------------------------------------
# End to end under torchrun with vLLM-CPU
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GRPO with rank-8 adapters, --beta 0.04 (the reference: the adapters switched off) and --export-merged."""
    run_root = tmp_path_factory.mktemp("lora_grpo")
    check(run_script("grpo_llm.py", [*SHORT, *LORA, "--beta", "0.04", "--export-merged", "--run-root",
                                     str(run_root)], nproc=2))
    return only_run_dir(run_root)


def test_lora_grpo_resumes_to_the_same_bits(lora_run: Path, tmp_path: Path):
    """Resumed from step 2: steps 3 and 4 computed again in fresh processes (adapters loaded from the checkpoint,
    served to a new engine) give the same bytes and final weights."""
    steps = [m for m in read_metrics(lora_run) if m["step"]]
    assert all(m["train/grad_norm"] > 0 for m in steps) and steps[-1]["train/kl"] > 0  # it moved from the reference
    assert all(m["mismatch/logprob_abs_diff_mean"] < 1e-4 for m in steps)  # the engine serves what trained
    copy = tmp_path / "copy"
    shutil.copytree(lora_run, copy)
    check(run_script("grpo_llm.py", [*SHORT, *LORA, "--beta", "0.04", "--export-merged", "--resume",
                                     str(copy / "checkpoints" / "step_00000002")], nproc=2))
    assert filecmp.cmp(copy / "metrics.jsonl", lora_run / "metrics.jsonl", shallow=False)
    assert final(copy)["parameter_sha256"] == final(lora_run)["parameter_sha256"]


def test_a_lora_checkpoint_holds_the_adapters_and_names_its_base(lora_run: Path, tmp_path: Path):
    """The adapters and their Adam state, not the base: the sharded state names the adapters alone; the export is a
    PEFT adapter that vLLM serves as the merged export's full model samples (greedy tokens equal, logprobs within
    float32 rounding); trainer_state.pt names the base by path and fingerprint."""
    checkpoint = lora_run / "checkpoints" / "step_00000004"
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 8, 16.0)
    with safe_open(checkpoint / "adapter_model.safetensors", "pt") as adapter:
        names = sorted(adapter.keys())
    assert len(names) == 56 and names[0] == "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
    keys = FileSystemReader(str(checkpoint / "trainer")).read_metadata().state_dict_metadata
    models = [key for key in keys if key.startswith("policy.model.")]
    assert len(models) == 56 and all(key.endswith(("lora_A", "lora_B")) for key in models)  # no base parameter
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
    assert list(state["lora_bases"]) == ["policy"]
    assert state["lora_bases"]["policy"]["path"] == str(TINY) and len(state["lora_bases"]["policy"]["sha256"]) == 64
    AutoModelForCausalLM.from_pretrained(checkpoint / "merged")  # a plain transformers model
    results = {}
    for mode, directory in (("adapter", checkpoint), ("model", checkpoint / "merged")):
        out = tmp_path / f"{mode}.json"
        check(run_script("tests/workers/lora_engine_worker.py", [str(out), mode, str(directory)], timeout=300))
        results[mode] = json.loads(out.read_text())
    greedy = slice(6, 9)
    assert [s[0] for s in results["adapter"][greedy]] == [s[0] for s in results["model"][greedy]]
    assert max(abs(a - b) for x, y in zip(results["adapter"], results["model"]) if x[0] == y[0]
               for a, b in zip(x[1], y[1])) < 1e-4


def test_resuming_on_another_base_is_refused(tmp_path: Path):
    base = tmp_path / "base"
    shutil.copytree(TINY, base)
    args = ["--model-name-or-path", str(base), *SHORT[:-6], "--total-steps", "2", "--save-every", "1", *LORA]
    check(run_script("grpo_llm.py", [*args, "--run-root", str(tmp_path / "runs")]))
    model = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        model.model.norm.weight.add_(0.01)  # the same path, other weights
    model.save_pretrained(base)
    checkpoint = only_run_dir(tmp_path / "runs") / "checkpoints" / "step_00000001"
    result = run_script("grpo_llm.py", [*args, "--resume", str(checkpoint)], timeout=300)
    assert result.returncode == 2
    assert f"holds LoRA adapters trained on the base {str(base)!r}" in result.stderr
    assert "the adapters would act on another model" in result.stderr


def test_lora_in_the_split_layout_one_step_off_resumes_exactly(tmp_path: Path):
    """The rollout rank's engine gets the adapters alone over the bridge, one version behind."""
    args = [*SHORT, *LORA, "--rollout-ranks", "1", "--max-staleness", "1"]
    check(run_script("grpo_llm.py", [*args, "--run-root", str(tmp_path / "full")], nproc=2))
    full = only_run_dir(tmp_path / "full")
    assert [m["rollout/staleness"] for m in read_metrics(full) if m["step"] > 1] == [1, 1, 1]
    copy = tmp_path / "copy"
    shutil.copytree(full, copy)
    check(run_script("grpo_llm.py", [*args, "--resume", str(copy / "checkpoints" / "step_00000002")], nproc=2))
    assert filecmp.cmp(copy / "metrics.jsonl", full / "metrics.jsonl", shallow=False)
    assert final(copy)["parameter_sha256"] == final(full)["parameter_sha256"]


def test_ppo_with_lora_on_the_policy_and_the_value_model_and_online_dpo(tmp_path: Path):
    """PPO: the policy and the value model each train adapters (the value head fully), the reference is the policy
    with its adapters off; online DPO the same with its own loss, its engine given merged weights (--lora-merge).
    Both end with their adapters in the checkpoint and nothing else trained, the engine sampling what trained."""
    for script, extra in (("ppo_llm.py", ["--value-lora-rank", "4"]), ("dpo_online.py", ["--lora-merge"])):
        check(run_script(script, [*SHORT[:-6], "--total-steps", "2", "--save-every", "0", *LORA, *extra,
                                  "--run-root", str(tmp_path / script)], nproc=2))
        run_dir = only_run_dir(tmp_path / script)
        steps = [m for m in read_metrics(run_dir) if m["step"]]
        assert len(steps) == 2 and steps[-1]["train/grad_norm"] > 0
        assert all(m["mismatch/logprob_abs_diff_mean"] < 1e-4 for m in steps)
        keys = FileSystemReader(str(run_dir / "checkpoints" / "step_00000002" / "trainer")).read_metadata() \
            .state_dict_metadata
        models = [key for key in keys if ".model." in key]
        assert models and all("lora_" in key or "score" in key for key in models), models[:5]
        if script == "ppo_llm.py":
            assert any(key.startswith("value_model.model.") and "lora_" in key for key in keys)
            assert any(key.startswith("value_model.model.score") for key in keys)


def test_lora_on_episodes_with_gspo(tmp_path: Path):
    """Multi-turn episodes (two turns around a 3-token reply) with GSPO's sequence ratio over two minibatches."""
    args = [*SHORT[:-6], "--task", "tests/second_look_task.py:SecondLookTask", "--max-completion-length", "16",
            "--total-steps", "2", "--save-every", "0", *LORA, "--importance-sampling-level", "sequence",
            "--loss-type", "grpo", "--num-minibatches", "2"]
    check(run_script("grpo_llm.py", [*args, "--run-root", str(tmp_path)], nproc=2))
    steps = [m for m in read_metrics(only_run_dir(tmp_path)) if m["step"]]
    assert all(m["episode/env_tokens"] == 3.0 and m["train/completion_length"] == m["episode/model_tokens"]
               for m in steps)
    assert all(m["mismatch/logprob_abs_diff_mean"] < 1e-4 and m["train/grad_norm"] > 0 for m in steps)
