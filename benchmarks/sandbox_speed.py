"""The python tool's speed on this machine, in one sitting: sandboxed calls one after another and on a pool of
threads (calls/s, p50 and p99 latency), and the tool's share of a GRPO step on `calculator_tiny:python` (whose calls
run in the sandbox) against `calculator_tiny` (the same calls answered in process), each with --env-workers 1 and 2.

    python benchmarks/sandbox_speed.py --calls 256 --steps 10 --out benchmarks/results/sandbox_speed
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tasks.sandbox import Sandbox  # noqa: E402 (the repository on the path first)


def calls(count: int, workers: int) -> dict[str, float]:
    """`count` calls of a small program (a product, printed) on `workers` threads."""
    sandbox = Sandbox()
    sandbox.run("pass")  # the first call starts its monitor in the open: not counted

    def one(index: int) -> float:
        started = time.monotonic()
        result = sandbox.run(f"print({10 + index % 90}*{99 - index % 89})")
        assert result.status == "ok", result.text
        return time.monotonic() - started

    started = time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        latencies = sorted(pool.map(one, range(count)))
    wall = time.monotonic() - started
    sandbox.close()
    return {"calls_per_s": count / wall, "p50_ms": 1000 * latencies[len(latencies) // 2],
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]}


def step_seconds(task: str, workers: int, steps: int) -> float:
    """Median step time of a 2-rank GRPO run on the tiny calculator (step 1 left out)."""
    with tempfile.TemporaryDirectory() as run_root:
        command = [str(ROOT / ".venv" / "bin" / "torchrun"), "--standalone", "--nproc_per_node", "2", "grpo_llm.py",
                   "--task", task, "--model-name-or-path", "assets/tiny-calculator", "--max-completion-length", "20",
                   "--total-steps", str(steps), "--eval-every", "0", "--num-eval-prompts", "16", "--save-every", "0",
                   "--env-workers", str(workers), "--run-root", run_root]
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
        perf = next(Path(run_root).iterdir()) / "perf.jsonl"
        return statistics.median(json.loads(line)["perf/step_s"] for line in perf.read_text().splitlines()[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    options = parser.parse_args()
    results = {"calls": {f"{workers} thread(s)": calls(options.calls, workers) for workers in (1, 2, 4)},
               "step_s": {f"{task}, --env-workers {workers}": step_seconds(task, workers, options.steps)
                          for workers in (1, 2) for task in ("calculator_tiny", "calculator_tiny:python")}}
    lines = [f"| {options.calls} calls | calls/s | p50 (ms) | p99 (ms) |", "|---|---|---|---|"]
    lines += [f"| {name} | {r['calls_per_s']:.1f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} |"
              for name, r in results["calls"].items()]
    lines += ["", "| GRPO run (2 ranks) | median step (s) | sandbox share of the step |", "|---|---|---|"]
    for workers in (1, 2):
        calculator = results["step_s"][f"calculator_tiny, --env-workers {workers}"]
        sandboxed = results["step_s"][f"calculator_tiny:python, --env-workers {workers}"]
        lines.append(f"| calculator_tiny, --env-workers {workers} | {calculator:.3f} | (in process) |")
        lines.append(f"| calculator_tiny:python, --env-workers {workers} | {sandboxed:.3f} | "
                     f"{(sandboxed - calculator) / sandboxed:.1%} |")
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "table.md").write_text("\n".join(lines) + "\n")
    (options.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
