"""Run one LLM script (grpo_llm.py by default) with its default arguments for several seeds, one after another, each
into its own run root, then summarise held-out greedy accuracy over the seeds:

- `table.md`: per seed, `eval/accuracy` before training (step 0), after (the last logged eval), best (and its step),
  the gain, steps/s and wall clock; then a mean +- std row (population std, as benchmarks/dqn_table.py);
- `accuracy.png`: held-out accuracy against step, one line per seed;
- `results.json`: the same numbers, every seed's eval curve, and the commands.

    python benchmarks/llm_seeds.py                                   # grpo_llm.py, seeds 1 2 3, torchrun, 2 procs
    python benchmarks/llm_seeds.py ppo_llm.py --seeds 1 2 -- --total-steps 20   # after `--`: passed to the script
    python benchmarks/llm_seeds.py --runs runs/llm_seeds/grpo_llm__<timestamp>  # only re-read finished runs

Each seed runs as `torchrun --nproc_per_node N SCRIPT --seed S --run-root OUT/seed_S [extra args]` (`--nproc 0`: plain
python). Held-out accuracy is `eval/accuracy` from metrics.jsonl (step 0: before training); steps/s is the number of
steps over their summed `perf/step_s` (perf.jsonl), leaving out step 1 (one-off warm-up), so it is 1 / mean step
time. Wall clock is measured around each command, start-up included; for runs that are only re-read and were not
launched by this script, it is the time from the manifest's `started` to the last metrics write, which misses the
start-up before the run directory exists.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_FILE = "llm_seeds_launch.json"  # written next to a run directory: the command and its measured wall clock


def seed_command(script: str, seed: int, run_root: Path, nproc: int, extra: list[str]) -> list[str]:
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun) if torchrun.exists() else "torchrun", "--nproc_per_node", str(nproc)] if nproc else \
        [sys.executable]
    return [*launcher, script, "--seed", str(seed), "--run-root", str(run_root), *extra]


def run_seeds(script: str, seeds: list[int], nproc: int, extra: list[str], out: Path) -> tuple[list[Path], bool]:
    """Run the seeds sequentially; return the run roots and whether every command succeeded."""
    roots, ok = [], True
    for seed in seeds:
        run_root = out / f"seed_{seed}"
        run_root.mkdir(parents=True, exist_ok=False)
        command = seed_command(script, seed, run_root, nproc, extra)
        print(f"$ {shlex.join(command)}", flush=True)
        start = time.time()
        returncode = subprocess.run(command, cwd=ROOT).returncode
        wall_s = time.time() - start
        launch = {"command": shlex.join(command), "cwd": str(ROOT), "returncode": returncode, "wall_clock_s": wall_s}
        (run_root / LAUNCH_FILE).write_text(json.dumps(launch, indent=2) + "\n")
        print(f"seed {seed}: exit {returncode} after {wall_s:.0f} s", flush=True)
        ok &= returncode == 0
        roots.append(run_root)
    return roots, ok


def find_run_dirs(paths: list[Path]) -> list[Path]:
    """Run directories (holding metrics.jsonl and manifest.json) at or under the given paths."""
    found = []
    for path in paths:
        if (path / "metrics.jsonl").is_file():
            candidates = [path]
        else:
            candidates = sorted(p.parent for p in path.rglob("metrics.jsonl"))
        found += [p for p in candidates if (p / "manifest.json").is_file() and p not in found]
    return found


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarise_run(run_dir: Path) -> dict | None:
    """A run's numbers, or None (with a message) when it logged no held-out accuracy, e.g. because it failed."""
    records = read_jsonl(run_dir / "metrics.jsonl")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    curve = [(int(r["step"]), float(r["eval/accuracy"])) for r in records if "eval/accuracy" in r]
    # timings live in perf.jsonl (metrics.jsonl holds only what is reproducible); older runs logged them in metrics
    perf_path = run_dir / "perf.jsonl" if (run_dir / "perf.jsonl").is_file() else run_dir / "metrics.jsonl"
    step_times = [r["perf/step_s"] for r in read_jsonl(perf_path) if r["step"] > 1 and "perf/step_s" in r]
    launch_path = run_dir.parent / LAUNCH_FILE
    if launch_path.is_file():
        launch = json.loads(launch_path.read_text())
        command, wall_clock_s, wall_clock_source = launch["command"], launch["wall_clock_s"], "measured"
    else:
        started = datetime.strptime(manifest["started"], "%Y-%m-%dT%H:%M:%S%z").timestamp()
        last_write = max((run_dir / name).stat().st_mtime for name in ("metrics.jsonl", perf_path.name))
        command, wall_clock_s = manifest.get("command", "?"), last_write - started
        wall_clock_source = "manifest start to last metrics write"
    if not curve:
        print(f"skipping {run_dir}: no eval/accuracy in metrics.jsonl", file=sys.stderr)
        return None
    best_step, best = max(curve, key=lambda point: (point[1], -point[0]))  # the earliest step at the best value
    return {
        "run_dir": str(run_dir), "exp_name": manifest.get("exp_name", "?"), "seed": manifest["args"]["seed"],
        "task": manifest["args"].get("task", "addition"),
        "command": command,
        "before": curve[0][1], "before_step": curve[0][0], "after": curve[-1][1], "after_step": curve[-1][0],
        "best": best, "best_step": best_step, "gain": curve[-1][1] - curve[0][1],
        "steps_per_s": len(step_times) / sum(step_times) if step_times else float("nan"),
        "mean_step_s": float(np.mean(step_times)) if step_times else float("nan"), "steps_timed": len(step_times),
        "wall_clock_s": wall_clock_s, "wall_clock_source": wall_clock_source, "curve": curve,
    }


