"""The math scorers (boxed extraction, math-verify strict and lenient, DAPO's `Answer:` check) on hand-made answers,
math-verify's known traps, and MathTask / DapoMathTask built from small local files in the hub formats (and from a
stand-in for the hub); GSM8K's `#### N` extraction (strict and flexible) and its task from a local copy."""

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tasks import Example, GSM8KTask, gsm8k_flexible, gsm8k_strict, make_task
from tasks.base import TaskError
from tasks.math_answers import (
    AIME_HUB_ID,
    BOXED_INSTRUCTION,
    DAPO_HUB_ID,
    DAPO_PREFIX,
    DAPO_SUFFIX,
    MATH500_HUB_ID,
    MATH_HUB_ID,
    MATH_SUBJECTS,
    DapoMathTask,
    MathTask,
    _gold_candidates,
    boxed_answer,
    dapo_answer,
    dapo_correct,
    dapo_prompt,
    lenient_correct,
    same_answer,
    strict_correct,
)

ROOT = Path(__file__).resolve().parent.parent
HALF = r"\frac{1}{2}"
UNPARSABLE = r"\frac{3}{"  # a malformed gold: math-verify keeps only its raw string


@pytest.fixture(autouse=True)
def fresh_gold_cache():
    _gold_candidates.cache_clear()  # tests that break math-verify on purpose must not leave cached golds behind
    yield
    _gold_candidates.cache_clear()


# --- boxed_answer ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    (r"so the answer is \boxed{42}.", "42"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces
    (r"\boxed{\frac{\sqrt{3}}{2}} done", r"\frac{\sqrt{3}}{2}"),
    (r"first \boxed{3}, then on reflection \boxed{5}", "5"),  # the last box counts
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces neither open nor close
    (r"\fbox{7}", "7"),
    (r"$\boxed 9$.", "9"),  # `\boxed` and one token
    (r"hence \boxed 12.", "12"),
    (r"\boxed {4}", "4"),
    (r"\boxed{}", ""),
    (r"\boxed{\frac{1}{2}", None),  # never closes
    (r"\boxed{2} and then \boxed{3", None),  # the last box is cut off: no answer, not the earlier one
    ("no box at all: 42", None),
    ("", None),
])
def test_boxed_answer(text, expected):
    assert boxed_answer(text) == expected


# --- strict_correct / lenient_correct ------------------------------------------------------------------------------

@pytest.mark.parametrize("box", [HALF, "0.5", "1/2", r"\dfrac{1}{2}", r"\tfrac12", r"\frac{2}{4}"])
def test_equivalent_forms_of_one_half_are_correct(box):
    completion = f"Reasoning... so the answer is $\\boxed{{{box}}}$."
    assert strict_correct(completion, HALF)
    assert strict_correct(completion, "0.5")
    assert lenient_correct(completion, HALF)


@pytest.mark.parametrize("completion, gold, strict, lenient", [
    (r"The answer is \boxed{5}.", "5", True, True),
    (r"The answer is \boxed{6}.", "5", False, False),
    (r"\boxed{5 \text{ cm}}", "5", True, True),  # units around the number
    (r"It costs \boxed{\$18.90}.", "18.90", True, True),
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)", True, True),
    (r"\boxed{(3, \frac{\pi}{3})}", r"\left( 3, \frac{\pi}{2} \right)", False, False),
    (r"I got \boxed{3}. Wait, recheck: \boxed{5}", "5", True, False),  # several boxes: the last counts (strict);
    (r"I got \boxed{5}. Wait, recheck: \boxed{3}", "5", False, False),  # math-verify reads them as the set {3, 5}
    (r"I got \boxed{3}. Wait, recheck: \boxed{5}", "3, 5", False, True),
    ("The answer is 1/2.", HALF, False, True),  # no box: strict refuses, math-verify finds the expression
    ("So $x = 0.5$", HALF, False, True),
    (r"The answer is \boxed{\frac{1}{2}", HALF, False, True),  # malformed: the box never closes (math-verify
    (r"The answer is \boxed{\frac{1}{3}", HALF, False, False),  # still reads what is there)
    (r"\boxed{}", "5", False, False),
    ("", "5", False, False),  # an empty completion
    ("   \n", "5", False, False),
])
def test_strict_and_lenient(completion, gold, strict, lenient):
    assert strict_correct(completion, gold) is strict
    assert lenient_correct(completion, gold) is lenient


