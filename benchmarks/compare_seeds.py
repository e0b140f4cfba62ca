"""Several `benchmarks/llm_seeds.py` results side by side: one table of mean +- std (population std over the seeds,
as llm_seeds.py) of held-out greedy accuracy after training and at its best, the difference of each configuration's
mean final accuracy from the first one's, and one PNG of every configuration's curves (mean, a band of +- std, and
each seed thin); with `--wall-clock`, a second panel against the training seconds (step x the run's mean step time,
evaluations left out).

    python benchmarks/compare_seeds.py --out benchmarks/results/split_learning \\
        colocated=runs/seeds/colocated "split S=1, TIS"=runs/seeds/split_tis
"""

import argparse
import json
from pathlib import Path

import numpy as np


def load(spec: str) -> tuple[str, dict]:
    label, _, folder = spec.rpartition("=")  # labels may hold "=" (S=1), folders do not
    return label, json.loads((Path(folder) / "results.json").read_text())


def table(results: dict[str, dict]) -> str:
    lines = ["| configuration | seeds | final held-out | best held-out | final vs first | mean step (s) |",
             "|---|---|---|---|---|---|"]
    first = next(iter(results.values()))["summary"]["after"]["mean"]
    for label, result in results.items():
        summary, seeds = result["summary"], ", ".join(str(run["seed"]) for run in result["runs"])
        per_seed = " / ".join(f"{run['after']:.1%}" for run in result["runs"])
        lines.append(f"| {label} | {seeds} | {summary['after']['mean']:.1%} +- {summary['after']['std'] * 100:.1f} "
                     f"({per_seed}) | {summary['best']['mean']:.1%} +- {summary['best']['std'] * 100:.1f} | "
                     f"{(summary['after']['mean'] - first) * 100:+.1f} pt | {summary['mean_step_s']['mean']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, dict], path: Path, title: str, wall_clock: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(1, 2 if wall_clock else 1, figsize=(12.0 if wall_clock else 7.0, 4.4), squeeze=False)
    for index, (label, result) in enumerate(results.items()):
        color = f"C{index}"
        curves = [dict(run["curve"]) for run in result["runs"]]
        steps = sorted(set.intersection(*(set(curve) for curve in curves)))
        values = np.array([[100 * curve[step] for step in steps] for curve in curves])
        seconds = np.array(steps) * result["summary"]["mean_step_s"]["mean"]
        for axes, x in zip(panels[0], (np.array(steps), seconds)):
            for row in values:
                axes.plot(x, row, color=color, alpha=0.25, linewidth=0.8)
            mean, std = values.mean(0), values.std(0)
            axes.plot(x, mean, color=color, marker="o", markersize=3, label=f"{label} (n={len(curves)})")
            axes.fill_between(x, mean - std, mean + std, color=color, alpha=0.15)
    for axes, xlabel in zip(panels[0], ("step", "training seconds (step x mean step time)")):
        axes.set(xlabel=xlabel, ylabel="held-out greedy accuracy (%)", title=f"{title}: mean +- std")
        axes.grid(alpha=0.3)
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configurations", nargs="+", help="LABEL=FOLDER, each an llm_seeds.py --out folder")
    parser.add_argument("--out", type=Path, required=True, help="where table.md and accuracy.png go")
    parser.add_argument("--title", default="GRPO, embedded addition task", help="the plot's title")
    parser.add_argument("--wall-clock", action="store_true", help="a second panel against training seconds")
    args = parser.parse_args()
    results = dict(map(load, args.configurations))
    args.out.mkdir(parents=True, exist_ok=True)
    text = table(results)
    commands = "".join(f"    {command}\n" for result in results.values() for command in result["commands"])
    (args.out / "table.md").write_text(text + "\nCommands:\n\n" + commands)
    plot(results, args.out / "accuracy.png", args.title, args.wall_clock)
    print(text)


if __name__ == "__main__":
    main()
