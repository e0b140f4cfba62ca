"""LoRA against full fine-tuning on this machine, in one sitting: GRPO's step time, the weight sync's seconds, a
checkpoint's bytes and each run's peak resident memory, for full fine-tuning, LoRA serving the adapters (the
default) and LoRA with merged weights (--lora-merge), the configurations taking turns so that the machine's load
hits all of them alike; ratios against full fine-tuning.

    python benchmarks/lora.py --steps 30 --repeats 2 --out benchmarks/results/lora
    python benchmarks/lora.py --steps 30 -- --model-name-or-path assets/tiny-countdown --task countdown_tiny

The peak memory is the largest resident set of the run's processes (GNU time's %M over torchrun, which waits for
its workers); on the CPU it is mostly the processes' own code (torch, vLLM), so read it as what LoRA adds or saves
there, not as a GPU's figure (benchmarks/memory_estimate.py --lora-rank prices GPUs).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGURATIONS = {"full fine-tuning": [], "LoRA r=8, adapters": ["--lora-rank", "8"],
                  "LoRA r=8, --lora-merge": ["--lora-rank", "8", "--lora-merge"]}


def run(flags: list[str], steps: int, nproc: int, extra: list[str], run_root: Path) -> dict[str, float]:
    command = ["/usr/bin/time", "-f", "maxrss_kb %M", str(ROOT / ".venv" / "bin" / "torchrun"), "--standalone",
               "--nproc_per_node", str(nproc), "grpo_llm.py", "--seed", "1", "--total-steps", str(steps),
               "--eval-every", "0", "--num-eval-prompts", "16", *flags, *extra, "--run-root", str(run_root)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"failed: {' '.join(command)}\n{result.stderr[-3000:]}")
    (run_dir,) = [p for p in run_root.iterdir() if p.is_dir()]
    perf = [json.loads(line) for line in (run_dir / "perf.jsonl").read_text().splitlines()]
    perf = [record for record in perf if record["step"] > 1 and "perf/step_s" in record]  # after the warm-up
    checkpoint = run_dir / "checkpoints" / f"step_{steps:08d}"
    maxrss = next(line for line in result.stderr.splitlines() if line.startswith("maxrss_kb"))
    return {"step_s": statistics.mean(r["perf/step_s"] for r in perf),
            "sync_s": statistics.mean(r["perf/weight_sync_s"] for r in perf),
            "train_s": statistics.mean(r["perf/train_s"] for r in perf),
            "checkpoint_bytes": sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file()),
            "peak_rss_mb": int(maxrss.split()[1]) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "lora")
    parser.add_argument("extra", nargs="*", help="after --: more flags for every run")
    options = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGURATIONS}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(options.repeats):
            for name, flags in CONFIGURATIONS.items():
                run_root = Path(scratch) / f"{repeat}-{len(results[name])}-{name.replace(' ', '_')}"
                results[name].append(run(flags, options.steps, options.nproc, options.extra, run_root))
                print(name, results[name][-1], flush=True)
    means = {name: {key: statistics.mean(r[key] for r in rows) for key in rows[0]} for name, rows in results.items()}
    full = means["full fine-tuning"]
    lines = [f"GRPO, {options.steps} steps x {options.repeats} runs each, {options.nproc} processes, taking turns "
             f"(`python benchmarks/lora.py {' '.join(sys.argv[1:])}`); means over the steps after the first:", "",
             "| configuration | step (s) | weight sync (s) | update (s) | checkpoint (MB) | peak RSS (MB) | step / "
             "full | sync / full | checkpoint / full |", "|---" * 9 + "|"]
    for name, mean in means.items():
        lines.append(f"| {name} | {mean['step_s']:.3f} | {mean['sync_s']:.4f} | {mean['train_s']:.3f} | "
                     f"{mean['checkpoint_bytes'] / 1e6:.2f} | {mean['peak_rss_mb']:,.0f} | "
                     f"{mean['step_s'] / full['step_s']:.2f} | {mean['sync_s'] / full['sync_s']:.2f} | "
                     f"{mean['checkpoint_bytes'] / full['checkpoint_bytes']:.3f} |")
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "lora_vs_full.json").write_text(json.dumps({"command": sys.argv, "runs": results}, indent=1) + "\n")
    (options.out / "lora_vs_full.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
