"""dqn_atari.py throughput, phase by phase, and the replay buffer's memory at 1M transitions. Measured numbers, not a
test: the machine's load changes them, so compare scripts side by side in one sitting (--scripts, interleaved runs)
and read the ratio, never a number from another day.

    python benchmarks/dqn_throughput.py --scripts ../dqn_old/dqn_atari.py dqn_atari.py --repeats 3
    python benchmarks/dqn_throughput.py --scripts ../dqn_old/dqn_atari.py dqn_atari.py --full-buffer --repeats 2
    python benchmarks/dqn_throughput.py --memory-only

Phases (--scripts): each script runs Breakout with CleanRL's defaults except the budget (--total-timesteps 20000,
--learning-starts 10000, --buffer-size 20000, epsilon decaying 1 -> 0.01 over the first 2000 steps) at the machine's
default thread count unless --threads is given. Steps/s come from the charts/SPS records (cumulative, every 100
steps) turned back into elapsed times, over two steady windows of the same run, both at epsilon 0.01 (the network
acts on 99% of steps, as in 90% of a real run): collection from step 2000 to 10000 (acting only) and learning from
step 11000 to 20000 (acting plus one batch-32 update every 4 steps). Start-up and the first 1000 learning steps are
outside both windows.

--full-buffer: the learning step with a full 1M-frame buffer (7 GB filled, every slot a valid transition), without
environments: per update, 4 epsilon-0.01 actions on observations drawn from the buffer, one batch-32 sample and one
update, as each script's loop does them (e0b05ef's update sits inline in its loop; the 8 lines are repeated below).
Each script runs in its own process.
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
PHASE_ARGS = ["--total-timesteps", "20000", "--learning-starts", "10000", "--buffer-size", "20000",
              "--exploration-fraction", "0.1"]
COLLECT_WINDOW, LEARN_WINDOW = (2000, 10000), (11000, 20000)


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


def full_buffer_worker(script: Path, updates: int) -> dict[str, float]:
    """Learning steps/s (4 actions + 1 update) with a full 1M buffer, using the script's buffer, network, update."""
    sys.path.insert(0, str(script.parent))
    spec = importlib.util.spec_from_file_location("dqn_under_test", script)
    dqn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dqn)
    import torch
    import torch.distributed as dist

    dqn.seed_everything(1, True)
    dqn.init_distributed()
    buffer = dqn.ReplayBuffer(1_000_000, 1)
    rng = np.random.default_rng(0)
    buffer.frames[...] = rng.integers(0, 256, size=(84, 84), dtype=np.uint8)  # touches all 7 GB
    buffer.position[...], buffer.valid[...], buffer.size[...] = 3, True, 1_000_000
    buffer.actions[...] = rng.integers(4, size=buffer.actions.shape)
    q_network, target_network = dqn.QNetwork(4), dqn.QNetwork(4)
    device = torch.device("cpu")
    if hasattr(dqn, "update"):  # this commit: fused Adam, update() skips the all-reduce for one rank
        optimizer = torch.optim.Adam(q_network.parameters(), lr=1e-4, fused=True)

        def learn(arrays):
            batch = [torch.from_numpy(a).to(device, non_blocking=True) for a in arrays]
            dqn.update(q_network, target_network, optimizer, batch, 0.99, 1)

        def act(obs):
            return dqn.act(q_network, obs, 0.01, rng, device)
    else:  # e0b05ef: its loop's update and acting, repeated
        optimizer = torch.optim.Adam(q_network.parameters(), lr=1e-4)
        params = list(q_network.parameters())

        def learn(arrays):
            loss, q_mean = dqn.td_loss(q_network, target_network, dqn.to_device(arrays, device), 0.99)
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

        def act(obs):
            explore = rng.random(1) < 0.01
            actions = rng.integers(4, size=1)
            if not explore.all():
                with torch.no_grad():
                    greedy = q_network(torch.from_numpy(obs).to(device)).argmax(dim=1).cpu().numpy()
                actions = np.where(explore, actions, greedy)
            return actions

    def one_update():
        for _ in range(4):
            act(buffer.sample(1, rng)[0])
        learn(buffer.sample(32, rng))

    for _ in range(10):  # warm-up
        one_update()
    start = time.perf_counter()
    for _ in range(updates):
        one_update()
    elapsed = time.perf_counter() - start
    dist.destroy_process_group()
    return {"learn_sps": 4 * updates / elapsed}


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
    parser.add_argument("--full-buffer", action="store_true", help="learning step with a full 1M buffer")
    parser.add_argument("--updates", type=int, default=300, help="timed updates per --full-buffer run")
    parser.add_argument("--memory-only", action="store_true")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.worker:
        print(json.dumps(full_buffer_worker(cli.worker.resolve(), cli.updates)))
        sys.exit(0)
    print(f"load average {os.getloadavg()}, {os.cpu_count()} CPUs, threads {cli.threads or 'default'}")
    scripts = [s.resolve() for s in cli.scripts]
    if cli.full_buffer:
        def run_one(script: Path) -> dict[str, float]:
            env = {**os.environ, **({"OMP_NUM_THREADS": str(cli.threads)} if cli.threads else {})}
            out = subprocess.run([sys.executable, __file__, "--worker", str(script), "--updates", str(cli.updates)],
                                 env=env, check=True, capture_output=True, text=True).stdout
            return json.loads(out.strip().splitlines()[-1])
    else:
        def run_one(script: Path) -> dict[str, float]:
            return measure_phases(script, cli.threads)
    if not cli.memory_only:
        results = interleaved(scripts, cli.repeats, run_one)
        keys = list(results[0])
        print("| script | " + " | ".join(f"{k} (median of {cli.repeats})" for k in keys) + " |")
        print("|---|" + "---|" * len(keys))
        for script, result in zip(scripts, results):
            print(f"| {script} | " + " | ".join(f"{np.median(result[k]):.1f}" for k in keys) + " |")
        for key in keys:
            ratios = [new / old for old, new in zip(results[0][key], results[-1][key])]
            print(f"{key}: last / first script, per interleaved pair: " + ", ".join(f"{r:.2f}" for r in ratios)
                  + f"; median {np.median(ratios):.2f}")
    else:
        memory = buffer_memory()
        print(f"replay buffer, 1M transitions: {memory['GiB']:.2f} GiB of arrays ({memory['bytes'] / 1e9:.2f} GB), "
              f"{memory['rss_GiB']:.2f} GiB resident once filled; storing obs + next_obs stacks would take "
              f"{memory['naive_obs_and_next_obs_GiB']:.1f} GiB")
