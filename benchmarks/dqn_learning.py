"""Evidence that dqn_atari.py learns: whole-game returns against steps for one run per seed, next to a uniformly
random policy played through the same wrappers (same preprocessing, life loss, FIRE reset, frame budget).

    python benchmarks/dqn_learning.py RUN_DIR [RUN_DIR ...] --random-games 100 --out benchmarks/dqn_learning

writes `breakout_curve.png` (every game's unclipped score and, per seed, the mean of its last 100 games along the
way; the random policy's mean) and `summary.json`, and prints a markdown table: per seed the mean +- std of its last
100 games, then the mean +- std of those per-seed means over the seeds (population std, as benchmarks/dqn_table.py).
A run without `final.json` is marked incomplete and left out of the mean over seeds.
"""

import argparse
import json
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dqn_atari import MAY_CHANGE_ON_RESUME, make_env  # noqa: E402


def random_policy_returns(env_id: str, games: int, seed: int, max_episode_frames: int) -> list[float]:
    """Whole-game scores of uniformly random actions, with the training wrappers (RecordEpisodeStatistics sits below
    the life-loss wrapper, so one record is one whole game)."""
    envs = gym.vector.SyncVectorEnv([make_env(env_id, max_episode_frames)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    rng = np.random.default_rng(seed)
    envs.reset(seed=seed)
    returns: list[float] = []
    while len(returns) < games:
        _, _, _, _, infos = envs.step(rng.integers(envs.single_action_space.n, size=1))
        final = infos.get("final_info", {})
        if "episode" in final:
            returns += [float(r) for r in final["episode"]["r"][final["_episode"]]]
    envs.close()
    return returns[:games]


def trailing_means(values: list[float], window: int) -> list[float]:
    return [float(np.mean(values[max(0, i + 1 - window):i + 1])) for i in range(len(values))]


def read_run(run_dir: Path, last: int) -> dict:
    """One run's games (step, unclipped score) and the mean +- std of its last `last` games."""
    manifest = json.loads((run_dir / "manifest.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    games = [(r["step"], r["charts/episodic_return"]) for r in records if "charts/episodic_return" in r]
    scores = [g for _, g in games]
    return {
        "run": run_dir.name, "seed": manifest["args"]["seed"], "command": manifest["command"],
        "git_commit": manifest.get("git_commit"), "complete": (run_dir / "final.json").is_file(),
        "last_step": max(r["step"] for r in records), "games": len(scores),
        f"last_{last}_mean": float(np.mean(scores[-last:])), f"last_{last}_std": float(np.std(scores[-last:])),
        "devices": manifest.get("devices"), "args": manifest["args"], "curve": games,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", type=Path, nargs="+", help="one run directory per seed, same settings")
    parser.add_argument("--random-games", type=int, default=100)
    parser.add_argument("--random-seed", type=int, default=12345)
    parser.add_argument("--last", type=int, default=100, help="games in the final score")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/dqn_learning"))
    args = parser.parse_args()

    key = f"last_{args.last}_mean"
    runs = sorted((read_run(run_dir, args.last) for run_dir in args.run_dirs), key=lambda run: run["seed"])
    # the seeds must differ in nothing else that changes a run
    settings = {name: value for name, value in runs[0]["args"].items()
                if name != "seed" and name not in MAY_CHANGE_ON_RESUME}
    for run in runs[1:]:
        differing = sorted(name for name, value in settings.items() if run["args"].get(name) != value)
        if differing:
            sys.exit(f"{run['run']} differs from {runs[0]['run']} in more than the seed: {', '.join(differing)}")
    env_id = settings["env_id"]
    random_scores = random_policy_returns(env_id, args.random_games, args.random_seed, settings["max_episode_frames"])
    finished = [run[key] for run in runs if run["complete"]]
    summary = {
        "seeds": [{name: value for name, value in run.items() if name != "args"} for run in runs],
        "complete_seeds": len(finished),
        # the per-seed means of the last games, averaged over the complete seeds (std: their spread)
        "over_seeds": {"mean": float(np.mean(finished)), "std": float(np.std(finished))} if finished else None,
        "random_games": len(random_scores), "random_mean": float(np.mean(random_scores)),
        "random_std": float(np.std(random_scores)),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    for color, run in enumerate(runs):
        steps, scores = [s for s, _ in run["curve"]], [g for _, g in run["curve"]]
        axis.scatter(steps, scores, s=3, alpha=0.15, color=f"C{color}")
        axis.plot(steps, trailing_means(scores, args.last), color=f"C{color}",
                  label=f"seed {run['seed']}: mean of the last {args.last} games"
                        + ("" if run["complete"] else " (incomplete run)"))
    axis.axhline(summary["random_mean"], color="black", linestyle="--",
                 label=f"random policy, {len(random_scores)} games: {summary['random_mean']:.2f}")
    axis.set_xlabel("agent steps")
    axis.set_ylabel("game score (dots: single games)")
    game = env_id.split("/")[-1].split("NoFrameskip")[0]
    axis.set_title(f"dqn_atari.py, {game}, seeds {', '.join(str(run['seed']) for run in runs)}")
    axis.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(args.out / f"{game.lower()}_curve.png", dpi=120)

    print(f"| seed | steps | games | mean +- std of the last {args.last} games |\n|---|---|---|---|")
    for run in runs:
        print(f"| {run['seed']} | {run['last_step']:,}{'' if run['complete'] else ' (incomplete)'} | {run['games']} | "
              f"{run[key]:.2f} +- {run[f'last_{args.last}_std']:.2f} |")
    if finished:
        print(f"| mean +- std over {len(finished)} complete seeds | | | {summary['over_seeds']['mean']:.2f} +- "
              f"{summary['over_seeds']['std']:.2f} |")
    print(f"| uniformly random policy | | {len(random_scores)} | {summary['random_mean']:.2f} +- "
          f"{summary['random_std']:.2f} |")
    for run in runs:
        print(f"\nseed {run['seed']}: {run['command']}")
