"""Seeding, deterministic kernels and run fingerprints."""

import hashlib
import os
import random

import numpy as np
import torch


def configure_determinism_env(deterministic: bool) -> dict[str, str]:
    """Set the environment variables that must exist before CUDA, NCCL or vLLM start.

    Call this at the very top of a script, before any engine is created. Returns what was set, for the manifest.
    """
    if not deterministic:
        return {}
    wanted = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"}
    if torch.cuda.is_available():
        wanted["VLLM_BATCH_INVARIANT"] = "1"  # batch-invariant vLLM kernels; read when vLLM is imported
    for key, value in wanted.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in wanted}


def seed_everything(seed: int, deterministic: bool = True) -> dict[str, object]:
    """Seed python, numpy and torch; with `deterministic`, force deterministic kernels and turn TF32 off."""
    env = configure_determinism_env(deterministic)
    seed_rngs(seed)
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic
    if deterministic:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return {"deterministic": deterministic, "seed": seed, **env}


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
        tensor = state[name]
        if hasattr(tensor, "full_tensor"):  # FSDP2 DTensor: gather the shards first
            tensor = tensor.full_tensor()
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def rng_states() -> dict[str, object]:
    """Every RNG state this process owns, for checkpoints."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, object]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
