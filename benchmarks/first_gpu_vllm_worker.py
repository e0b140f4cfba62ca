"""benchmarks/first_gpu_check.py's vLLM part, in a process of its own: is a seeded sample of the embedded model the
same alone, among 128 other requests, after its prompt was cached, with its prefill chunked, and over a 3-turn
episode with the prefix cache kept or reset between turns? Prints one JSON line: for each context, whether it equals
the request alone, and the first differing position where it does not.

    python benchmarks/first_gpu_vllm_worker.py [--quick]
"""

import json
import os
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.distributed import init_distributed  # noqa: E402

TINY = str(ROOT / "assets" / "tiny-adder")
DIGITS = list(range(3, 13))  # the embedded tokenizer's 0-9


def main() -> None:
    quick = "--quick" in sys.argv
    cuda = torch.cuda.is_available()
    if cuda:
        os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")  # as the scripts run vLLM on CUDA
    init_distributed()
    from vllm import LLM, SamplingParams

    draw = random.Random(0)
    prompt = [draw.choice(DIGITS) for _ in range(36)]
    others = [[draw.choice(DIGITS) for _ in range(draw.randint(8, 40))] for _ in range(16 if quick else 128)]
    common = dict(model=TINY, dtype="float32" if not cuda else "bfloat16", seed=0,
                  distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs",
                  max_model_len=64, enforce_eager=not cuda, block_size=16 if cuda else 32,
                  hf_overrides={"head_dtype": "float32"}, use_tqdm_on_load=False,
                  **({"gpu_memory_utilization": 0.2} if cuda else {"kv_cache_memory_bytes": 4 * 2**20}))

    def sample(llm, batch: list[list[int]], index: int, seeds: list[int], max_tokens: int = 8) -> list:
        params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed, logprobs=0, stop_token_ids=[1])
                  for seed in seeds]
        output = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)[index].outputs[0]
        return [list(output.token_ids), [next(iter(step.values())).logprob for step in output.logprobs]]

    def attempt(function) -> list | dict:  # one context's failure (e.g. a mode this platform lacks) is a finding
        try:
            return function()
        except Exception as error:
            return {"error": f"{type(error).__name__}: {error}"}

    llm = LLM(enable_prefix_caching=True, **common)
    alone = sample(llm, [prompt], 0, [7])
    contexts = {"cached": attempt(lambda: sample(llm, [prompt], 0, [7])),
                "among_others": attempt(lambda: sample(llm, [*others[:64], prompt, *others[64:]], min(64, len(others)),
                                                       [*range(100, 100 + min(64, len(others))), 7,
                                                        *range(300, 300 + max(0, len(others) - 64))]))}

    def episode(llm, reset: bool) -> list:
        tokens, turns = list(prompt), []
        for turn in range(3):
            if reset:
                llm.reset_prefix_cache()
            ids, logprobs = sample(llm, [tokens], 0, [7 + turn], 6)
            turns.append([ids, logprobs])
            tokens += ids + [13, 3, 14]  # the turn, then an environment's reply "+0="
        return turns

    kept, reset = attempt(lambda: episode(llm, False)), attempt(lambda: episode(llm, True))
    llm.llm_engine.engine_core.shutdown()
    contexts["prefill_chunked"] = attempt(lambda: sample(
        LLM(enable_prefix_caching=False, enable_chunked_prefill=True, max_num_batched_tokens=16 if cuda else 32,
            **common), [prompt], 0, [7]))

    def compare(a: list, b: list | dict) -> dict:
        if isinstance(b, dict):
            return b
        if a == b:
            return {"equal": True}
        first = next((i for i, (x, y) in enumerate(zip(a[0], b[0])) if x != y), min(len(a[0]), len(b[0])))
        return {"equal": False, "first_differing_token": first, "alone": a, "here": b}

    report = {name: compare(alone, value) for name, value in contexts.items()}
    report["episode_cache_kept_vs_reset"] = compare(kept, reset) if isinstance(kept, list) else kept
    print(json.dumps(report))


if __name__ == "__main__":
    main()
