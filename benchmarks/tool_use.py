"""Tool use learned or not: held-out greedy accuracy and tool-call rate (`eval/accuracy`, `eval/tool_call_rate`),
before and after training, for configurations run by `benchmarks/llm_seeds.py` (one folder each, seed_S/ inside),
as mean +- std over the seeds (population std, as llm_seeds.py), and one PNG: each metric against step, every seed.
`--metric name=title` (repeated) compares other metrics, e.g. where some configurations log no tool calls.

    python benchmarks/tool_use.py --out benchmarks/results/calculator_tiny_seeds \\
        "with the calculator"=runs/tool "calculator off"=runs/off
    python benchmarks/tool_use.py --out benchmarks/results/env_adapters --png accuracy.png \\
        --metric "eval/accuracy=held-out accuracy" --metric "train/accuracy=sampled accuracy (training)" \\
        "TRL class"=runs/trl Gymnasium=runs/gym OpenEnv=runs/openenv
"""

import argparse
import json
from pathlib import Path

import numpy as np

METRICS = {"eval/accuracy": "held-out accuracy", "eval/tool_call_rate": "held-out tool-call rate"}


def curves(folder: Path, metrics: dict[str, str]) -> dict[int, dict[str, list[tuple[int, float]]]]:
    """Per seed, each metric's (step, value) pairs from the run's metrics.jsonl."""
    out = {}
    for seed_dir in sorted(folder.glob("seed_*")):
        run_dir = next(path for path in seed_dir.iterdir() if path.is_dir())
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        out[int(seed_dir.name.split("_")[1])] = {name: [(m["step"], m[name]) for m in lines if name in m]
                                                 for name in metrics}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="+", help="label=folder of llm_seeds.py's seed_S/ run roots")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--metric", action="append", help="name=title, a metric to compare (default: "
                        f"{', '.join(f'{name}={title}' for name, title in METRICS.items())})")
    parser.add_argument("--png", default="tool_use.png", help="the figure's file name in --out")
    options = parser.parse_args()
    metrics = dict(m.split("=", 1) for m in options.metric) if options.metric else METRICS
    results = {label: curves(Path(folder), metrics) for label, _, folder in (c.rpartition("=") for c in
                                                                               options.configs)}
    lines = ["| configuration | seeds | " + " | ".join(f"{title} before | after" for title in metrics.values()) + " |",
             "|---|---|" + "---|---|" * len(metrics)]
    summary = {}
    for label, seeds in results.items():
        cells = []
        for name in metrics:
            before = np.array([runs[name][0][1] for runs in seeds.values()])
            after = np.array([runs[name][-1][1] for runs in seeds.values()])
            summary[f"{label}/{name}"] = {"before": before.tolist(), "after": after.tolist()}
            cells += [f"{values.mean():.1%} +- {values.std() * 100:.1f}" for values in (before, after)]
        lines.append(f"| {label} | {', '.join(map(str, seeds))} | " + " | ".join(cells) + " |")
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "table.md").write_text("\n".join(lines) + "\n")
    (options.out / "results.json").write_text(json.dumps({"configs": options.configs, "summary": summary,
                                                          "curves": results}, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4), squeeze=False)
    for (name, title), axis in zip(metrics.items(), axes[0]):
        for color, (label, seeds) in zip(("tab:blue", "tab:red", "tab:green"), results.items()):
            for k, runs in enumerate(seeds.values()):
                steps, values = zip(*runs[name])
                axis.plot(steps, values, color=color, alpha=0.7, label=label if k == 0 else None)
        axis.set(title=title, xlabel="step", ylim=(-0.02, 1.02))
        axis.legend()
    figure.tight_layout()
    figure.savefig(options.out / options.png, dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
