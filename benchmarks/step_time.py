"""Summarise a GRPO run's timings from its metrics.jsonl: mean of each perf/ metric over the steps after the first
(the first pays one-off warm-up costs), and the held-out accuracy before and after.

    python benchmarks/step_time.py runs/grpo_llm__1__<timestamp>
"""

import json
import sys
from pathlib import Path

if __name__ == "__main__":
    run_dir = Path(sys.argv[1])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 1 and "perf/step_s" in r]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    print(f"{run_dir.name}: world size {manifest['world_size']}, {len(steps)} steps averaged")
    print(f"  command: {manifest['command']}")
    for key in sorted(k for k in steps[0] if k.startswith("perf/")):
        print(f"  {key:28s} {sum(r[key] for r in steps) / len(steps):12.3f}")
    evals = [r for r in records if "eval/accuracy" in r]
    print(f"  held-out accuracy: {evals[0]['eval/accuracy']:.3f} (step {evals[0]['step']}) -> "
          f"{evals[-1]['eval/accuracy']:.3f} (step {evals[-1]['step']})")
