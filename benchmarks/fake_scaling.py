"""The simulator against real runs: GRPO with the fake engine (`--rollout-engine fake`: generation is a sleep of tau0
per token of the rank's longest completion, so 16 ranks with real trainers fit on 2 cores) at 2, 4, 8 and 16 ranks,
each launched as two torchrun agents (c10d rendezvous on 127.0.0.1, as two nodes would be) with a fixed workload
per rank (weak scaling). The CPU constants are calibrated on the smallest run alone and written to
benchmarks/scaling_constants/cpu_2core.json; benchmarks/weak_scaling_sim.py then predicts every run's mean step
time from that run's own timings.jsonl (lengths and token counts, never its measured seconds).

    python benchmarks/fake_scaling.py --out benchmarks/results/weak_scaling
"""

import argparse
import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SIM_PATH = ROOT / "benchmarks" / "weak_scaling_sim.py"


def load_simulator() -> object:
    spec = importlib.util.spec_from_file_location("weak_scaling_sim", SIM_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch(ranks: int, args: argparse.Namespace, run_root: Path) -> Path:
    """One run of `ranks` ranks as two agents of ranks / 2 processes; returns its run directory."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    per_rank = ["--rollout-engine", "fake", "--fake-tau0-s", str(args.tau0), "--fake-median-length",
                str(args.median), "--fake-length-sigma", str(args.sigma), "--max-completion-length", str(args.cap),
                "--prompts-per-step", str(args.prompts_per_rank * ranks), "--num-generations", str(args.generations),
                "--micro-batch-size", str(args.micro_batch_size), "--no-share-prompts", "--total-steps",
                str(args.steps), "--eval-every", "0", "--num-eval-prompts", str(ranks), "--run-root", str(run_root)]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", str(ranks // 2),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"fake{port}",
               str(ROOT / "grpo_llm.py"), *per_rank]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    agents = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True) for _ in range(2)]
    for agent in agents:
        _, stderr = agent.communicate(timeout=1800)
        if agent.returncode:
            sys.exit(f"the {ranks}-rank run failed:\n{stderr[-3000:]}")
    (run_dir,) = [p for p in run_root.iterdir() if p.is_dir()]
    return run_dir


def calibrate(records: list[dict], tau0: float) -> dict[str, dict[str, object]]:
    """The CPU constants from one run's timings (steps after the first): the trainer's seconds per padded token and
    per micro-batch by least squares over every rank and step, the rest as means."""
    ranks = [rank for record in records for rank in record["ranks"]]
    design = np.array([[rank["padded_tokens"], rank["micro_batches"]] for rank in ranks])
    per_token, per_micro_batch = np.linalg.lstsq(design, np.array([rank["train_s"] for rank in ranks]),
                                                 rcond=None)[0]
    source = f"calibrated by benchmarks/fake_scaling.py on its {len(records[0]['ranks'])}-rank run"
    return {
        "decode_step_s": {"value": tau0, "source": "the fake engine's --fake-tau0-s"},
        "train_s_per_padded_token": {"value": float(per_token), "source": source},
        "train_s_per_micro_batch": {"value": float(per_micro_batch), "source": source},
        "sync_s": {"value": statistics.mean(r["sync_gather_s"] + r["sync_reload_s"] for r in ranks),
                   "source": source},
        # not wait_s: waiting for the slowest generator is the max over ranks the generation phase predicts
        "step_overhead_s": {"value": statistics.mean(r["score_s"] + r["reduce_s"] for r in ranks), "source": source},
        "cores": {"value": os.cpu_count(), "source": "os.cpu_count() of the machine that ran it"},
    }


def run_all(args: argparse.Namespace, sim: object) -> dict[int, list[dict]]:
    """Every run, one after the other; their timings.jsonl copied to --out/cpu_timings/ (the simulator reads them
    again with --from-timings, or one by one: weak_scaling_sim.py --timings FILE)."""
    with tempfile.TemporaryDirectory() as scratch:
        runs = {ranks: launch(ranks, args, Path(scratch) / str(ranks)) for ranks in args.ranks}
        if args.out:
            (args.out / "cpu_timings").mkdir(parents=True, exist_ok=True)
            for ranks, run in runs.items():
                shutil.copy(run / "timings.jsonl", args.out / "cpu_timings" / f"ranks_{ranks}.jsonl")
        return {ranks: sim.read_timings(run / "timings.jsonl") for ranks, run in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tau0", type=float, default=0.01, help="fake engine: seconds per token of the longest")
    parser.add_argument("--median", type=float, default=24)
    parser.add_argument("--sigma", type=float, default=0.8)
    parser.add_argument("--cap", type=int, default=128)
    parser.add_argument("--prompts-per-rank", type=int, default=2)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="write cpu_validation.md and the runs' timings there")
    parser.add_argument("--from-timings", type=Path, default=None,
                        help="no runs: read ranks_N.jsonl from this folder (a previous --out's cpu_timings/)")
    args = parser.parse_args()
    sim = load_simulator()
    started = time.strftime("%Y-%m-%d %H:%M")
    if args.from_timings:
        timings = {ranks: sim.read_timings(args.from_timings / f"ranks_{ranks}.jsonl") for ranks in args.ranks}
    else:
        timings = run_all(args, sim)
    constants = calibrate(timings[args.ranks[0]], args.tau0)
    (ROOT / "benchmarks" / "scaling_constants" / "cpu_2core.json").write_text(json.dumps(constants, indent=2) + "\n")
    values = {name: entry["value"] for name, entry in constants.items()}
    origin = f"timings read from {args.from_timings}" if args.from_timings else f"runs of {started}"
    lines = [f"Fake-engine GRPO, {origin}, {os.cpu_count()} cores; `python benchmarks/fake_scaling.py "
             f"{' '.join(sys.argv[1:])}`. Constants calibrated on the {args.ranks[0]}-rank run only.", "",
             "| ranks | measured mean step s | predicted s | predicted / measured | longest completion (mean) |",
             "|---|---|---|---|---|"]
    for ranks, records in timings.items():
        measured = statistics.mean(record["ranks"][0]["step_s"] for record in records)
        predicted = sim.predict_mean_step_s(records, values, machines=1)
        longest = statistics.mean(max(rank["longest_completion"] for rank in record["ranks"]) for record in records)
        lines.append(f"| {ranks} | {measured:.3f} | {predicted:.3f} | {predicted / measured:.3f} | {longest:.0f} |")
    for ranks, records in timings.items():
        lines += ["", f"### {ranks} ranks", "", sim.timings_report(records, values, machines=1)]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cpu_validation.md").write_text(report)


if __name__ == "__main__":
    main()
