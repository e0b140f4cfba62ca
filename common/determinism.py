"""Seeding, deterministic kernels and run fingerprints."""

import hashlib
import os
import random

import numpy as np
import torch


def seed_everything(seed: int, deterministic: bool = True) -> dict[str, object]:
    """Seed python, numpy and torch; with `deterministic`, force deterministic kernels, turn TF32 off and set the
    environment variables that must exist before CUDA, NCCL or vLLM start (so call it before any engine). Returns
    the settings, for the manifest."""
    wanted = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"} if deterministic else {}
    if deterministic and torch.cuda.is_available():
        wanted["VLLM_BATCH_INVARIANT"] = "1"  # batch-invariant vLLM kernels; read when vLLM is imported
    for key, value in wanted.items():
        os.environ.setdefault(key, value)
    seed_rngs(seed)
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic
    if deterministic:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return {"deterministic": deterministic, "seed": seed, **{key: os.environ[key] for key in wanted}}


# Variables that decide determinism on GPUs; vLLM's batch-invariant mode rewrites several of the NCCL ones.
DETERMINISM_ENV = ("CUBLAS_WORKSPACE_CONFIG", "VLLM_BATCH_INVARIANT", "NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS",
                   "NCCL_MAX_NCHANNELS", "NCCL_LAUNCH_MODE", "NCCL_NTHREADS", "VLLM_USE_V2_MODEL_RUNNER")


def effective_determinism_env() -> dict[str, str]:
    """The values in force now (read after the rollout engine started, for the manifest)."""
    return {key: os.environ[key] for key in DETERMINISM_ENV if key in os.environ}


def seed_rngs(seed: int) -> None:
    """Python, numpy and torch (all devices). Call again after starting a vLLM engine: it reseeds them with its own."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def parameter_hash(state: dict[str, torch.Tensor] | torch.nn.Module) -> str:
    """sha256 over names, dtypes, shapes and raw bytes of every tensor: equal hashes mean bitwise-equal weights."""
    if isinstance(state, torch.nn.Module):
        state = state.state_dict()
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].full_tensor() if hasattr(state[name], "full_tensor") else state[name]  # FSDP2: gather
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def rng_states() -> dict[str, object]:
    """Every RNG state this process owns, for checkpoints."""
    cuda = {"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {}
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(), **cuda}


def restore_rng_states(states: dict[str, object]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
