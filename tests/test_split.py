"""The split layout (--rollout-ranks, --max-staleness; common/llm/layout.py): bad layouts refused on every rank, the
1 + 1 split equal to the single-process colocated run bit for bit (the sample and weight transfers are exact), and
one-step-off runs that give the same bits with a slow rank and after a resume."""

import json
import statistics
import sys

import pytest
import torch
from conftest import check, only_run_dir, preempt_at_random, read_metrics, run_resume_line, run_script, script_env

import grpo_llm
from common.llm import layout

SHORT = ["--task", "tests/small_addition_task.py:SmallAdditionTask", "--prompts-per-step", "16", "--num-generations",
         "4", "--micro-batch-size", "16", "--num-eval-prompts", "32", "--eval-every", "2"]


@pytest.mark.parametrize("changes, world_size, message", [
    ({"rollout_ranks": 2}, 2, "leaves no trainer rank"),
    ({"rollout_ranks": -1}, 2, "--rollout-ranks must be non-negative"),
    ({"max_staleness": 1}, 2, "--max-staleness 1 needs --rollout-ranks"),
    ({"rollout_ranks": 1, "max_staleness": 2}, 2, "--max-staleness 0 or 1"),
    ({"rollout_ranks": 3, "vllm_tp": 2, "prompts_per_step": 3}, 4, "--vllm-tp 2 must divide the rollout ranks 3"),
    ({"rollout_ranks": 3, "prompts_per_step": 64}, 4, "must be divisible by the rollout ranks 3"),
    ({"rollout_ranks": 1, "prompts_per_step": 64}, 4, "must be divisible by the trainer ranks 3"),
    ({"rollout_ranks": 1, "seq_mask_cap": 0.5}, 2, "--seq-mask-cap must be 0 (off) or above 1"),
])
def test_bad_layouts_are_refused(changes: dict, world_size: int, message: str, capsys):
    with pytest.raises(SystemExit) as exit_info:
        grpo_llm.check_args(grpo_llm.Args(**changes), world_size)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bad_layout_stops_every_rank_before_any_engine(tmp_path):
    result = run_script("dpo_online.py", ["--rollout-ranks", "2", "--run-root", str(tmp_path)], nproc=2, timeout=120)
    assert result.returncode != 0  # each rank runs the check; torchrun stops the other when the first exits
    assert "error: --rollout-ranks 2 leaves no trainer rank in a world of 2" in result.stderr
    assert "Initializing" not in result.stdout + result.stderr and not list(tmp_path.iterdir())  # nothing started


def test_each_trainer_hears_only_from_the_rollout_ranks_holding_its_rows():
    """48 rows, 2 rollout ranks (24 each) and 3 trainers (16 each): rollout 0 sends rows 0-15 to trainer 0 and
    16-23 to trainer 1, rollout 1 rows 24-31 to trainer 1 and 32-47 to trainer 2, and its timings (no rows) to
    trainer 0, which logs them."""
    split = layout.Layout(rollout_ranks=2, trainer_ranks=3, max_staleness=0, is_rollout=False, world=None,
                          bridge=None)
    assert layout._correspondents(split, 48) == {(0, 0): range(0, 16), (0, 1): range(16, 24),
                                                 (1, 0): range(24, 24), (1, 1): range(24, 32), (1, 2): range(32, 48)}


def test_the_transfers_between_the_sides(tmp_path):
    """tests/workers/layout_worker.py, 3 gloo ranks: two trainers (FSDP2 over themselves alone, each holding half the
    parameters) stream the weights in bfloat16 through 64 KiB buckets; the rollout rank gets every name (the tied
    LM head too, sent once) bitwise equal to its own unsharded copy, one broadcast per bucket, none near the whole
    model; each trainer receives exactly its rows of the samples, and the evaluation."""
    summary_path = tmp_path / "summary.json"
    check(run_script("tests/workers/layout_worker.py", [str(summary_path)], nproc=3, timeout=300))
    summary = json.loads(summary_path.read_text())
    assert summary["rollout"] == {"rank": 0, "world_size": 1}  # the rollout side's own world
    assert summary["names_equal"] and summary["bitwise_equal"] and summary["dtypes"] == ["torch.bfloat16"]
    assert sum(summary["bucket_bytes"]) == summary["model_bytes"]  # every tensor once: the tied one is an alias
    assert len(summary["bucket_bytes"]) > 10 and max(summary["bucket_bytes"]) < summary["model_bytes"] / 10


def comparable(run_dir):
    """metrics.jsonl without the split layout's own keys (its weight versions)."""
    return [{k: v for k, v in m.items() if not k.startswith("rollout/")} for m in read_metrics(run_dir)]


def final_hash(run_dir) -> str:
    return json.loads((run_dir / "final.json").read_text())["parameter_sha256"]


