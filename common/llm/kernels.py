"""vLLM's kernels in the trainer's process: which aten ops vLLM's batch-invariant mode overrides (for the manifest),
autograd routed around its composite overrides (which have no backward), the same kernels installed in a split
trainer that has no engine, and the determinism variables in force once the engine started."""

import os

import torch

# Variables that decide determinism on GPUs; vLLM's batch-invariant mode rewrites several of the NCCL ones.
DETERMINISM_ENV = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "VLLM_BATCH_INVARIANT", "TRITON_F32_DEFAULT",
                   "NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_LAUNCH_MODE",
                   "NCCL_NTHREADS", "VLLM_USE_V2_MODEL_RUNNER", "VLLM_DISTRIBUTED_USE_SPLIT_GROUP")


def effective_determinism_env() -> dict[str, str]:
    """The values in force now (read after the rollout engine started, for the manifest)."""
    return {key: os.environ[key] for key in DETERMINISM_ENV if key in os.environ}


# Composite ops, whose gradient autograd takes from their decomposition (linear -> addmm, matmul -> mm / bmm). A
# backend kernel registered for one of them hides the decomposition, and autograd's backward then calls
# linear_backward / matmul_backward, which have no CPU or CUDA kernel: vLLM's batch-invariant mode registers such
# kernels for linear and matmul on compute capability 8.x (A100, A10, L4, L40S, RTX 30/40), process-wide, and our
# trainer shares the process. Hopper and Blackwell get none.
COMPOSITE_OPS = ("linear", "matmul")


_autograd_reroutes: list[torch.library.Library] = []  # registrations live as long as their Library object


def python_kernels(device_type: str) -> list[str]:
    """The aten ops whose `device_type` kernel was registered from Python (vLLM's overrides), for the manifest."""
    key = device_type.upper()
    def registered_at(op: str) -> str:  # the active kernel's line in the dispatcher's dump
        return next((line for line in torch._C._dispatch_dump(op).splitlines() if line.startswith(f"{key}: ")), "")

    return sorted(op for op in torch._C._dispatch_get_registrations_for_dispatch_key(key)
                  if op.startswith("aten::") and ".py:" in registered_at(op))


def reroute_composite_autograd(device_type: str) -> list[str]:
    """For each of COMPOSITE_OPS that now has a `device_type` kernel of its own, make autograd run the op's
    decomposition again: forward and backward then reach the overriding library's kernels through the parts (mm,
    addmm, bmm and their derivative formulas), batch-invariant and deterministic both ways. Call it after the rollout
    engine started; vLLM's own forwards run under inference mode, which skips autograd, and keep its kernels.
    Returns the ops rerouted by this call."""
    key = device_type.upper()
    rerouted = []
    for op in COMPOSITE_OPS:
        name = f"aten::{op}"
        own_kernel, own_autograd = (torch._C._dispatch_has_kernel_for_dispatch_key(name, k)  # not via an alias
                                    for k in (key, f"Autograd{key}"))
        if own_kernel and not own_autograd:
            if not _autograd_reroutes:
                _autograd_reroutes.append(torch.library.Library("aten", "IMPL"))
            overload = getattr(torch.ops.aten, op).default
            _autograd_reroutes[0].impl(name, lambda *args, _op=overload, **kwargs: _op.decompose(*args, **kwargs),
                                       f"Autograd{key}")
            rerouted.append(op)
    return rerouted


def engine_kernels_without_engine(device_type: str, engine: str) -> bool:
    """A split-layout trainer on CUDA in deterministic mode: install vLLM's batch-invariant kernels and settings in
    this process, as a colocated trainer gets them from the engine it shares its process with (vLLM's worker calls
    init_batch_invariance when it starts): its own mean.dim, softmax, log_softmax and bmm kernels on every NVIDIA
    GPU, mm/addmm/matmul/linear on SM 8.x, the cuBLAS workspace and cuBLASLt choice on SM 9.x and later. Without
    them split trainers compute other bits than colocated ones, and 1 + 1 at staleness 0 would equal the colocated
    run on CPU only. `engine`: the rollout ranks' (--rollout-engine); with the HF or fake engine no process has
    vLLM's kernels, colocated or split. Returns whether it installed them (never on CPU, where vLLM's mode overrides
    nothing)."""
    if device_type != "cuda" or engine != "vllm" or os.environ.get("VLLM_BATCH_INVARIANT") != "1":
        return False
    from vllm.model_executor.determinism.batch_invariant import init_batch_invariance  # a vLLM run: installed

    init_batch_invariance()
    return True
