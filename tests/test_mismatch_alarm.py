"""The trainer-vs-engine alarm (common/llm/checks.py mismatch_alarm): silent within what the dtype explains, once
beyond it, with the causes the family and the run's history point to; stale samples are not judged."""

from pathlib import Path
from types import SimpleNamespace

from common.llm.checks import MISMATCH_LIMITS, mismatch_alarm
from common.llm.families import FULL_ATTENTION, SLIDING_ATTENTION, Family

DENSE = Family("qwen3", "Qwen3ForCausalLM", (FULL_ATTENTION,) * 2, None, False, 0, 0)
MOE_WINDOWED = Family("gpt_oss", "GptOssForCausalLM", (SLIDING_ATTENTION, FULL_ATTENTION), 4, True, 4, 2)


def a_run(family: Family, dtype: str = "float32", resumed: bool = False) -> SimpleNamespace:
    return SimpleNamespace(args=SimpleNamespace(dtype=dtype), family=family, mismatch_warned=False,
                           mismatch_clean_steps=0, resume_dir=Path("checkpoints") if resumed else None)


def judged(run: SimpleNamespace, step: int, mean: float, version: int | None = None) -> str | None:
    rollout = SimpleNamespace(version=step - 1 if version is None else version)
    return mismatch_alarm(run, step, rollout, {"mismatch/logprob_abs_diff_mean": mean,
                                               "mismatch/logprob_abs_diff_max": 3 * mean})


def test_silent_within_the_dtype_then_once_beyond_it_naming_the_sync():
    run = a_run(DENSE)
    assert judged(run, 1, 2e-7) is None and judged(run, 2, MISMATCH_LIMITS["float32"]) is None
    alarm = judged(run, 3, 2.6e-2)
    assert alarm is not None and "step 3" in alarm and "2.60e-02" in alarm
    assert "the sync did not reach (the 2 step(s) before agreed)" in alarm and "MoE" not in alarm
    assert judged(run, 4, 5e-2) is None  # once per run


def test_a_first_step_beyond_the_dtype_points_at_the_computation_and_the_family():
    alarm = judged(a_run(MOE_WINDOWED), 1, 9.5e-4 * 10)
    assert "computing the model differently" in alarm and "--routing-replay" in alarm and "--no-share-prompts" in alarm


def test_bfloat16_has_its_own_limit_and_stale_samples_are_not_judged():
    assert judged(a_run(DENSE, "bfloat16"), 1, 5e-3) is None
    assert judged(a_run(DENSE, "bfloat16"), 1, 5e-2) is not None
    assert judged(a_run(DENSE), 3, 0.5, version=1) is None  # sampled a step before: the update's gap, by design
