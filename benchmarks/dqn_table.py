"""Turn dqn_atari.py runs into the benchmark table (mean +- std over seeds) and learning-curve PNGs, next to the
published numbers. A run's score is the mean return of its last 100 training games (whole games, unclipped), as
CleanRL's table reports; the evaluation score (`eval/episodic_return`, --eval-epsilon 0.05, after --save-model) is
shown too. Runs without a final.json (stopped early) are listed and left out.

    python benchmarks/dqn_table.py runs/ --out benchmarks/dqn_results
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

# Published scores, as CleanRL's DQN documentation lists them (docs.cleanrl.dev, dqn_atari.py): CleanRL's own
# 10M-step runs over 3 seeds, and Nature DQN (Mnih et al. 2015, 50M frames). Not ours.
PUBLISHED = {
    "Breakout": {"CleanRL (10M steps)": (366.9, 39.9), "Nature DQN (50M frames)": (401.2, 26.9)},
    "Pong": {"CleanRL (10M steps)": (20.25, 0.41), "Nature DQN (50M frames)": (18.9, 1.3)},
    "BeamRider": {"CleanRL (10M steps)": (6673, 1434), "Nature DQN (50M frames)": (6846, 1619)},
}
LAST_GAMES = 100


def game_name(env_id: str) -> str:
    """BreakoutNoFrameskip-v4 and ALE/Breakout-v5 are both 'Breakout'."""
    return env_id.split("/")[-1].split("NoFrameskip")[0].split("-v")[0]


def load_runs(roots: list[Path]) -> dict[str, list[dict]]:
    """Every complete run directory (a manifest.json from dqn_atari.py and a final.json) under the roots, by game.
    A resumed run continues in its checkpoint's run directory, so one directory is one whole run; a run that stopped
    early has no final.json and is reported, never scored."""
    runs = defaultdict(list)
    for root in roots:
        for manifest_path in sorted(root.rglob("manifest.json")):
            run_dir = manifest_path.parent
            manifest = json.loads(manifest_path.read_text())
            if "env_id" not in manifest.get("args", {}) or not (run_dir / "metrics.jsonl").is_file():
                continue
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            if manifest["args"].get("resume"):  # resumed from a checkpoint outside it: only the later steps are here
                print(f"skipping {run_dir}: resumed from a checkpoint of another directory; score that run instead")
                continue
            if not (run_dir / "final.json").is_file():
                last = max((r["step"] for r in records), default=0)
                print(f"skipping {run_dir}: incomplete (reached step {last} of {manifest['args']['total_timesteps']})")
                continue
            episodes = [(r["step"], r["charts/episodic_return"]) for r in records if "charts/episodic_return" in r]
            evals = [r["eval/episodic_return"] for r in records if "eval/episodic_return" in r]
            if episodes:
                runs[game_name(manifest["args"]["env_id"])].append(
                    {"dir": run_dir, "seed": manifest["args"]["seed"], "episodes": episodes, "evals": evals,
                     "steps": json.loads((run_dir / "final.json").read_text())["global_step"]})
    return runs


def mean_std(values: list[float]) -> str:
    return f"{np.mean(values):.2f} +- {np.std(values):.2f}" if values else "-"


def table(runs: dict[str, list[dict]]) -> str:
    lines = ["| game | runs | steps | ours: last 100 games | ours: eval (eps 0.05) | "
             + " | ".join(next(iter(PUBLISHED.values()))) + " |", "|" + "---|" * 7]
    for game in sorted(set(runs) | set(PUBLISHED)):
        group = runs.get(game, [])
        finals = [float(np.mean([r for _, r in run["episodes"][-LAST_GAMES:]])) for run in group]
        evals = [float(np.mean(run["evals"])) for run in group if run["evals"]]
        steps = sorted({run["steps"] for run in group})
        ours = mean_std(finals) if group else "not yet run by us"
        published = [f"{m:g} +- {s:g}" for m, s in PUBLISHED.get(game, {}).values()] or ["-", "-"]
        lines.append(f"| {game} | {len(group)} | {','.join(map(str, steps)) or '-'} | {ours} | {mean_std(evals)} | "
                     + " | ".join(published) + " |")
    return "\n".join(lines)


def plot(game: str, group: list[dict], out: Path) -> Path:
    """Each seed's return (running mean over 100 games), the mean over seeds, and the published scores."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    grid = np.linspace(0, max(run["episodes"][-1][0] for run in group), 200)
    curves = []
    for run in group:
        steps, returns = np.array(run["episodes"]).T
        smooth = np.convolve(returns, np.ones(LAST_GAMES), "full")[: len(returns)] / np.minimum(
            np.arange(1, len(returns) + 1), LAST_GAMES)
        ax.plot(steps, smooth, alpha=0.35, linewidth=1, label=f"seed {run['seed']}")
        curves.append(np.interp(grid, steps, smooth))
    ax.plot(grid, np.mean(curves, axis=0), color="black", linewidth=2, label=f"mean of {len(group)} runs")
    for (label, (score, _)), style in zip(PUBLISHED.get(game, {}).items(), ("--", ":")):
        ax.axhline(score, color="tab:red", linestyle=style, label=label)
    ax.set(title=f"DQN, {game}", xlabel="environment steps", ylabel=f"episodic return (running mean of {LAST_GAMES})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / f"dqn_{game}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("roots", nargs="+", type=Path, help="directories holding dqn_atari.py run directories")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/dqn_results"), help="where PNGs and table.md go")
    cli = parser.parse_args()
    runs = load_runs(cli.roots)
    cli.out.mkdir(parents=True, exist_ok=True)
    text = table(runs)
    (cli.out / "table.md").write_text(text + "\n")
    print(text)
    for game, group in sorted(runs.items()):
        print(f"wrote {plot(game, group, cli.out)}")
