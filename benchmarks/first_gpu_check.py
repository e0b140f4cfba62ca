"""The first look at a GPU, in one go (issue 39, item 9): what a lent machine must tell us, as one JSON file.

    python benchmarks/first_gpu_check.py --out benchmarks/results/first_gpu_check.json            # on the GPU
    python benchmarks/first_gpu_check.py --out /tmp/check.json --quick                            # a CPU smoke run

Parts, each timed and each allowed to fail alone (its error recorded, the rest still run):
- environment: torch, CUDA build, the NVIDIA driver (tools/doctor.py's check), the device, vLLM if installed;
- head: the LM head's forward and backward at Qwen2.5's vocabulary (151,936) and 7B's hidden size (3,584), 1,024 rows,
  bf16 weights: `mm(out_dtype=float32)` (common/llm/batching.py's path) against a float32 GEMM of cast operands: time,
  the error of each against float64, and the backward's peak memory above its inputs;
- cublaslt_workspace: the trainer's 7B-shaped bf16 GEMMs with cuBLASLt's default workspace and with the 1 KiB that
  vLLM's batch-invariant mode sets (CUBLASLT_WORKSPACE_SIZE=1), each in a child process (read at cuBLAS's start);
- vllm_invariance (vLLM only): one seeded request sampled alone, among 128 others, after its prompt was cached, with
  its prefill chunked, and a 3-turn episode with the prefix cache kept and reset between turns: the same tokens and
  logprobs each time, or where they differ;
- throughput: the HF engine's generation and the trainer's forward + backward in tokens per second, embedded models;
- doctor: `tools/doctor.py --scripts grpo --no-memory`'s verdicts.
Nothing is downloaded; without vLLM its part says so. Meant to fit the 9 minutes issue 39 allows on one H200; not
yet run on a GPU, so its time there is unknown (the JSON is rewritten after every part: a cut run keeps what it did).
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VOCABULARY, HIDDEN, ROWS = 151_936, 3_584, 1_024
GEMM_SHAPES = [(8_192, 3_584, 18_944), (8_192, 18_944, 3_584), (8_192, 3_584, 4_608)]  # MLP up, down; QKV at 7B


def environment() -> dict:
    from tools.doctor import driver_problem, nvidia_driver

    driver = nvidia_driver()
    vllm = None
    try:
        import vllm as vllm_module

        vllm = vllm_module.__version__
    except ImportError:
        pass
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda_build": torch.version.cuda,
            "driver": driver, "driver_problem": driver_problem(driver, torch.version.cuda), "vllm": vllm,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
            "capability": list(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(function, device: torch.device, repeats: int) -> float:
    function()  # warm-up: kernels chosen, workspaces allocated
    synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        function()
    synchronize(device)
    return (time.perf_counter() - started) / repeats


def head(device: torch.device, vocabulary: int, hidden: int, rows: int, repeats: int) -> dict:
    from common.llm.batching import _ChosenTokenLogprob

    generator = torch.Generator(device="cpu").manual_seed(0)
    weight64 = torch.randn(vocabulary, hidden, generator=generator, dtype=torch.float64) * 0.02
    hidden64 = torch.randn(rows, hidden, generator=generator, dtype=torch.float64)
    weight, states = weight64.to(device, torch.bfloat16), hidden64.to(device, torch.bfloat16)
    exact = states.double() @ weight.double().t()  # float64 of the bf16 operands: only the GEMM's own error remains
    results = {}
    variants = {"mm_out_dtype_float32": lambda: torch.mm(states, weight.t(), out_dtype=torch.float32),
                "float32_of_cast_operands": lambda: states.float() @ weight.float().t()}
    for name, function in variants.items():
        try:
            error = (function().double() - exact).abs().max().item()
            results[name] = {"seconds": timed(function, device, repeats), "max_abs_error_vs_float64": error}
        except (RuntimeError, TypeError) as failure:  # mm(out_dtype) exists for CUDA bf16 only
            results[name] = {"error": f"{type(failure).__name__}: {failure}"}
    tokens = torch.randint(0, vocabulary, (rows,), generator=generator).to(device)
    leaf_states, leaf_weight = states.clone().requires_grad_(), weight.clone().requires_grad_()

    def forward_backward() -> None:
        _ChosenTokenLogprob.apply(leaf_states, leaf_weight, tokens, 1.0).sum().backward()
        leaf_states.grad = leaf_weight.grad = None

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    results["chosen_token_logprob_forward_backward_s"] = timed(forward_backward, device, repeats)
    if device.type == "cuda":
        results["backward_peak_bytes_above_inputs"] = torch.cuda.max_memory_allocated() - before
    return results


WORKSPACE_CHILD = """
import json, sys, time, torch
shapes = json.loads(sys.argv[1])
out = {}
for m, k, n in shapes:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    a @ b
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    out[f"{m}x{k}x{n}"] = (time.perf_counter() - started) / 20
print(json.dumps(out))
"""


def cublaslt_workspace(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"skipped": "no GPU"}
    results = {}
    for name, value in (("default", None), ("1_kib_as_vllm_batch_invariant", "1")):
        env = {key: item for key, item in os.environ.items() if key != "CUBLASLT_WORKSPACE_SIZE"}
        if value is not None:
            env["CUBLASLT_WORKSPACE_SIZE"] = value
        done = subprocess.run([sys.executable, "-c", WORKSPACE_CHILD, json.dumps(GEMM_SHAPES)], env=env,
                              capture_output=True, text=True, timeout=300)
        results[name] = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else \
            {"error": done.stderr[-2000:]}
    return results


def vllm_invariance(quick: bool) -> dict:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return {"skipped": "vLLM is not installed here"}
    worker = ROOT / "benchmarks" / "first_gpu_vllm_worker.py"
    done = subprocess.run([sys.executable, str(worker), *(["--quick"] if quick else [])], cwd=ROOT,
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        return {"error": done.stderr[-3000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def throughput(device: torch.device, quick: bool) -> dict:
    from common.llm.engines import HFEngine

    model_path = str(ROOT / "assets" / "tiny-adder")
    engine = HFEngine(model_path, torch.float32, device)
    prompts = [[4, 5, 13, 6, 7, 14]] * (32 if quick else 256)
    started = time.perf_counter()
    samples = engine.generate(prompts, list(range(len(prompts))), 8, 1.0, [1])
    synchronize(device)
    generated = sum(len(sample.completion_ids) for sample in samples)
    generation = generated / (time.perf_counter() - started)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    ids = torch.randint(3, 15, (64, 32), device=device)

    def step() -> None:
        model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()

    seconds = timed(step, device, 3 if quick else 20)
    return {"hf_engine_generated_tokens_per_s": generation,
            "trainer_forward_backward_tokens_per_s": ids.numel() / seconds}


def doctor(quick: bool) -> dict:
    if quick:
        return {"skipped": "--quick"}
    done = subprocess.run([sys.executable, "tools/doctor.py", "--scripts", "grpo", "--no-memory"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    return {"exit_status": done.returncode, "output_tail": done.stdout[-3000:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--quick", action="store_true", help="small sizes, no doctor: a smoke run (on the CPU too)")
    options = parser.parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    sizes = (4_096, 256, 64) if options.quick else (VOCABULARY, HIDDEN, ROWS)
    parts = {"environment": environment,
             "head": lambda: head(device, *sizes, 2 if options.quick else 10),
             "cublaslt_workspace": lambda: cublaslt_workspace(device),
             "vllm_invariance": lambda: vllm_invariance(options.quick),
             "throughput": lambda: throughput(device, options.quick),
             "doctor": lambda: doctor(options.quick)}
    results = {}
    for name, part in parts.items():
        started = time.perf_counter()
        try:
            results[name] = part()
        except Exception:  # one part's failure is a finding; the others still run
            results[name] = {"error": traceback.format_exc()[-3000:]}
        results[name] = {**results[name], "part_seconds": round(time.perf_counter() - started, 2)} \
            if isinstance(results[name], dict) else results[name]
        options.out.write_text(json.dumps(results, indent=1) + "\n")  # what is done so far survives a timeout
        print(f"{name}: {time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
