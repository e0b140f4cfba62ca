"""Run by tests/test_lora.py, one process each (vLLM-CPU): samples the same seeded requests from one engine and
writes their tokens and logprobs as JSON.

    python tests/workers/lora_engine_worker.py OUT.json base          # the embedded model, no LoRA in the engine
    python tests/workers/lora_engine_worker.py OUT.json fresh         # LoRA enabled, serving fresh adapters (B = 0)
    python tests/workers/lora_engine_worker.py OUT.json adapter DIR   # LoRA enabled, serving the PEFT adapter in DIR
    python tests/workers/lora_engine_worker.py OUT.json model DIR     # the model in DIR (a merged export), no LoRA
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.distributed import init_distributed  # noqa: E402
from common.llm.engines import make_engine  # noqa: E402
from common.llm.lora import (  # noqa: E402
    LoRASpec,
    apply_lora,
    default_targets,
    is_adapter,
    unserved_targets_problem,
)

TINY = str(ROOT / "assets" / "tiny-adder")
SPEC = LoRASpec(rank=8, alpha=16.0, targets=default_targets(TINY), seed=1)
PROMPTS = [[4, 5, 13, 6, 7, 14], [12, 12, 12, 13, 4, 14], [3, 9, 13, 8, 14]] * 2  # 12+34=, 999+1=, 27+6=
SEEDS = [11, 12, 13, 14, 15, 16]


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    init_distributed()
    path = sys.argv[3] if mode == "model" else TINY
    lora = SPEC if mode in ("fresh", "adapter") else None
    engine = make_engine("vllm", path, "float32", 1, 64, torch.device("cpu"), 64 * 2**20, 0.3, lora=lora)
    if mode == "fresh":  # vLLM's model serves the default targets, through its packed qkv_proj and gate_up_proj
        assert unserved_targets_problem(SPEC.targets, engine.served_lora_modules) is None
        assert "c_attn" in unserved_targets_problem(("q_proj", "c_attn"), engine.served_lora_modules)
        model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
        apply_lora(model, SPEC)
        engine.update_adapter((name, p.detach()) for name, p in model.named_parameters() if is_adapter(name))
    if mode == "adapter":
        from vllm.lora.request import LoRARequest

        engine.adapter = LoRARequest("exported", 1, sys.argv[3])
    samples = engine.generate(PROMPTS, SEEDS, 8, 1.0, [1]) + engine.generate(PROMPTS[:3], [0, 0, 0], 8, 0.0, [1])
    out.write_text(json.dumps([[s.completion_ids, s.logprobs] for s in samples]))
    engine.close()


if __name__ == "__main__":
    main()
