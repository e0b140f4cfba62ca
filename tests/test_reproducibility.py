"""The headline: same arguments, same machine, same world size -> the same bits; resume == uninterrupted."""

import json
from pathlib import Path

from conftest import SMALL_GRPO, check, only_run_dir, read_metrics, run_script

from common.tracking import strip_wall_clock


def comparable(run_dir: Path) -> list[dict[str, float]]:
    return [strip_wall_clock(m) for m in read_metrics(run_dir)]


def final_hash(run_dir: Path) -> str:
    return json.loads((run_dir / "final.json").read_text())["parameter_sha256"]


def test_same_seed_gives_identical_metrics_and_weights(grpo_reference_run: Path, tmp_path: Path):
    check(run_script("grpo_llm.py", [*SMALL_GRPO, "--seed", "1", "--run-root", str(tmp_path)], nproc=2))
    again = only_run_dir(tmp_path)
    assert comparable(again) == comparable(grpo_reference_run)
    assert final_hash(again) == final_hash(grpo_reference_run)
    # byte-identical files, not just equal floats
    strip = [json.dumps(m, sort_keys=True) for m in comparable(again)]
    assert strip == [json.dumps(m, sort_keys=True) for m in comparable(grpo_reference_run)]


def test_resume_equals_uninterrupted_run(grpo_reference_run: Path, tmp_path: Path):
    checkpoint = grpo_reference_run / "checkpoints" / "step_00000002"
    check(run_script("grpo_llm.py", [*SMALL_GRPO, "--seed", "1", "--resume", str(checkpoint),
                                     "--run-root", str(tmp_path)], nproc=2))
    resumed = only_run_dir(tmp_path)
    assert final_hash(resumed) == final_hash(grpo_reference_run)
    uninterrupted = [m for m in comparable(grpo_reference_run) if m["step"] > 2]
    assert comparable(resumed) == uninterrupted


def test_different_seed_gives_different_results(grpo_reference_run: Path, tmp_path: Path):
    check(run_script("grpo_llm.py", [*SMALL_GRPO, "--seed", "2", "--run-root", str(tmp_path)], nproc=2))
    other = only_run_dir(tmp_path)
    assert final_hash(other) != final_hash(grpo_reference_run)
    assert comparable(other)[1:] != comparable(grpo_reference_run)[1:]
