"""Run by tests/test_split.py under torchrun with 3 ranks (gloo, CPU): split_world(1, ...) makes ranks 0-1 the
trainers (the embedded model sharded over them alone by load_model's FSDP2) and rank 2 the rollout rank; the
trainers stream the weights in bfloat16 through send_weights with a small bucket, the rollout rank receives them
(receive_weights) and compares them with its own unsharded copy, and the samples and evaluation cross over. The
rollout rank writes what it found as JSON.

    python -m torch.distributed.run --standalone --nproc_per_node 3 tests/workers/layout_worker.py SUMMARY.json
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.distributed import init_distributed  # noqa: E402
from common.llm import layout, models  # noqa: E402
from common.llm.run import Sample  # noqa: E402

TINY = str(ROOT / "assets" / "tiny-adder")
SMALL_BUCKET_BYTES = 64 * 2**10  # the tiny model is 1.7 MB in bfloat16: many buckets, some of one tensor

init_distributed()
models.SYNC_BUCKET_BYTES = layout.SYNC_BUCKET_BYTES = SMALL_BUCKET_BYTES
split = layout.split_world(rollout_ranks=1, max_staleness=0)
sides = {"rank": dist.get_rank(), "world_size": dist.get_world_size()}
if not split.is_rollout:
    args = SimpleNamespace(dtype="float32", gradient_checkpointing=False, reshard_after_forward=False,
                           fsdp_shard_size=0)
    policy = models.load_model(TINY, args, torch.device("cpu"))
    local = sum(p.to_local().numel() for p in policy.parameters())
    layout.send_weights(split, models.stream_weights(policy, torch.bfloat16))
    rows = 16 // 2  # each trainer's rows of a 16-row batch
    payloads = layout.receive_samples(split, 16)
    got = [(s.completion_ids, s.logprobs, s.truncated) for p in payloads for s in p["samples"]]
    expected = [([r, r + 1], [-0.5 * r, -0.25], r % 2 == 0) for r in range(sides["rank"] * rows,
                                                                            (sides["rank"] + 1) * rows)]
    assert got == expected and payloads[0]["version"] == 7 and payloads[0]["timings"] == {"generate_s": 1.5}
    mine = range(sides["rank"] * rows, (sides["rank"] + 1) * rows)  # each row's score and correctness travel with it
    assert [p["scores"] + p["correct"] for p in payloads] == [[float(r) for r in mine] + [float(r % 3 == 0)
                                                                                          for r in mine]]
    assert layout.receive_evaluation(split) == {"eval/accuracy": 0.25}
    print(json.dumps({"trainer": sides, "local_parameters": local}), flush=True)
else:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    expected = {name: p.detach().to(torch.bfloat16) for name, p in reference.named_parameters(remove_duplicate=False)}
    buckets, received = [], {}
    broadcast = dist.broadcast

    def counting_broadcast(tensor, *args, **kwargs):
        buckets.append(tensor.numel() * tensor.element_size())
        return broadcast(tensor, *args, **kwargs)
    dist.broadcast = counting_broadcast
    for name, tensor in layout.receive_weights(split, torch.device("cpu")):
        received[name] = tensor.clone()
    dist.broadcast = broadcast
    samples = [Sample([r, r + 1], [-0.5 * r, -0.25], r % 2 == 0) for r in range(16)]
    layout.send_samples(split, 16, samples, [float(r) for r in range(16)], [float(r % 3 == 0) for r in range(16)], 7,
                        {"generate_s": 1.5})
    layout.send_evaluation(split, {"eval/accuracy": 0.25})
    summary = {"rollout": sides, "names_equal": sorted(received) == sorted(expected),
               "bitwise_equal": all(torch.equal(received[n], expected[n]) for n in expected if n in received),
               "dtypes": sorted({str(t.dtype) for t in received.values()}), "bucket_bytes": buckets,
               "model_bytes": sum(t.numel() * 2 for n, t in reference.named_parameters())}
    Path(sys.argv[1]).write_text(json.dumps(summary))
dist.barrier(group=split.world)
