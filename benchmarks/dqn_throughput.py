"""dqn_atari.py throughput (environment steps per second) for several --num-envs, and the replay buffer's memory at
1M transitions. Measured numbers, not a test: the machine's load changes them, so the load average is printed too.

    python benchmarks/dqn_throughput.py --num-envs 1 4 8 --steps 4000 --learning-starts 2000
    python benchmarks/dqn_throughput.py --memory-only

For each --num-envs: one run of dqn_atari.py with CleanRL's defaults except the budget. SPS is split into the
collection phase (epsilon-greedy acting, no updates) and the learning phase (one batch-32 update every 4 steps),
from the cumulative charts/SPS records before and after learning starts.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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


def phase_sps(records: list[dict], learning_starts: int) -> tuple[float, float]:
    """Steps/s before learning starts and after, from two cumulative charts/SPS readings."""
    sps = [(r["step"], r["charts/SPS"]) for r in records if "charts/SPS" in r]
    before = max((s for s in sps if s[0] <= learning_starts), default=sps[0])
    after = sps[-1]
    time_before, time_after = before[0] / before[1], after[0] / after[1]
    return before[1], (after[0] - before[0]) / (time_after - time_before)


def measure(num_envs: int, steps: int, learning_starts: int, threads: int | None) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as run_root:
        env = dict(os.environ)
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        command = [sys.executable, "dqn_atari.py", "--num-envs", str(num_envs), "--total-timesteps", str(steps),
                   "--learning-starts", str(learning_starts), "--buffer-size", "100000", "--run-root", run_root]
        subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
        metrics = next(Path(run_root).glob("*/metrics.jsonl"))
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    collect, learn = phase_sps(records, learning_starts)
    return {"num_envs": num_envs, "threads": threads or "default", "collect_sps": collect, "learn_sps": learn}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-envs", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--steps", type=int, default=4000, help="total steps of each run")
    parser.add_argument("--learning-starts", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the runs (default: torch's)")
    parser.add_argument("--memory-only", action="store_true")
    cli = parser.parse_args()
    print(f"load average {os.getloadavg()}, {os.cpu_count()} CPUs")
    if not cli.memory_only:
        print("| num_envs | threads | collection SPS | learning SPS |\n|---|---|---|---|")
        for n in cli.num_envs:
            result = measure(n, cli.steps, cli.learning_starts, cli.threads)
            row = f"| {n} | {result['threads']} | {result['collect_sps']:.0f} | {result['learn_sps']:.0f} |"
            print(row, flush=True)
    memory = buffer_memory()
    print(f"replay buffer, 1M transitions: {memory['GiB']:.2f} GiB of arrays ({memory['bytes'] / 1e9:.2f} GB), "
          f"{memory['rss_GiB']:.2f} GiB resident once filled; storing obs + next_obs stacks would take "
          f"{memory['naive_obs_and_next_obs_GiB']:.1f} GiB")