def test_trap_unparsable_gold_is_never_correct():
    from math_verify import parse, verify

    gold_parsed = parse(f"${UNPARSABLE}$")
    assert gold_parsed and all(isinstance(candidate, str) for candidate in gold_parsed)  # no sympy object
    # the trap: raw math-verify calls a completion that repeats the broken gold correct (string vs string)
    assert verify(gold_parsed, parse(f"${UNPARSABLE}$"))
    for completion in [f"$\\boxed{{{UNPARSABLE}}}$", f"${UNPARSABLE}$", "\\boxed{3}", "3", ""]:
        assert not strict_correct(completion, UNPARSABLE)
        assert not lenient_correct(completion, UNPARSABLE)
    assert not strict_correct(r"\boxed{5}", "") and not lenient_correct("5", "")  # an empty gold too


def test_trap_several_candidates_only_sympy_pairs_count():
    from math_verify import parse, verify
    from sympy import Integer, Rational

    candidates = parse(f"${HALF}$")
    assert candidates[0] == Rational(1, 2) and isinstance(candidates[-1], str)  # a sympy object and a string
    # verify is True when ANY pair of gold x pred matches: here the strings match although 2 != 3
    assert verify([Integer(2), "2"], [Integer(3), "2"])
    assert not same_answer([Integer(2), "2"], [Integer(3), "2"])  # we compare sympy candidates only
    assert same_answer([Integer(2), "2"], [Integer(3), Integer(2)])  # any sympy pair still counts
    assert not same_answer(["2"], ["2"])  # a string-only gold (unparsable) is never matched


def test_scorers_work_outside_the_main_thread():
    from math_verify import parse

    results = {}

    def score():
        try:
            parse("$1$")  # math-verify's default signal timeout: refused off the main thread
        except ValueError as error:
            results["raw"] = str(error)
        results["strict"] = strict_correct(r"\boxed{0.5}", HALF)
        results["lenient"] = lenient_correct("the answer is 1/2", HALF)
        results["wrong"] = strict_correct(r"\boxed{3}", HALF)

    worker = threading.Thread(target=score)
    worker.start()
    worker.join(timeout=60)
    assert "thread" in results["raw"]  # the negative control: the trap is real
    assert results["strict"] is True and results["lenient"] is True and results["wrong"] is False


@pytest.mark.parametrize("broken", ["parse", "verify"])
@pytest.mark.parametrize("error", [RuntimeError("parser exploded"), RecursionError(), "timeout"])
def test_math_verify_errors_mean_not_correct(monkeypatch, broken, error):
    import math_verify
    from math_verify.errors import TimeoutException

    exception = TimeoutException("slow") if error == "timeout" else error

    def fail(*args, **kwargs):
        raise exception

    assert strict_correct(r"\boxed{41}", "41")  # works before the breakage
    _gold_candidates.cache_clear()
    monkeypatch.setattr(math_verify, broken, fail)
    assert strict_correct(r"\boxed{41}", "41") is False
    assert lenient_correct("41", "41") is False


def test_importing_the_module_does_not_import_math_verify():
    code = ("import sys, tasks.math_answers; "
            "print(sorted(m for m in ('math_verify', 'sympy', 'latex2sympy2_extended') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --- DAPO's Answer: check ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, gold, correct", [
    ("Some work.\nAnswer: 34", "34", True),
    ("Some work.\n**Answer:** $34$.", "34", True),
    ("answer:\n34", "34", True),  # the answer on the next line, as DAPO's regex allows
    ("Answer: \\boxed{73}", "073", True),  # leading zeros of AIME answers
    ("Answer: 1,000", "1000", True),
    ("Answer: 12\nAnswer: 34", "34", True),  # the last Answer: counts
    ("Answer: 34\nAnswer: 12", "34", False),
    ("Answer: 35", "34", False),
    ("Answer: 34 degrees", "34", False),  # strict: no unit stripping
    ("The answer is \\boxed{34}", "34", False),  # no Answer: line
    ("x" * 500 + "\nAnswer: 34", "34", True),
    ("Answer: 34\n" + "checking " * 40, "34", False),  # outside DAPO's last-300-characters window
    ("Answer:", "34", False),
    ("", "34", False),
])
def test_dapo_correct(completion, gold, correct):
    assert dapo_correct(completion, gold) is correct


