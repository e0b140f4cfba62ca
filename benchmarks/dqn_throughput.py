"""dqn_atari.py throughput, phase by phase, and the replay buffer's memory at 1M transitions. Measured numbers, not a
test: the machine's load changes them, so compare scripts side by side in one sitting (--scripts, interleaved runs)
and read the ratio, never a number from another day.

    python benchmarks/dqn_throughput.py --scripts ../dqn_old/dqn_atari.py dqn_atari.py --repeats 3
    python benchmarks/dqn_throughput.py --scripts ../dqn_old/dqn_atari.py dqn_atari.py --alternate
    python benchmarks/dqn_throughput.py --scripts ../dqn_old/dqn_atari.py dqn_atari.py --alternate --capacity 1000000
    python benchmarks/dqn_throughput.py --memory-only

Phases (--scripts): each script runs Breakout with CleanRL's defaults except the budget (--total-timesteps 5000,
--learning-starts 3000, --buffer-size 20000, epsilon decaying 1 -> 0.01 over the first 1250 steps) at the machine's
default thread count unless --threads is given. Steps/s come from the charts/SPS records (cumulative, every 100
steps) turned back into elapsed times, over two steady windows of the same run, both at epsilon 0.01 (the network
acts on 99% of steps, as in 90% of a real run): collection from step 1500 to 3000 (acting only) and learning from
step 3500 to 5000 (acting plus one batch-32 update every 4 steps: 375 updates). Start-up and the first 500 learning
steps are outside both windows. Short runs, many interleaved repeats: the load of a shared machine drifts by minutes.

--alternate: both scripts' learning step in one process, alternating every 25 updates for 10 rounds, so a drifting
load hits both alike (the robust measure on a shared machine). A learning step: 4 x (epsilon-0.01 action, Breakout env
step, buffer add), one batch-32 sample, one update; e0b05ef's update sits inline in its loop, so its lines are
repeated in `alternating` below. --capacity 1000000 runs it with a full 1M buffer (7 GB filled, every slot valid).
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PHASE_ARGS = ["--total-timesteps", "5000", "--learning-starts", "3000", "--buffer-size", "20000",
              "--exploration-fraction", "0.25"]
COLLECT_WINDOW, LEARN_WINDOW = (1500, 3000), (3500, 5000)


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def buffer_memory(transitions: int = 1_000_000) -> dict[str, float]:
    """Allocate the buffer, touch every byte (fill all frames), and measure resident memory."""
    sys.path.insert(0, str(ROOT))
    from dqn_atari import ReplayBuffer

    before = rss_bytes()
    buffer = ReplayBuffer(transitions, 1)
    for array in buffer.state_dict().values():
        array.fill(1)
    arrays = sum(array.nbytes for array in buffer.state_dict().values())
    return {"transitions": transitions, "bytes": arrays, "GiB": arrays / 2**30,
            "rss_GiB": (rss_bytes() - before) / 2**30,
            "naive_obs_and_next_obs_GiB": transitions * 2 * 4 * 84 * 84 / 2**30}


def window_sps(records: list[dict], window: tuple[int, int]) -> float:
    """Steps/s between two logged steps, from cumulative SPS: elapsed(step) = step / SPS(step)."""
    sps = {r["step"]: r["charts/SPS"] for r in records if "charts/SPS" in r}
    (a, b) = window
    return (b - a) / (b / sps[b] - a / sps[a])


def measure_phases(script: Path, threads: int | None) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as run_root:
        env = dict(os.environ)
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        command = [sys.executable, script.name, *PHASE_ARGS, "--run-root", run_root]
        subprocess.run(command, cwd=script.parent, env=env, check=True, capture_output=True, text=True)
        run_dir = next(Path(run_root).glob("*/metrics.jsonl")).parent  # SPS: in perf.jsonl now, metrics.jsonl before
        records = [json.loads(line) for name in ("metrics.jsonl", "perf.jsonl") if (run_dir / name).is_file()
                   for line in (run_dir / name).read_text().splitlines()]
    epsilons = {r["charts/epsilon"] for r in records if "charts/epsilon" in r and r["step"] >= COLLECT_WINDOW[0]}
    assert epsilons == {0.01}, epsilons  # both windows at the same epsilon
    return {"collect_sps": window_sps(records, COLLECT_WINDOW), "learn_sps": window_sps(records, LEARN_WINDOW)}


def load_module(name: str, script: Path):
    """Import a dqn_atari.py by path, with the common/ beside it (an older commit's worktree has its own): the
    cached common modules are dropped first, and the loaded script keeps the ones it imported."""
    for cached in [module for module in sys.modules if module == "common" or module.startswith("common.")]:
        del sys.modules[cached]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        spec = importlib.util.spec_from_file_location(name, script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    return module


def alternating(old_script: Path, new_script: Path, capacity: int, rounds: int, updates: int) -> list[dict]:
    """Both scripts' learning step in one process, alternating every `updates` updates for `rounds` rounds, so a
    drifting machine load hits both alike. A learning step is what each loop does between two updates: 4 times
    (epsilon-0.01 action, env step, buffer add), then one batch-32 sample and one update. Each script has its own
    Breakout env, network and optimizer; both use one replay buffer of `capacity` frames, filled up front (every
    slot a valid transition, all pages resident), since both scripts' buffers are the same code."""
    sys.path.insert(0, str(ROOT))
    import gymnasium as gym
    import torch
    import torch.distributed as dist

    old, new = load_module("dqn_old", old_script), load_module("dqn_new", new_script)
    new.seed_everything(1, True)
    new.init_distributed()
    buffer = new.ReplayBuffer(capacity, 1)
    rng = np.random.default_rng(0)
    buffer.frames[...] = rng.integers(0, 256, size=(84, 84), dtype=np.uint8)  # touches every page
    buffer.position[...], buffer.valid[...], buffer.size[...] = 3, True, capacity
    device = torch.device("cpu")

    def make(module, env_factory):
        envs = gym.vector.SyncVectorEnv([env_factory("BreakoutNoFrameskip-v4", 108_000)],
                                        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
        obs = envs.reset(seed=[1])[0]
        return envs, obs, module.QNetwork(4), module.QNetwork(4)

    def old_variant():  # e0b05ef's loop body: no_grad acting, default Adam, all-reduce and copy-back at any world size
        envs, obs, q_network, target_network = make(old, old.make_env)
        optimizer = torch.optim.Adam(q_network.parameters(), lr=1e-4)
        params = list(q_network.parameters())
        state = {"obs": obs}

        def learning_step():
            for _ in range(4):
                explore = rng.random(1) < 0.01
                actions = rng.integers(4, size=1)
                if not explore.all():
                    with torch.no_grad():
                        greedy = q_network(torch.from_numpy(state["obs"]).to(device)).argmax(dim=1).cpu().numpy()
                    actions = np.where(explore, actions, greedy)
                next_obs, rewards, terminated, truncated, infos = envs.step(actions)
                buffer.add(actions, rewards, terminated, truncated, next_obs, infos.get("final_obs"))
                state["obs"] = next_obs
            batch = old.to_device(buffer.sample(32, rng), device)
            loss, q_mean = old.td_loss(q_network, target_network, batch, 0.99)
            optimizer.zero_grad()
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach()[None], q_mean.detach()[None]])
            dist.all_reduce(flat)
            flat /= 1
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset: offset + p.numel()].view_as(p))
                offset += p.numel()
            optimizer.step()
        return learning_step

    def new_variant():  # this commit's loop body, through its own functions
        envs, obs, q_network, target_network = make(new, new.make_env)
        optimizer = torch.optim.Adam(q_network.parameters(), lr=1e-4, fused=True)
        state = {"obs": obs}

        def learning_step():
            for _ in range(4):
                actions = new.act(q_network, state["obs"], 0.01, rng, device)
                next_obs, rewards, terminated, truncated, infos = envs.step(actions)
                buffer.add(actions, rewards, terminated, truncated, next_obs, infos.get("final_obs"))
                state["obs"] = next_obs
            batch = [torch.from_numpy(a).to(device, non_blocking=True) for a in buffer.sample(32, rng)]
            new.update(q_network, target_network, optimizer, batch, 0.99, 1)
        return learning_step

    variants = {"e0b05ef": old_variant(), "this": new_variant()}
    for step in variants.values():  # warm-up
        for _ in range(5):
            step()
    results = []
    for round_ in range(rounds):
        row = {}
        for name, step in variants.items():
            start = time.perf_counter()
            for _ in range(updates):
                step()
            row[name] = 4 * updates / (time.perf_counter() - start)
        results.append(row)
        print(f"  round {round_ + 1}: " + ", ".join(f"{k} {v:.1f} steps/s" for k, v in row.items())
              + f", ratio {row['this'] / row['e0b05ef']:.3f}", flush=True)
    dist.destroy_process_group()
    return results