@pytest.mark.parametrize("script", ["grpo_llm.py", "ppo_llm.py"])
def test_one_plus_one_split_equals_the_single_process_run(script: str, tmp_path):
    """Staleness 0 with one trainer and one rollout rank computes what one process does alone: the same samples
    (seeds from global coordinates, the same engine seed), the same weights back into the engine (float32 buckets,
    a broadcast is a copy), the same evaluations. So every metric and the final weights match bit for bit. (Online
    DPO's loop makes the same layout calls as GRPO's; PPO adds a second trained model and judge.)"""
    args = [*SHORT, "--total-steps", "3", "--seed", "2"]
    check(run_script(script, [*args, "--run-root", str(tmp_path / "alone")]))
    check(run_script(script, [*args, "--rollout-ranks", "1", "--run-root", str(tmp_path / "split")], nproc=2))
    alone, split = only_run_dir(tmp_path / "alone"), only_run_dir(tmp_path / "split")
    assert comparable(split) == comparable(alone)
    assert final_hash(split) == final_hash(alone)
    staleness = [(m["rollout/weight_version"], m["rollout/staleness"]) for m in read_metrics(split) if m["step"]]
    assert staleness == [(0, 0), (1, 0), (2, 0)]  # batch t sampled with the weights after update t - 1
    timings = [json.loads(line) for line in (split / "timings.jsonl").read_text().splitlines()]
    assert [len(t["ranks"]) for t in timings] == [1] * 3 and [len(t["rollout_ranks"]) for t in timings] == [1] * 3
    perf = read_metrics(split, "perf.jsonl")
    assert all("perf/trainer_wait_s" in p and "perf/rollout_wait_s" in p for p in perf if p["step"])


# One-step-off GRPO on multi-turn episodes (tests/second_look_task.py: two model turns around a reply), with dynamic
# sampling.
ONE_STEP_OFF = [*SHORT, "--total-steps", "4", "--save-every", "2", "--keep-last", "0", "--rollout-ranks", "1",
                "--max-staleness", "1", "--task", "tests/second_look_task.py:SecondLookTask", "--max-completion-length",
                "16", "--dynamic-sampling-rounds", "2"]


def test_one_step_off_is_timing_independent_and_resumes_exactly(tmp_path):
    """The same one-step-off run (of multi-turn episodes, with DAPO's dynamic sampling on the rollout side) as is;
    then with the rollout rank sleeping 1.5 s before every generation (the trainer then waits for samples) and stopped
    by SIGTERM to torchrun at a random moment of steps 1-3; then resumed by the line it printed, with the trainer
    sleeping 0.5 s before every update. Same metrics.jsonl bytes and final weights: the schedule is fixed, whatever is
    ready first, and the batch in flight travels in the preemption's checkpoint."""
    check(run_script("grpo_llm.py", [*ONE_STEP_OFF, "--run-root", str(tmp_path / "plain")], nproc=2))
    plain = only_run_dir(tmp_path / "plain")
    reference, reference_hash = (plain / "metrics.jsonl").read_bytes(), final_hash(plain)
    steps = [m for m in read_metrics(plain) if m["step"]]
    staleness = [(m["rollout/weight_version"], m["rollout/staleness"]) for m in steps]
    assert staleness == [(0, 0), (0, 1), (1, 1), (2, 1)]  # batch t sampled with the weights after update t - 2
    assert [m["episode/turns"] for m in steps] == [2.0] * 4  # episodes, sent whole
    assert all(1 <= m["dynamic/rounds"] <= 3 and m["dynamic/sampled_prompts"] >= 16 for m in steps)
    assert any(m["dynamic/sampled_prompts"] > 16 for m in steps)  # refilled: the trainer got the refill's prompts
    checkpoint = plain / "checkpoints" / "step_00000002"
    in_flight = torch.load(checkpoint / "trainer_state.pt", weights_only=False)["in_flight"][0]
    assert in_flight[0]["version"] == 1 and len(in_flight[0]["samples"]) == 16 * 4  # step 3's batch, trainer 0's rows
    assert len(in_flight[0]["indices"]) == 16 * 4  # and the prompts they answer (dynamic sampling refills)

    step_s = statistics.median(p["perf/step_s"] for p in read_metrics(plain, "perf.jsonl") if p["step"])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "--shutdown-timeout", "300"]
    status, text, delay = preempt_at_random([*torchrun, "tests/workers/slow_rank.py", "grpo_llm.py", *ONE_STEP_OFF,
                                             "--run-root", str(tmp_path / "slow")], tmp_path / "output.txt",
                                            "step 1/4", 1.5 * (step_s + 1.5),
                                            {**script_env(), "SLOW_RANK": "1", "SLOW_GENERATE_S": "1.5"})
    context = f"SIGTERM {delay:.2f} s after step 1's line\n{text[-4000:]}"
    slow = only_run_dir(tmp_path / "slow")
    stopped = json.loads((slow / "stopped.json").read_text())
    assert status != 0 and stopped["exit_status"] == 3 and 1 <= stopped["step"] <= 3, context
    trained = stopped["step"]

    def trainer_wait(run_dir) -> float:  # the steps trained before the stop, each waiting for a generation
        return sum(p["perf/trainer_wait_s"] for p in read_metrics(run_dir, "perf.jsonl") if 1 <= p["step"] <= trained)
    assert trainer_wait(slow) - trainer_wait(plain) > 0.75 * trained, context  # the sleeps acted

    check(run_resume_line(text, "tests/workers/slow_rank.py", {**script_env(), "SLOW_RANK": "0",
                                                                "SLOW_UPDATE_S": "0.5"}))
    assert (slow / "metrics.jsonl").read_bytes() == reference, context  # continued in the same run directory
    assert final_hash(slow) == reference_hash
    assert min(p["perf/train_s"] for p in read_metrics(slow, "perf.jsonl") if p["step"] > trained) > 0.5