def test_dapo_answer_extraction():
    assert dapo_answer("so\nAnswer: $\\text{ 204 }$.") == "204"
    assert dapo_answer("no answer line") is None


# --- MathTask from local files -------------------------------------------------------------------------------------

def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


MATH_TRAIN_ROWS = [  # EleutherAI/hendrycks_math's format
    {"problem": "What is $1+1$?", "level": "Level 1", "type": "Algebra", "solution": "Clearly $1+1=\\boxed{2}$."},
    {"problem": "Halve one.", "level": "Level ?", "type": "Prealgebra",
     "solution": "First \\boxed{1} is wrong; it is $\\boxed{\\frac{1}{2}}$."},
]
MATH500_ROWS = [  # HuggingFaceH4/MATH-500's format
    {"problem": "Convert $(0,3)$ to polar.", "solution": "... $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$",
     "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "subject": "Precalculus", "level": 2,
     "unique_id": "test/precalculus/807.json"},
]


def check_math_examples(task: MathTask) -> None:
    assert [e.answer for e in task.train] == ["2", HALF]
    assert task.train[0].prompt == f"What is $1+1$?\n{BOXED_INSTRUCTION}"
    assert task.train[0].data == {"level": 1, "subject": "Algebra"}
    assert task.train[1].data == {"level": None, "subject": "Prealgebra"}
    (example,) = task.test
    assert example.answer == r"\left( 3, \frac{\pi}{2} \right)"
    assert example.data == {"level": 2, "subject": "Precalculus"}


def test_math_task_from_a_folder(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", MATH_TRAIN_ROWS)
    write_jsonl(tmp_path / "test.jsonl", MATH500_ROWS)
    task = MathTask(str(tmp_path))
    check_math_examples(task)
    half = task.train[1]
    assert task.reward(r"... $\boxed{0.5}$", half) == 1.0 and task.correct(r"\boxed{1/2}", half)
    assert task.reward(r"\boxed{1}", half) == 0.0 and not task.correct("the answer is 1/2", half)
    assert task.eval_metrics("the answer is 1/2", half) == {"accuracy_lenient": 1.0}
    assert task.eval_metrics("the answer is 3", half) == {"accuracy_lenient": 0.0}
    assert task.reward(r"\boxed{(3, \frac{\pi}{2})}", task.test[0]) == 1.0


def test_math_task_from_a_split_pattern_takes_either_format_in_either_split(tmp_path):
    write_jsonl(tmp_path / "m_train.jsonl", MATH500_ROWS)  # swapped: MATH-500 rows for training
    write_jsonl(tmp_path / "m_test.jsonl", MATH_TRAIN_ROWS)
    task = MathTask(str(tmp_path / "m_{split}.jsonl"))
    assert [e.answer for e in task.train] == [r"\left( 3, \frac{\pi}{2} \right)"]
    assert [e.answer for e in task.test] == ["2", HALF]


def test_math_task_malformed_line_names_file_and_line(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [MATH_TRAIN_ROWS[0], '{"problem": "unterminated'])
    write_jsonl(tmp_path / "test.jsonl", MATH500_ROWS)
    with pytest.raises(TaskError, match=r"train\.jsonl:2: not a JSON object"):
        MathTask(str(tmp_path))


@pytest.mark.parametrize("row, message", [
    ({"level": "Level 1", "solution": "\\boxed{2}"}, r"train\.jsonl:2: no field 'problem'"),
    ({"problem": "p", "solution": "no box here"}, r"train\.jsonl:2: no answer"),
    ({"problem": "p", "solution": "\\boxed{2"}, r"train\.jsonl:2: no answer"),
    ({"problem": "p", "answer": " "}, r"train\.jsonl:2: no answer"),
])
def test_math_task_row_without_an_answer_is_named(tmp_path, row, message):
    write_jsonl(tmp_path / "train.jsonl", [MATH_TRAIN_ROWS[0], row])
    write_jsonl(tmp_path / "test.jsonl", MATH500_ROWS)
    with pytest.raises(TaskError, match=message):
        MathTask(str(tmp_path))


def fake_hub(monkeypatch, tables: dict) -> list:
    """`datasets.load_dataset` answering from small in-memory tables, keyed by (id, config, split); the calls."""
    datasets = pytest.importorskip("datasets")
    calls = []

    def load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(tables[path, name, split])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_math_task_from_the_hub_concatenates_the_subjects_in_order(monkeypatch):
    tables = {(MATH_HUB_ID, subject, "train"): [{"problem": f"{subject} problem", "level": "Level 3",
                                                  "type": subject, "solution": f"\\boxed{{{i}}}"}]
              for i, subject in enumerate(MATH_SUBJECTS)}
    tables[MATH500_HUB_ID, None, "test"] = MATH500_ROWS
    calls = fake_hub(monkeypatch, tables)
    task = MathTask()
    assert calls == [(MATH_HUB_ID, subject, "train") for subject in MATH_SUBJECTS] + [(MATH500_HUB_ID, None, "test")]
    assert [e.answer for e in task.train] == [str(i) for i in range(7)]
    assert task.train[0].data["subject"] == "algebra" and len(task.test) == 1


# --- DapoMathTask from local files ---------------------------------------------------------------------------------

def dapo_row(problem: str, answer: str, index: str) -> dict:
    """A row of BytedTsinghua-SIA/DAPO-Math-17k."""
    return {"data_source": "math_dapo", "prompt": [{"content": dapo_prompt(problem), "role": "user"}],
            "ability": "MATH", "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": index}}