SUMMARY_KEYS = ("before", "after", "best", "gain", "steps_per_s", "mean_step_s", "wall_clock_s")


def mean_std(runs: list[dict]) -> dict[str, dict[str, float]]:
    return {key: {"mean": float(np.mean([run[key] for run in runs])), "std": float(np.std([run[key] for run in runs]))}
            for key in SUMMARY_KEYS}


def clock(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"


def table(runs: list[dict], stats: dict[str, dict[str, float]]) -> str:
    lines = ["| seed | held-out before | after | best (step) | gain | steps/s | wall clock |", "|---" * 7 + "|"]
    for run in runs:
        lines.append(f"| {run['seed']} | {run['before']:.1%} | {run['after']:.1%} | {run['best']:.1%} "
                     f"({run['best_step']}) | {run['gain'] * 100:+.1f} pt | {run['steps_per_s']:.3f} | "
                     f"{clock(run['wall_clock_s'])} |")
    pct = {key: f"{stats[key]['mean']:.1%} +- {stats[key]['std'] * 100:.1f}" for key in ("before", "after", "best")}
    lines.append(f"| mean +- std (n={len(runs)}) | {pct['before']} | {pct['after']} | {pct['best']} | "
                 f"{stats['gain']['mean'] * 100:+.1f} +- {stats['gain']['std'] * 100:.1f} pt | "
                 f"{stats['steps_per_s']['mean']:.3f} +- {stats['steps_per_s']['std']:.3f} | "
                 f"{clock(stats['wall_clock_s']['mean'])} +- {stats['wall_clock_s']['std']:.0f} s |")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.0))
    for run in runs:
        steps, accuracy = zip(*run["curve"])
        axes.plot(steps, [100 * a for a in accuracy], marker="o", markersize=3, label=f"seed {run['seed']}")
    axes.set(xlabel="step", ylabel="held-out greedy accuracy (%)", title=title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str]) -> int:
    ours, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("script", nargs="?", default="grpo_llm.py", help="the LLM script to run, from the repo root")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="seeds, run one after another")
    parser.add_argument("--nproc", type=int, default=2, help="torchrun --nproc_per_node (0: plain python)")
    parser.add_argument("--out", type=Path, help="where the run roots and the summary go (default: "
                        "runs/llm_seeds/{script}__{timestamp}; with --runs and one folder holding runs: that folder)")
    parser.add_argument("--runs", type=Path, nargs="+", help="re-read these run directories (or folders holding "
                        "them) instead of running anything")
    args = parser.parse_args(ours)
    out = args.out or ROOT / "runs" / "llm_seeds" / f"{Path(args.script).stem}__{time.strftime('%Y%m%d-%H%M%S')}"
    ok = True
    if args.runs:
        if extra:
            parser.error("arguments after `--` go to the script; with --runs nothing is run")
        run_dirs = find_run_dirs(args.runs)
        if args.out is None and len(args.runs) == 1 and not (args.runs[0] / "metrics.jsonl").is_file():
            out = args.runs[0]  # re-reading one benchmark folder refreshes its summary in place
    else:
        roots, ok = run_seeds(args.script, args.seeds, args.nproc, extra, out)
        run_dirs = find_run_dirs(roots)
    runs = [run for run in map(summarise_run, run_dirs) if run is not None]
    if not runs:
        print("no run directory with eval/accuracy in its metrics.jsonl", file=sys.stderr)
        return 1
    runs.sort(key=lambda run: (run["seed"], run["run_dir"]))
    stats = mean_std(runs)
    name = "+".join(sorted({run["exp_name"] for run in runs}))
    tasks = "+".join(sorted({run["task"] for run in runs}))
    out.mkdir(parents=True, exist_ok=True)
    text = table(runs, stats)
    commands = [run["command"] for run in runs]
    (out / "table.md").write_text(text + "\nCommands:\n\n" + "".join(f"    {c}\n" for c in commands))
    plot(runs, f"{name} on {tasks}: held-out accuracy, {len(runs)} seeds", out / "accuracy.png")
    results = {"script": name, "summary": stats, "runs": runs, "commands": commands,
               "benchmark_command": shlex.join(["python", os.path.relpath(__file__, ROOT), *argv])}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n" + text)
    print("commands:\n" + "".join(f"  {c}\n" for c in commands))
    print(f"wrote {out / 'table.md'}, {out / 'accuracy.png'}, {out / 'results.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