def interleaved(scripts: list[Path], repeats: int, run_one) -> list[dict[str, list[float]]]:
    """Run old, new, old, new, ... and collect each script's results."""
    results = [{} for _ in scripts]
    for repeat in range(repeats):
        for i, script in enumerate(scripts):
            for key, value in run_one(script).items():
                results[i].setdefault(key, []).append(value)
            print(f"  repeat {repeat + 1}, {script}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in results[i].items()),
                  flush=True)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scripts", type=Path, nargs="+", default=[ROOT / "dqn_atari.py"],
                        help="dqn_atari.py files to compare (e.g. a worktree of an older commit, then this one)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per script")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the runs (default: torch's)")
    parser.add_argument("--alternate", action="store_true",
                        help="in one process, alternate the two --scripts' learning steps (first = old, last = new)")
    parser.add_argument("--capacity", type=int, default=20_000, help="replay frames for --alternate (1000000: full)")
    parser.add_argument("--rounds", type=int, default=10, help="--alternate rounds")
    parser.add_argument("--updates", type=int, default=25, help="updates per script per --alternate round")
    parser.add_argument("--memory-only", action="store_true")
    cli = parser.parse_args()
    print(f"load average {os.getloadavg()}, {os.cpu_count()} CPUs, threads {cli.threads or 'default'}")
    scripts = [s.resolve() for s in cli.scripts]
    if cli.memory_only:
        memory = buffer_memory()
        print(f"replay buffer, 1M transitions: {memory['GiB']:.2f} GiB of arrays ({memory['bytes'] / 1e9:.2f} GB), "
              f"{memory['rss_GiB']:.2f} GiB resident once filled; storing obs + next_obs stacks would take "
              f"{memory['naive_obs_and_next_obs_GiB']:.1f} GiB")
    elif cli.alternate:
        rows = alternating(scripts[0], scripts[-1], cli.capacity, cli.rounds, cli.updates)
        ratios = [row["this"] / row["e0b05ef"] for row in rows]
        print(f"capacity {cli.capacity}: learning steps/s, median over {cli.rounds} rounds: e0b05ef "
              f"{np.median([r['e0b05ef'] for r in rows]):.1f}, this {np.median([r['this'] for r in rows]):.1f}; "
              f"ratio per round median {np.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
    else:
        results = interleaved(scripts, cli.repeats, lambda script: measure_phases(script, cli.threads))
        keys = list(results[0])
        print("| script | " + " | ".join(f"{k} (median of {cli.repeats})" for k in keys) + " |")
        print("|---|" + "---|" * len(keys))
        for script, result in zip(scripts, results):
            print(f"| {script} | " + " | ".join(f"{np.median(result[k]):.1f}" for k in keys) + " |")
        for key in keys:
            ratios = [new / old for old, new in zip(results[0][key], results[-1][key])]
            print(f"{key}: last / first script, per interleaved pair: " + ", ".join(f"{r:.2f}" for r in ratios)
                  + f"; median {np.median(ratios):.2f}")
