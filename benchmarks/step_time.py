"""GRPO step time, for one run or for two source trees side by side.

Summarise a finished run (mean of each perf/ metric over the steps after the first, which pays one-off warm-up):

    python benchmarks/step_time.py runs/grpo_llm__1__<timestamp>

Compare two checkouts on this machine in one sitting: each tree's `grpo_llm.py` runs with the defaults except
--total-steps (no evaluation in between), alternating old, new, old, new... so that load on the machine hits both
alike; the ratio of the mean step times is the speed-up.

    git worktree add /tmp/old <commit> && ln -s $PWD/.venv /tmp/old/.venv
    python benchmarks/step_time.py --compare /tmp/old . --steps 30 --repeats 2

The same tree with and without an environment setting, e.g. preloaded allocator and OpenMP libraries:

    python benchmarks/step_time.py --compare . . --new-env LD_PRELOAD=/path/libtcmalloc_minimal.so.4:/path/libiomp5.so
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timings(run_dir: Path) -> list[dict[str, float]]:
    """perf/ records of the steps after the first (perf.jsonl; older runs kept them in metrics.jsonl)."""
    source = run_dir / "perf.jsonl" if (run_dir / "perf.jsonl").is_file() else run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in source.read_text().splitlines()]
    return [r for r in records if r["step"] > 1 and "perf/step_s" in r]


def summarise(run_dir: Path) -> None:
    steps = timings(run_dir)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    print(f"{run_dir.name}: world size {manifest['world_size']}, {len(steps)} steps averaged")
    print(f"  command: {manifest['command']}")
    for key in sorted(k for k in steps[0] if k.startswith("perf/")):
        print(f"  {key:28s} {statistics.mean(r[key] for r in steps):12.3f}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/accuracy" in r]
    if evals:
        print(f"  held-out accuracy: {evals[0]['eval/accuracy']:.3f} (step {evals[0]['step']}) -> "
              f"{evals[-1]['eval/accuracy']:.3f} (step {evals[-1]['step']})")


def run_tree(tree: Path, steps: int, nproc: int, run_root: Path, env: dict[str, str]) -> tuple[Path, float]:
    """One run of the tree's grpo_llm.py; returns its run directory and its wall clock, start-up included."""
    command = [str(tree / ".venv" / "bin" / "torchrun"), "--standalone", "--nproc_per_node", str(nproc),
               "grpo_llm.py", "--seed", "1", "--total-steps", str(steps), "--eval-every", "0",
               "--num-eval-prompts", "16", "--run-root", str(run_root)]
    print("  $ (cd", tree, "&&", " ".join([*(f"{k}={v}" for k, v in env.items()), *command[1:]]) + ")", flush=True)
    started = time.time()
    subprocess.run(command, cwd=tree, check=True, capture_output=True, text=True, env={**os.environ, **env})
    (run_dir,) = [p for p in run_root.iterdir() if p.is_dir()]
    return run_dir, time.time() - started


def compare(old: Path, new: Path, steps: int, repeats: int, nproc: int, new_env: dict[str, str]) -> None:
    means: dict[str, list[float]] = {"old": [], "new": []}
    parts: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    walls: dict[str, list[float]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(repeats):
            for label, tree, env in (("old", old, {}), ("new", new, new_env)):
                run_dir, wall = run_tree(tree.resolve(), steps, nproc, Path(scratch) / f"{label}{repeat}", env)
                records = timings(run_dir)
                means[label].append(statistics.mean(r["perf/step_s"] for r in records))
                parts[label] += records
                walls[label].append(wall)
                print(f"  {label} run {repeat + 1}: mean perf/step_s {means[label][-1]:.3f}, wall {wall:.1f} s",
                      flush=True)
    print(f"\n| measure (mean over steps 2-{steps}, {repeats} runs each) | old ({old}) | new ({new}) | speed-up |")
    print("|---|---|---|---|")
    for key in ("perf/step_s", "perf/weight_sync_s", "perf/rollout_tokens_per_s", "perf/train_tokens_per_s"):
        a, b = (statistics.mean(r[key] for r in parts[label]) for label in ("old", "new"))
        print(f"| {key} | {a:.3f} | {b:.3f} | {(b / a if key.endswith('per_s') else a / b):.2f}x |")
    a, b = statistics.mean(walls["old"]), statistics.mean(walls["new"])
    print(f"| wall clock of a run, start-up included (s) | {a:.1f} | {b:.1f} | {a / b:.2f}x |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", nargs="?", type=Path, help="a finished run to summarise")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("OLD_TREE", "NEW_TREE"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--new-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable set for the NEW_TREE runs only (repeatable)")
    args = parser.parse_args()
    if args.compare:
        compare(*args.compare, args.steps, args.repeats, args.nproc, dict(e.split("=", 1) for e in args.new_env))
    elif args.run_dir:
        summarise(args.run_dir)
    else:
        sys.exit(parser.format_usage())