DAPO_ROWS = [dapo_row("Find $6 \\cdot 7$.", "42", "a1"), dapo_row("Find $2^5$.", "32", "b2"),
             dapo_row("Find $6 \\cdot 7$.", "42", "a1")]  # the hub copy repeats its problems
AIME_ROWS = [  # HuggingFaceH4/aime_2024's format
    {"id": 60, "problem": "Every morning Aya goes for a walk...", "solution": "...", "answer": "204",
     "url": "https://artofproblemsolving.com/wiki/index.php/2024_AIME_I_Problems/Problem_1", "year": "2024"},
    {"id": 61, "problem": "Find the number of ...", "solution": "...", "answer": "073", "url": "", "year": "2024"},
]


def test_dapo_task_from_a_folder(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", DAPO_ROWS)
    write_jsonl(tmp_path / "test.jsonl", AIME_ROWS)
    task = DapoMathTask(str(tmp_path))
    assert [e.answer for e in task.train] == ["42", "32"]  # the repeated problem once
    assert task.train[0].prompt == DAPO_ROWS[0]["prompt"][0]["content"]
    assert task.train[0].data == {"source": "math_dapo", "index": "a1"}
    aime = task.test[0]
    assert aime.prompt.startswith(DAPO_PREFIX + "\n\nEvery morning Aya") and aime.prompt.endswith(DAPO_SUFFIX)
    assert aime.prompt.replace("Every morning Aya goes for a walk...", "Find $2^5$.") == task.train[1].prompt
    assert task.reward("...\nAnswer: 204", aime) == 1.0 and task.correct("Answer: $204$", aime)
    assert task.reward("...\nAnswer: 205", aime) == 0.0 and task.reward(r"\boxed{204}", aime) == 0.0
    assert task.eval_metrics(r"so \boxed{204}", aime) == {"accuracy_lenient": 1.0}
    assert task.eval_metrics("Answer: 205", aime) == {"accuracy_lenient": 0.0}
    assert task.correct("Answer: 73", task.test[1]) and task.eval_metrics("Answer: 73", task.test[1]) == {
        "accuracy_lenient": 1.0}


def test_dapo_task_from_a_split_pattern(tmp_path):
    write_jsonl(tmp_path / "d_train.jsonl", DAPO_ROWS[:2])
    write_jsonl(tmp_path / "d_test.jsonl", [DAPO_ROWS[0], AIME_ROWS[0]])  # either format in either split
    task = DapoMathTask(str(tmp_path / "d_{split}.jsonl"))
    assert [e.answer for e in task.train] == ["42", "32"] and [e.answer for e in task.test] == ["42", "204"]


def test_dapo_task_malformed_line_names_file_and_line(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", DAPO_ROWS)
    write_jsonl(tmp_path / "test.jsonl", [AIME_ROWS[0], AIME_ROWS[1], "[1, 2"])
    with pytest.raises(TaskError, match=r"test\.jsonl:3: not a JSON object"):
        DapoMathTask(str(tmp_path))


@pytest.mark.parametrize("row, message", [
    ({"prompt": [{"content": "p", "role": "user"}]}, r"train\.jsonl:2: no field 'reward_model'"),
    ({"prompt": [{"content": "p", "role": "user"}], "reward_model": {"style": "rule"}}, r"train\.jsonl:2: no answer"),
    ({"prompt": [{"content": "p", "role": "system"}], "reward_model": {"ground_truth": "1"}},
     r"train\.jsonl:2: 'prompt' must be"),
    ({"problem": "p"}, r"train\.jsonl:2: no field 'answer'"),
    ({"question": "p", "answer": "1"}, r"train\.jsonl:2: no field 'problem'"),
])
def test_dapo_task_row_missing_fields_is_named(tmp_path, row, message):
    write_jsonl(tmp_path / "train.jsonl", [DAPO_ROWS[0], row])
    write_jsonl(tmp_path / "test.jsonl", AIME_ROWS)
    with pytest.raises(TaskError, match=message):
        DapoMathTask(str(tmp_path))


def test_dapo_task_from_the_hub_drops_the_copies(monkeypatch):
    tables = {(DAPO_HUB_ID, None, "train"): DAPO_ROWS * 3, (AIME_HUB_ID, None, "train"): AIME_ROWS}
    calls = fake_hub(monkeypatch, tables)
    task = DapoMathTask()
    assert calls == [(DAPO_HUB_ID, None, "train"), (AIME_HUB_ID, None, "train")]  # AIME's one split is `train`
    assert [e.answer for e in task.train] == ["42", "32"] and [e.answer for e in task.test] == ["204", "073"]
    assert task.train[1].data["index"] == "b2" and task.test[0].data == {"id": 60}


# --- GSM8K ---------------------------------------------------------------------------------------------------------

def test_gsm8k_extraction_strict_and_flexible():
    text = "She pays 3 * $1,200 = $3,600.\n#### 3,600"
    assert gsm8k_strict(text) == "3600" and gsm8k_flexible(text) == "3600"
    assert gsm8k_strict("so the answer is 72") is None and gsm8k_flexible("so the answer is 72.") == "72"
    task = GSM8KTask.__new__(GSM8KTask)  # no download: only the reward functions
    example = Example("q", "72")
    assert task.reward("... #### 72", example) == 1.0 and task.reward("the answer is 72", example) == 0.0
    assert task.flexible_reward("the answer is 72", example) == 1.0


def test_gsm8k_task_from_a_local_copy(tmp_path: Path):
    import json

    rows = [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
            {"question": "A box holds 1,200 pens. How many in 2 boxes?", "answer": "2 * 1200 = 2400\n#### 2,400"}]
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    task = make_task(f"gsm8k:{tmp_path}")
    assert [e.answer for e in task.test] == ["7", "2400"]
    assert task.train[0].prompt.startswith("Tom has 3 apples") and task.train[0].prompt.endswith('after "####".')
    assert task.reward("so 2,400 pens\n#### 2,400", task.test[1]) == 1.0
    boxed = r"so it is \boxed{2400}"  # lenient (math-verify) finds it; strict (`#### N`) does not
    assert task.eval_metrics(boxed, task.test[1]) == {"accuracy_flexible": 1.0, "accuracy_lenient": 1.0}
    assert not task.correct(boxed, task.test[1]) and task.eval_metrics("2400 or 2500", task.test[1]) == {
        "accuracy_flexible": 0.0, "accuracy_lenient": 0.0}
    assert task.eval_metrics("so it is \\boxed{2400}", task.test[1]) == {"accuracy_flexible": 1.0,
                                                                          "accuracy_lenient": 1.0}
    assert not task.correct("so it is \\boxed{2400}", task.test[1])  # strict: only `#### N` counts
