"""Evidence that dqn_atari.py learns: one run's whole-game returns against steps, next to a uniformly random policy
played through the same wrappers (same preprocessing, life loss, FIRE reset, frame budget).

    python benchmarks/dqn_learning.py RUN_DIR --random-games 100 --out benchmarks/dqn_learning

writes `breakout_curve.png` (every game's unclipped score, the mean of the last 100 games along the way, and the
random policy's mean) and `summary.json`, and prints a markdown table.
"""

import argparse
import json
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.atari import make_env  # noqa: E402


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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--random-games", type=int, default=100)
    parser.add_argument("--random-seed", type=int, default=12345)
    parser.add_argument("--last", type=int, default=100, help="games in the final score")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/dqn_learning"))
    args = parser.parse_args()

    manifest = json.loads((args.run_dir / "manifest.json").read_text())
    run_args = manifest["args"]
    records = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines()]
    games = [(r["step"], r["charts/episodic_return"]) for r in records if "charts/episodic_return" in r]
    steps, scores = [s for s, _ in games], [g for _, g in games]
    last_step = max(r["step"] for r in records)
    complete = (args.run_dir / "final.json").is_file()
    random_scores = random_policy_returns(run_args["env_id"], args.random_games, args.random_seed,
                                          run_args["max_episode_frames"])
    summary = {
        "run": args.run_dir.name, "command": manifest["command"], "git_commit": manifest.get("git_commit"),
        "complete": complete, "last_step": last_step, "games": len(scores),
        f"last_{args.last}_mean": float(np.mean(scores[-args.last:])),
        f"last_{args.last}_std": float(np.std(scores[-args.last:])),
        "random_games": len(random_scores), "random_mean": float(np.mean(random_scores)),
        "random_std": float(np.std(random_scores)), "devices": manifest.get("devices"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    axis.scatter(steps, scores, s=4, alpha=0.3, label="one game (unclipped score)")
    axis.plot(steps, trailing_means(scores, args.last), color="C1", label=f"mean of the last {args.last} games")
    axis.axhline(summary["random_mean"], color="C3", linestyle="--",
                 label=f"random policy, {len(random_scores)} games: {summary['random_mean']:.2f}")
    axis.set_xlabel("agent steps")
    axis.set_ylabel("game score")
    game = run_args["env_id"].split("/")[-1].split("NoFrameskip")[0]
    axis.set_title(f"dqn_atari.py, {game}, seed {run_args['seed']}" + ("" if complete else " (incomplete run)"))
    axis.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(args.out / f"{game.lower()}_curve.png", dpi=120)

    print("| measure | value |\n|---|---|")
    print(f"| steps | {last_step:,}{'' if complete else ' (incomplete)'} |")
    print(f"| games played | {len(scores)} |")
    print(f"| mean +- std of the last {args.last} games | {summary[f'last_{args.last}_mean']:.2f} +- "
          f"{summary[f'last_{args.last}_std']:.2f} |")
    print(f"| uniformly random policy, {len(random_scores)} games | {summary['random_mean']:.2f} +- "
          f"{summary['random_std']:.2f} |")
    print(f"\ncommand: {manifest['command']}")
