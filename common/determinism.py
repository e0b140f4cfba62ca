"""Seeding, deterministic kernels and run fingerprints."""

import hashlib
import os
import random
from collections.abc import Iterable

import numpy as np
import torch


def engine_environment(deterministic: bool, cuda: bool, colocated: bool = True) -> dict[str, str]:
    """The environment variables that must exist before CUDA, NCCL, Triton or vLLM start:
    - CUBLAS_WORKSPACE_CONFIG, NCCL_ALGO: cuBLAS's and NCCL's deterministic settings.
    - VLLM_BATCH_INVARIANT (CUDA): vLLM's batch-invariant kernels, read when vLLM is imported.
    - TRITON_F32_DEFAULT=ieee: vLLM's batch-invariant Triton matmuls call `tl.dot` without an input precision, and
      Triton's NVIDIA default for float32 operands is tf32 (a 10-bit mantissa): on SM 8.x, where those kernels
      replace aten's mm, every float32 matmul of the engine and the trainer would round like TF32 while
      torch.backends say TF32 is off. Read at each kernel's compile (triton.knobs.language.fp32_default).
    - VLLM_DISTRIBUTED_USE_SPLIT_GROUP=1 (CUDA, not a determinism setting): vLLM builds its groups with one
      torch.distributed.split_group per group kind instead of a new_group per group, each of which, over a
      device-bound default group, is a world-wide ncclCommSplit (about 10k of them at 1,024 ranks). It needs the
      default group bound to a device, as init_distributed binds it on CUDA; on CPU (gloo, unbound) vLLM refuses it.
      Colocated only: the split layout makes the rollout ranks' own group their default, whose ranks (0..K-1)
      split_group looks up among the world's (T..N-1) and does not find; vLLM's groups there span K ranks."""
    wanted = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "TRITON_F32_DEFAULT": "ieee"} \
        if deterministic else {}
    if deterministic and cuda:
        wanted["VLLM_BATCH_INVARIANT"] = "1"
    if cuda and colocated:
        wanted["VLLM_DISTRIBUTED_USE_SPLIT_GROUP"] = "1"
    return wanted


def seed_everything(seed: int, deterministic: bool = True, colocated: bool = True) -> dict[str, object]:
    """Seed python, numpy and torch; with `deterministic`, force deterministic kernels and turn TF32 off; set
    `engine_environment` (so call it before any engine). Returns the settings, for the manifest.

    Deterministic mode does not fill uninitialised memory: torch's default under use_deterministic_algorithms
    writes NaN into every torch.empty (integers: their maximum), on CUDA a kernel launch per allocation, the
    in-process vLLM engine's buffers included. The fill guards against kernels that read memory nobody wrote,
    which no deterministic kernel does; a read of unwritten memory would make two runs differ, and the tests that
    compare two runs bit for bit are the check."""
    wanted = engine_environment(deterministic, torch.cuda.is_available(), colocated)
    for key, value in wanted.items():
        os.environ.setdefault(key, value)
    seed_rngs(seed)
    torch.use_deterministic_algorithms(deterministic)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic
    if deterministic:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return {"deterministic": deterministic, "seed": seed, "fill_uninitialized_memory": False,
            **{key: os.environ[key] for key in wanted}}


def seed_rngs(seed: int) -> None:
    """Python, numpy and torch (all devices). Call again after starting a vLLM engine: it reseeds them with its own."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def parameter_hash(state: dict[str, torch.Tensor] | torch.nn.Module) -> str:
    """sha256 over names, dtypes, shapes and raw bytes of every tensor: equal hashes mean bitwise-equal weights."""
    if isinstance(state, torch.nn.Module):
        state = state.state_dict()
    return hash_named_tensors((name, state[name].full_tensor() if hasattr(state[name], "full_tensor")  # FSDP2
                               else state[name]) for name in sorted(state))


def hash_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """parameter_hash's digest over (name, full tensor) pairs in the order given (parameter_hash: sorted names)."""
    digest = hashlib.sha256()
    for name, tensor in named:
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def rng_states() -> dict[str, object]:
    """Every RNG state this process owns, for checkpoints: on CUDA its own device's only (a resume with fewer visible
    GPUs, e.g. SLURM's --gpus-per-task 1, must still restore it)."""
    cuda = {"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {}
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(), **cuda}


def restore_rng_states(states: dict[str, object]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        state = states["cuda"]
        if isinstance(state, list | tuple):  # a checkpoint from before: every visible device's state, by index
            state = state[torch.cuda.current_device()]
        torch.cuda.set_rng_state(state)
