"""The first look at a GPU, in one go (issue 39, item 9; issue 44, item 14): what a lent machine must tell us, as one
JSON file, in one command under its 10-minute cap.

    python benchmarks/first_gpu_check.py --out $OUT/first_gpu_check.json      # on the lent GPU machine, no venv
    python benchmarks/first_gpu_check.py --quick                              # CPU smoke run: runs/first_gpu_check.json

The machine we are lent has torch and transformers and nothing else of ours (no tyro, no vLLM, no registry), so the
torch-level parts import only torch, transformers, safetensors, numpy and the library (common/, tasks/), never a
script (the scripts parse their flags with tyro); tests/test_first_gpu_check.py runs them with tyro and vLLM made
unimportable. Each part runs in a process of its own, under the scripts' deterministic settings (seed_everything,
before CUDA starts) and a time limit: a part that fails, hangs or takes the CUDA context down is recorded (its
traceback, or "timed out") and the next part runs. The JSON is rewritten after every part, so a cut run keeps what it
did. The parts, with what they are expected to take on one H100 (estimates from the sizes below, not yet measured;
about 10 s of each is the process's start: importing torch and transformers, starting CUDA):
- environment (~10 s): python, torch, CUDA build, NCCL, transformers, the NVIDIA driver (tools/doctor.py's check), the
  device, and whether tyro and vLLM are installed;
- head (~40 s): the LM head at Qwen2.5's vocabulary (151,936) and 7B's hidden size (3,584), 1,024 rows, bf16 weights.
  `mm(out_dtype=float32)` (common/llm/batching.py's path) against a float32 GEMM of cast operands: time and error
  against float64. `_ChosenTokenLogprob`'s backward (vocabulary slices of 16,384) twice, bytes compared, and against
  one slice of the whole vocabulary. Its peak memory with the head trained and frozen (issue 44, item 9: a frozen
  head's backward should skip the [V, H] float32 weight gradient; before that fix both peaks are equal);
- cublaslt (~45 s): the trainer's 7B-shaped bf16 GEMMs with cuBLAS, with cuBLASLt
  (`torch.backends.cuda.preferred_blas_library("cublaslt")`, read back), and with cuBLASLt as vLLM's batch-invariant
  mode sets it on SM 9.x and 10.x (`CUBLASLT_WORKSPACE_SIZE=1` KiB, `CUBLAS_WORKSPACE_CONFIG=:16:8`), each in a
  process of its own (both variables are read when the library starts): time, whether a row alone equals the same
  row in the batch, the bits against cuBLAS's, and how many `cublasLtMatmul` calls cuBLASLt's own API log shows
  for one GEMM under each library;
- grpo_lora (~35 s): three GRPO steps of the embedded model with LoRA adapters (rank 8), FSDP2 over a one-process
  group (NCCL on CUDA), bf16, the `transformers` rollout engine, built from the library as grpo_llm.py's loop
  builds them (the loss is its default objective at one update per batch, written out here): which parameters get
  gradients (the adapters alone), the frozen base's bits after the steps, the engine's weights after each sync, peak
  memory per step, and the lengths of FSDP2's forward-order records per step (issue 44, item 10);
- distill (~30 s): three steps of on-policy distillation with the student as its own teacher (a frozen copy, as
  distill_llm.py loads a teacher): the reverse KL must be exactly 0.0 and so the gradient; the frozen teacher's
  forward-order record lengths per step (item 10: they grow by one per sharded module and forward until fixed);
- throughput (~25 s): the HF engine's generation and the trainer's forward + backward in tokens per second;
- vllm_invariance (vLLM only; benchmarks/first_gpu_vllm_worker.py): a seeded sample alone, among 128 others, cached,
  chunked, over a 3-turn episode with the prefix cache kept and reset;
- doctor (tyro and not --quick): `tools/doctor.py --scripts grpo --no-memory`'s verdicts (it runs the scripts).
The torch-level parts together: about 3 minutes estimated; --budget-s (default 480) bounds the whole run, each part's
limit is cut to what is left of it (with --quick the budget alone bounds them: a shared CPU is slow), and a part that
does not fit in what is left is recorded as skipped.
"""

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VOCABULARY, HIDDEN, ROWS = 151_936, 3_584, 1_024
QUICK_HEAD = (40_000, 128, 300)  # CPU: three vocabulary slices, two row chunks
GEMM_SHAPES = [(8_192, 3_584, 18_944), (8_192, 18_944, 3_584), (8_192, 3_584, 4_608)]  # MLP up, down; QKV at 7B
GEMM_VARIANTS = {  # name: (library, environment); the scripts' CUBLAS_WORKSPACE_CONFIG unless vLLM's
    "cublas": ("cublas", {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
    "cublaslt": ("cublaslt", {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
    "cublaslt_as_vllm_batch_invariant": ("cublaslt", {"CUBLAS_WORKSPACE_CONFIG": ":16:8",
                                                      "CUBLASLT_WORKSPACE_SIZE": "1"}),
}
STEPS = 3  # training steps of the grpo_lora and distill parts
LORA_RANK = 8


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


def digest(*tensors: torch.Tensor) -> str:
    """sha256 of the tensors' bytes, in order: equal digests mean equal bits."""
    hasher = hashlib.sha256()
    for tensor in tensors:
        hasher.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


# ---------------------------------------------------------------- environment
def environment(device: torch.device, quick: bool) -> dict:
    import transformers

    from tools.doctor import driver_problem, nvidia_driver

    driver = nvidia_driver()
    cuda = device.type == "cuda"
    nccl = torch.cuda.nccl.version() if cuda else None
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda_build": torch.version.cuda,
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
            "transformers": transformers.__version__, "driver": driver,
            "driver_problem": driver_problem(driver, torch.version.cuda),
            "tyro_installed": importlib.util.find_spec("tyro") is not None,
            "vllm_installed": importlib.util.find_spec("vllm") is not None,
            "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "capability": list(torch.cuda.get_device_capability()) if cuda else None,
            "memory_bytes": torch.cuda.get_device_properties(device).total_memory if cuda else None,
            "blas_library_default": str(torch.backends.cuda.preferred_blas_library()) if cuda else None}


# ---------------------------------------------------------------- the LM head
def head(device: torch.device, quick: bool) -> dict:
    from common.distributed import in_brief
    from common.llm import batching
    from common.llm.batching import _ChosenTokenLogprob

    vocabulary, hidden, rows = QUICK_HEAD if quick else (VOCABULARY, HIDDEN, ROWS)
    repeats = 2 if quick else 10
    generator = torch.Generator(device=device).manual_seed(0)
    weight = (torch.randn(vocabulary, hidden, generator=generator, device=device) * 0.02).to(torch.bfloat16)
    states = torch.randn(rows, hidden, generator=generator, device=device).to(torch.bfloat16)
    tokens = torch.randint(0, vocabulary, (rows,), generator=generator, device=device)
    results = {"vocabulary": vocabulary, "hidden": hidden, "rows": rows,
               "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
               "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
               "vocabulary_slice": batching.VOCABULARY_SLICE}
    exact = states.double() @ weight.double().t()  # float64 of the bf16 operands: only the GEMM's own error remains
    variants = {"mm_out_dtype_float32": lambda: torch.mm(states, weight.t(), out_dtype=torch.float32),
                "float32_of_cast_operands": lambda: states.float() @ weight.float().t()}
    for name, function in variants.items():
        try:
            error = (function().double() - exact).abs().max().item()
            results[name] = {"seconds": timed(function, device, repeats), "max_abs_error_vs_float64": error}
        except (RuntimeError, TypeError) as failure:  # mm(out_dtype) exists for CUDA bf16 only
            results[name] = {"error": in_brief(failure)}
    del exact

    def gradients(weight_trained: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        leaf_states, leaf_weight = states.clone().requires_grad_(), weight.clone().requires_grad_(weight_trained)
        _ChosenTokenLogprob.apply(leaf_states, leaf_weight, tokens, 1.0).sum().backward()
        return leaf_states.grad, leaf_weight.grad

    results["forward_backward_s"] = timed(gradients, device, repeats)
    first = gradients()
    first_bits = digest(*first)
    results["backward_twice"] = {"same_bits": first_bits == digest(*gradients()), "sha256": first_bits[:16]}
    sliced = batching.VOCABULARY_SLICE
    batching.VOCABULARY_SLICE = vocabulary  # the whole vocabulary as one slice: one GEMM per row chunk
    try:
        whole = gradients()
    finally:
        batching.VOCABULARY_SLICE = sliced
    results["sliced_vs_one_slice"] = {
        "same_bits": first_bits == digest(*whole),
        "max_abs_difference_hidden": (first[0].float() - whole[0].float()).abs().max().item(),
        "max_abs_difference_weight": (first[1].float() - whole[1].float()).abs().max().item()}
    del first, whole
    if device.type != "cuda":
        results["backward_peak_memory"] = {"skipped": "no allocator statistics on the CPU"}
        return results
    peaks = {}
    for trained in (True, False):  # the same inputs; only whether the head's weight wants a gradient
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        gradients(trained)
        torch.cuda.synchronize()
        peaks["head_trained" if trained else "head_frozen"] = torch.cuda.max_memory_allocated() - before
    results["backward_peak_memory"] = {
        "bytes_above_inputs": peaks, "frozen_saves_bytes": peaks["head_trained"] - peaks["head_frozen"],
        # what skipping the frozen head's weight gradient (item 9) should save at least: the float32 accumulator
        # and the copy returned in the head's dtype; 0 before the fix
        "weight_gradient_bytes": vocabulary * hidden * (4 + weight.element_size())}
    return results


# ---------------------------------------------------------------- cuBLAS against cuBLASLt
def gemms(library: str, trace: bool) -> dict:
    """In a process of its own, started with the variant's environment: the GEMM_SHAPES products under `library`, or
    with `trace` one product only (cuBLASLt's API log, set in the environment, counts the calls that reached it)."""
    torch.backends.cuda.preferred_blas_library(library)
    in_force = str(torch.backends.cuda.preferred_blas_library())
    torch.use_deterministic_algorithms(True)
    generator = torch.Generator(device="cuda").manual_seed(0)
    results = {"library_in_force": in_force, "selected": in_force.lower().endswith(f".{library}")}
    for m, k, n in GEMM_SHAPES[:1] if trace else GEMM_SHAPES:
        a = torch.randn(m, k, generator=generator, device="cuda").to(torch.bfloat16)
        b = torch.randn(k, n, generator=generator, device="cuda").to(torch.bfloat16)
        product = a @ b
        if trace:
            torch.cuda.synchronize()
            break
        results[f"{m}x{k}x{n}"] = {
            "seconds": timed(lambda a=a, b=b: a @ b, torch.device("cuda"), 20),
            "first_row_alone_same_bits": torch.equal(a[:1] @ b, product[:1]),  # split-K decided by the batch?
            "first_64_rows_sha256": digest(product[:64])}
    return results


def cublaslt(device: torch.device, quick: bool) -> dict:
    if device.type != "cuda":
        return {"skipped": "no GPU: cuBLAS and cuBLASLt are CUDA libraries"}
    results = {}
    for name, (library, variables) in GEMM_VARIANTS.items():
        results[name] = child(["--gemms", library], variables, 60, own_group=False)
    for name in ("cublas", "cublaslt"):
        with tempfile.TemporaryDirectory() as directory:
            log = Path(directory) / "cublaslt.log"
            library, variables = GEMM_VARIANTS[name]
            traced = child(["--gemms", library, "--trace"], {**variables, "CUBLASLT_LOG_LEVEL": "5",
                                                               "CUBLASLT_LOG_FILE": str(log)}, 60, own_group=False)
            lines = [line for line in (log.read_text(errors="replace").splitlines() if log.exists() else [])
                     if re.search(r"\bcublasLtMatmul\b", line)]  # the call, not its helpers (cublasLtMatmulDesc...)
            results[name]["cublaslt_api_log_for_one_gemm"] = traced if "error" in traced else {
                "matmul_lines": len(lines), "first": lines[0][:300] if lines else None}
    reference = results["cublas"]
    for name in ("cublaslt", "cublaslt_as_vllm_batch_invariant"):
        for shape, values in results[name].items():
            if isinstance(values, dict) and "first_64_rows_sha256" in values:
                values["same_bits_as_cublas"] = values["first_64_rows_sha256"] == reference.get(shape, {}).get(
                    "first_64_rows_sha256")
    return results


# ---------------------------------------------------------------- training steps from the library
def forward_order_lengths(model: torch.nn.Module) -> dict[str, int]:
    """The lengths of FSDP2's per-iteration records of the forward order, which its backward's final callback clears:
    the root's `post_forward_order` (one entry per sharded module and forward) and every param group's
    `_post_forward_indices`. A model that never runs backward (a frozen reference or teacher) keeps them growing
    unless something else clears them (issue 44, item 10). Private attributes of torch's
    distributed/fsdp/_fully_shard (_fsdp_state.py, _fsdp_param_group.py); a group is `_fsdp_param_groups` (a list)
    in torch 2.13 and `_fsdp_param_group` in earlier releases."""
    from torch.distributed.fsdp import FSDPModule

    states = [module._get_fsdp_state() for module in model.modules() if isinstance(module, FSDPModule)]
    groups = [group for state in states for group in
              (getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)])
              if group is not None]
    return {"post_forward_order": len(model._get_fsdp_state()._comm_ctx.post_forward_order),
            "post_forward_indices": sum(len(group._post_forward_indices) for group in groups)}


def training_setup(device: torch.device) -> SimpleNamespace:
    """What prepare_run gives a script, without flags: the process group (one process: gloo, and NCCL on CUDA),
    the embedded model's tokenizer, EOS and pad ids, and its task."""
    from transformers import AutoTokenizer

    from common.distributed import init_distributed
    from common.llm.lifecycle import eos_token_ids
    from common.llm.run import EMBEDDED_MODEL
    from tasks.addition import AdditionTask

    init_distributed()
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    eos_ids = eos_token_ids(EMBEDDED_MODEL, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    return SimpleNamespace(tokenizer=tokenizer, eos_ids=eos_ids, pad_id=pad_id, device=device,
                           task=AdditionTask(num_train=1_000, num_test=1))


def sample_step(engine: object, setup: SimpleNamespace, step: int, prompts: int, generations: int) -> tuple:
    """One step's rollouts as generate() makes them: `prompts` training prompts, G samples each with their own
    seeds, scored by the task; the token batch with the engine's logprobs, and the scores."""
    from common.llm.batching import make_batch
    from common.llm.engines import sample_seed
    from common.llm.scoring import decode_completion

    examples = setup.task.train[(step - 1) * prompts:step * prompts]
    prompt_ids = setup.tokenizer([example.prompt for example in examples], add_special_tokens=True).input_ids
    rows = [ids for ids in prompt_ids for _ in range(generations)]
    seeds = [sample_seed(1, step, p, g) for p in range(prompts) for g in range(generations)]
    samples = engine.generate(rows, seeds, 8, 1.0, setup.eos_ids)
    texts = [decode_completion(setup.tokenizer, sample.completion_ids, setup.eos_ids) for sample in samples]
    scores = torch.tensor([setup.task.reward(text, examples[row // generations]) for row, text in enumerate(texts)])
    batch = make_batch(rows, [sample.completion_ids for sample in samples], setup.pad_id, setup.device,
                       rollout_logprobs=[sample.logprobs for sample in samples])
    return batch, scores


def peak_memory(device: torch.device, since: int) -> int | None:
    return torch.cuda.max_memory_allocated() - since if device.type == "cuda" else None


def memory_start(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def grpo_lora(device: torch.device, quick: bool) -> dict:
    """grpo_llm.py's loop at --lora-rank 8 --beta 0.04 --dtype bfloat16 --rollout-engine hf, one process, padded rows
    (SDPA: the packed rows' FlexAttention is compiled by Triton, a separate question). Its default objective at one
    update per batch: group-normalised advantages, the clipped surrogate at ratio 1 (REINFORCE), TIS at cap 2, the
    k3 KL to the reference (LoRA: the policy with its adapters off), DAPO's token mean."""
    from common.determinism import hash_named_tensors
    from common.llm.attention import PADDED_ATTENTION
    from common.llm.batching import token_logprobs
    from common.llm.engines import HFEngine
    from common.llm.lora import adapters_disabled, is_adapter, lora_spec
    from common.llm.models import load_model, make_optimizer, optimizer_step
    from common.llm.rollouts import sync_weights
    from common.llm.run import EMBEDDED_MODEL, LLMArgs

    setup = training_setup(device)
    args = LLMArgs(dtype="bfloat16", lora_rank=LORA_RANK, learning_rate=3e-3, warmup_steps=0)
    prompts, generations = (4, 4) if quick else (16, 8)
    beta = 0.04  # the KL coefficient of DeepSeekMath's GRPO
    policy = load_model(EMBEDDED_MODEL, args, device, attn_implementation=PADDED_ATTENTION, lora=lora_spec(args))
    optimizer, scheduler = make_optimizer(policy, args, args.learning_rate, STEPS)
    engine = HFEngine(EMBEDDED_MODEL, torch.bfloat16, device)

    def frozen_bits() -> str:
        return hash_named_tensors((name, parameter.full_tensor()) for name, parameter in policy.named_parameters()
                                  if not parameter.requires_grad)

    def engine_bits() -> str:
        return hash_named_tensors(sorted(engine.model.state_dict().items()))

    base_before, steps = frozen_bits(), []
    for step in range(1, STEPS + 1):
        started, since = time.perf_counter(), memory_start(device)
        batch, scores = sample_step(engine, setup, step, prompts, generations)
        grouped = scores.view(prompts, generations)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1, 1)
        num_tokens = batch.mask.sum()
        policy.eval()
        with torch.no_grad(), adapters_disabled(policy):
            reference = token_logprobs(policy, batch, 1.0)
        logprobs = token_logprobs(policy, batch, 1.0)
        old = logprobs.detach()
        correction = torch.exp(old - batch.rollout_logprobs).clamp(max=2.0)
        log_ratio = reference - logprobs
        per_token = -torch.exp(logprobs - old) * advantages.to(device) * correction + beta * (
            torch.exp(log_ratio) - log_ratio - 1)
        loss = (per_token * batch.mask).sum() / num_tokens
        loss.backward()
        with_gradient = {name for name, parameter in policy.named_parameters() if parameter.grad is not None}
        adapters = {name for name, _ in policy.named_parameters() if is_adapter(name)}
        grad_norm, _ = optimizer_step(policy, optimizer, scheduler, args.max_grad_norm, step)
        engine_before = engine_bits()
        sync_weights(engine, policy, args.dtype)
        synchronize(device)
        steps.append({"loss": loss.item(), "grad_norm": grad_norm, "score": scores.mean().item(),
                      "tokens": int(num_tokens.item()), "seconds": time.perf_counter() - started,
                      "gradients_beyond_adapters": sorted(with_gradient - adapters),
                      "adapters_without_gradient": sorted(adapters - with_gradient),
                      "engine_weights_changed_by_sync": engine_bits() != engine_before,
                      "peak_bytes_above_step_start": peak_memory(device, since),
                      "policy_forward_order_lengths": forward_order_lengths(policy)})
    return {"steps": steps, "adapters": len(adapters), "frozen_base_same_bits": frozen_bits() == base_before,
            "gradients_on_adapters_only": all(not s["gradients_beyond_adapters"] and not s["adapters_without_gradient"]
                                              for s in steps)}


def distill(device: torch.device, quick: bool) -> dict:
    """distill_llm.py's loop with --teacher-model = the student, bf16, --rollout-engine hf, one process: the teacher a
    frozen copy (held in bf16), the student trained in full. Both log-probabilities come from the same computation on
    the same bf16 weights, so distill_llm.py's reward r_t = -(log pi_student - log pi_teacher) is 0.0 on every token:
    the reverse KL, the loss and the gradient are exactly 0, and the student stays the teacher step after step."""
    from common.llm.attention import PADDED_ATTENTION
    from common.llm.batching import token_logprobs
    from common.llm.engines import HFEngine
    from common.llm.models import load_model, make_optimizer, optimizer_step
    from common.llm.rollouts import sync_weights
    from common.llm.run import EMBEDDED_MODEL, LLMArgs

    setup = training_setup(device)
    args = LLMArgs(dtype="bfloat16", warmup_steps=0)
    prompts, generations = (4, 4) if quick else (16, 8)
    student = load_model(EMBEDDED_MODEL, args, device, attn_implementation=PADDED_ATTENTION)
    teacher = load_model(EMBEDDED_MODEL, args, device, trainable=False, attn_implementation=PADDED_ATTENTION)
    optimizer, scheduler = make_optimizer(student, args, args.learning_rate, STEPS)
    engine = HFEngine(EMBEDDED_MODEL, torch.bfloat16, device)
    steps = []
    for step in range(1, STEPS + 1):
        started, since = time.perf_counter(), memory_start(device)
        batch, _ = sample_step(engine, setup, step, prompts, generations)
        num_tokens = batch.mask.sum()
        student.eval()
        with torch.no_grad():
            teacher_logprobs = token_logprobs(teacher, batch, 1.0)
        logprobs = token_logprobs(student, batch, 1.0)
        rewards = -(logprobs.detach() - teacher_logprobs) * batch.mask
        correction = torch.exp(logprobs.detach() - batch.rollout_logprobs).clamp(max=2.0)
        loss = -(correction * rewards * logprobs * batch.mask).sum() / num_tokens
        loss.backward()
        grad_norm, _ = optimizer_step(student, optimizer, scheduler, args.max_grad_norm, step)
        sync_weights(engine, student, args.dtype)
        synchronize(device)
        steps.append({"reverse_kl": (-rewards.sum() / num_tokens).item(), "loss": loss.item(), "grad_norm": grad_norm,
                      "max_abs_logprob_difference": ((logprobs.detach() - teacher_logprobs) * batch.mask).abs().max()
                      .item(), "tokens": int(num_tokens.item()), "seconds": time.perf_counter() - started,
                      "peak_bytes_above_step_start": peak_memory(device, since),
                      "teacher_forward_order_lengths": forward_order_lengths(teacher),
                      "student_forward_order_lengths": forward_order_lengths(student)})
    return {"steps": steps, "reverse_kl_exactly_zero": all(s["reverse_kl"] == 0.0 and s["grad_norm"] == 0.0
                                                           for s in steps)}


def throughput(device: torch.device, quick: bool) -> dict:
    from transformers import AutoModelForCausalLM

    from common.llm.engines import HFEngine
    from common.llm.run import EMBEDDED_MODEL

    engine = HFEngine(EMBEDDED_MODEL, torch.float32, device)
    prompts = [[4, 5, 13, 6, 7, 14]] * (32 if quick else 256)
    started = time.perf_counter()
    samples = engine.generate(prompts, list(range(len(prompts))), 8, 1.0, [1])
    synchronize(device)
    generated = sum(len(sample.completion_ids) for sample in samples)
    generation = generated / (time.perf_counter() - started)
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32).to(device)
    ids = torch.randint(3, 15, (64, 32), device=device)

    def step() -> None:
        model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()

    seconds = timed(step, device, 3 if quick else 20)
    return {"hf_engine_generated_tokens_per_s": generation,
            "trainer_forward_backward_tokens_per_s": ids.numel() / seconds}


# ---------------------------------------------------------------- parts that need what the lent machine lacks
def vllm_invariance(limit_s: float, quick: bool) -> dict:
    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vLLM is not installed here"}
    worker = ROOT / "benchmarks" / "first_gpu_vllm_worker.py"
    done = run([sys.executable, str(worker), *(["--quick"] if quick else [])], {}, limit_s)
    if isinstance(done, dict):
        return done
    return json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {"error": done.stderr[-3000:]}


def doctor(limit_s: float, quick: bool) -> dict:
    if quick:
        return {"skipped": "--quick"}
    if importlib.util.find_spec("tyro") is None:
        return {"skipped": "tools/doctor.py runs the scripts, which parse their flags with tyro: not installed here"}
    done = run([sys.executable, "tools/doctor.py", "--scripts", "grpo", "--no-memory",
                "--timeout", str(int(limit_s // 4))], {}, limit_s)  # two runs and a resume, within the limit
    return done if isinstance(done, dict) else {"exit_status": done.returncode, "output_tail": done.stdout[-3000:]}


# ---------------------------------------------------------------- running the parts
TORCH_PARTS = {"environment": (environment, 60), "head": (head, 150), "cublaslt": (cublaslt, 150),
               "grpo_lora": (grpo_lora, 150), "distill": (distill, 120), "throughput": (throughput, 90)}
OTHER_PARTS = {"vllm_invariance": (vllm_invariance, 300), "doctor": (doctor, 300)}  # (limit in seconds)


def run(command: list[str], variables: dict[str, str], limit_s: float, own_group: bool = True
        ) -> subprocess.CompletedProcess | dict:
    """`command` from the repository root with `variables` added to the environment; {"error": ...} when it runs
    past `limit_s`. With `own_group` it starts a process group of its own, killed whole on a timeout (a part's own
    children with it); a part's children stay in the part's group, so that they go with it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", **variables}  # no hub here
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=own_group)
    try:
        stdout, stderr = process.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        if own_group:
            os.killpg(process.pid, signal.SIGKILL)
        else:
            process.kill()
        _, stderr = process.communicate()
        return {"error": f"timed out after {limit_s:.0f} s", "stderr_tail": stderr[-2000:]}
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def child(arguments: list[str], variables: dict[str, str], limit_s: float, own_group: bool = True) -> dict:
    """This script with `arguments` in a process of its own; its result (a JSON file), or what went wrong."""
    with tempfile.TemporaryDirectory() as directory:
        result = Path(directory) / "result.json"
        done = run([sys.executable, __file__, *arguments, "--result", str(result)], variables, limit_s, own_group)
        if isinstance(done, dict):
            return done
        if done.returncode != 0 or not result.exists():
            return {"error": f"exit status {done.returncode}", "stderr_tail": done.stderr[-3000:]}
        return json.loads(result.read_text())


def in_child(options: argparse.Namespace) -> None:
    """A part (or one GEMM variant) in this process: deterministic settings first, as the scripts set them before
    CUDA starts; an exception is the part's result."""
    from common.determinism import seed_everything

    started = time.perf_counter()
    try:
        if options.gemms:
            result = gemms(options.gemms, options.trace)
        else:
            seed_everything(0, deterministic=True)
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
            result = TORCH_PARTS[options.part][0](device, options.quick)
    except Exception:
        result = {"error": traceback.format_exc()[-3000:]}
    result["seconds_in_process"] = round(time.perf_counter() - started, 2)
    options.result.write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/first_gpu_check.json"), help="the JSON file to write")
    parser.add_argument("--quick", action="store_true", help="small sizes, no doctor, no time limit per part (only "
                        "the budget): a smoke run, on a shared CPU too")
    parser.add_argument("--budget-s", type=float, default=480, help="seconds the whole run may take")
    parser.add_argument("--part", choices=TORCH_PARTS, help=argparse.SUPPRESS)  # a child's part
    parser.add_argument("--gemms", choices=("cublas", "cublaslt"), help=argparse.SUPPRESS)  # a child's library
    parser.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.part or options.gemms:
        in_child(options)
        return
    options.out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results = {"budget_s": options.budget_s, "quick": options.quick}
    for name, (_, limit_s) in {**TORCH_PARTS, **OTHER_PARTS}.items():
        part_started = time.perf_counter()
        left = options.budget_s - (part_started - started)
        if left < 15:
            results[name] = {"skipped": f"the run's {options.budget_s:.0f} s budget is spent"}
        elif name in TORCH_PARTS:
            results[name] = child(["--part", name, *(["--quick"] if options.quick else [])], {},
                                  left if options.quick else min(limit_s, left))
        else:
            results[name] = OTHER_PARTS[name][0](left if options.quick else min(limit_s, left), options.quick)
        results[name]["part_seconds"] = round(time.perf_counter() - part_started, 2)
        results["total_seconds"] = round(time.perf_counter() - started, 2)
        options.out.write_text(json.dumps(results, indent=1) + "\n")  # what is done so far survives a cut
        status = "error" if "error" in results[name] else "skipped" if "skipped" in results[name] else "ok"
        print(f"{name}: {status}, {results[name]['part_seconds']:.1f} s", flush=True)
    print(f"wrote {options.out}")


if __name__ == "__main__":
    main()
