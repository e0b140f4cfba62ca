"""ReasoningGymTask: the split (sizes, disjoint, fixed), reasoning-gym's own scorer through <answer> tags (right,
wrong, malformed, partial credit, a scorer that raises), and the refusals (unknown, composite, unseeded datasets)."""

import subprocess
import sys

import pytest

from tasks import TaskError, make_task
from tasks.reasoning_gym_tasks import TEST_SEED, TEST_SIZE, TRAIN_SEED, TRAIN_SIZE, ReasoningGymTask

SIZES = {"basic_arithmetic": (200, 50), "countdown": (30, 10)}  # countdown makes about 50 problems a second


@pytest.fixture(scope="module", params=sorted(SIZES))
def task(request):
    num_train, num_test = SIZES[request.param]
    return ReasoningGymTask(request.param, num_train=num_train, num_test=num_test)


@pytest.fixture(scope="module")
def arithmetic():
    return ReasoningGymTask("basic_arithmetic", num_train=200, num_test=50)


@pytest.fixture(scope="module")
def countdown():
    return ReasoningGymTask("countdown", num_train=30, num_test=10)


def tagged(answer: str) -> str:
    return f"Let me think step by step. First ... so the result follows.\n<answer>{answer}</answer>"


def test_seed_ranges_never_meet():
    # problem i comes from Random(seed + i): the train seeds end before the test seeds begin
    assert TRAIN_SEED + TRAIN_SIZE <= TEST_SEED and TEST_SIZE > 0


def test_sizes_disjoint_and_fields(task):
    num_train, num_test = SIZES[task.dataset]
    assert len(task.test) == num_test
    assert 0 < len(task.train) <= num_train
    test_questions = {example.prompt for example in task.test}
    assert len(test_questions) == len(task.test)
    assert not test_questions & {example.prompt for example in task.train}
    for example in task.train + task.test:
        assert example.prompt == example.data["question"]
        assert example.answer == str(example.data["answer"])
        assert "metadata" in example.data
    assert "<answer>" in task.system_prompt and task.min_completion_length >= 32


def test_deterministic_and_prefix(task):
    num_train, num_test = SIZES[task.dataset]
    again = ReasoningGymTask(task.dataset, num_train=num_train, num_test=num_test)
    assert again.train == task.train and again.test == task.test
    assert ReasoningGymTask(task.dataset, num_train=5, num_test=3).test == task.test[:3]


def test_train_drops_what_test_holds():
    import reasoning_gym

    task = ReasoningGymTask("coin_flip", num_train=100, num_test=50)  # a small problem space: many repeats
    held_out = [entry["question"] for entry in reasoning_gym.create_dataset("coin_flip", size=50, seed=TEST_SEED)]
    drawn = [entry["question"] for entry in reasoning_gym.create_dataset("coin_flip", size=100, seed=TRAIN_SEED)]
    assert [example.prompt for example in task.test] == list(dict.fromkeys(held_out))  # repeats kept once
    assert [example.prompt for example in task.train] == [q for q in drawn if q not in held_out]
    assert len(task.train) < 100 and len(task.test) < 50


def test_arithmetic_scores(arithmetic):
    example = arithmetic.test[0]
    assert arithmetic.reward(tagged(example.answer), example) == 1.0 and arithmetic.correct(tagged(example.answer),
                                                                                           example)
    wrong = str(int(example.answer) + 1)
    assert arithmetic.reward(tagged(wrong), example) == 0.0 and not arithmetic.correct(tagged(wrong), example)
    assert arithmetic.reward(f"The answer is {example.answer}.", example) == 0.0  # no tags: nothing extracted
    assert arithmetic.reward(f"<answer>{example.answer}", example) == 0.0  # unclosed tag
    # the last tagged answer counts
    assert arithmetic.reward(f"<answer>{wrong}</answer> no, <answer>{example.answer}</answer>", example) == 1.0
    # reasoning-gym's default scorer: partial credit when the reference is inside a longer answer
    padded = f"x = {example.answer}"
    assert arithmetic.reward(tagged(padded), example) == pytest.approx(len(example.answer) / len(padded))
    assert not arithmetic.correct(tagged(padded), example)


def test_countdown_partial_credit(countdown):
    example = countdown.test[0]
    numbers, target = example.data["metadata"]["numbers"], example.data["metadata"]["target"]
    assert countdown.reward(tagged(example.answer), example) == 1.0 and countdown.correct(tagged(example.answer),
                                                                                         example)
    wrong = " + ".join(map(str, numbers)) if sum(numbers) != target else " * ".join(map(str, numbers))
    assert countdown.reward(tagged(wrong), example) == 0.05  # well formed, all numbers, another value
    assert not countdown.correct(tagged(wrong), example)
    assert countdown.reward(tagged(f"{numbers[0]} + 1"), example) == 0.05  # not the given numbers
    assert countdown.reward("I cannot do it.", example) == 0.01  # no tags
    assert countdown.eval_metrics(tagged(wrong), example) == {"reward": 0.05, "answer_tags": 1.0}
    assert countdown.eval_metrics("", example) == {"reward": 0.01, "answer_tags": 0.0}


def test_prompt_has_reasoning_gym_system_prompt(arithmetic):
    from reasoning_gym.utils import SYSTEM_PROMPTS

    example = arithmetic.test[0]
    assert arithmetic.system_prompt == SYSTEM_PROMPTS["default"]
    assert arithmetic.format_prompt(object(), example) == f"{SYSTEM_PROMPTS['default']}\n{example.prompt}"


def test_a_scorer_that_raises_is_refused_up_front():
    """reasoning-gym 0.1.25's prime_factorization raises on a non-numeric factor: training would stop at the first
    such completion, so the task refuses the dataset (the raise itself is shown on the dataset directly)."""
    import reasoning_gym

    dataset = reasoning_gym.create_dataset("prime_factorization", size=1, seed=1)
    with pytest.raises(ValueError):
        dataset.score_answer("banana", dataset[0])
    with pytest.raises(TaskError, match="cannot train: .*raises ValueError"):
        ReasoningGymTask("prime_factorization", num_train=5, num_test=5)


def test_unknown_and_refused_datasets(monkeypatch):
    with pytest.raises(TaskError, match=r"basic_arithmetc.*close: basic_arithmetic.*reasoning_gym\.factory\.DATASETS"):
        make_task("reasoning_gym:basic_arithmetc")
    with pytest.raises(TaskError, match=r"some: basic_arithmetic.*in all"):
        ReasoningGymTask("no_such_dataset")
    with pytest.raises(TaskError, match="needs a configuration"):
        ReasoningGymTask("composite")
    with pytest.raises(TaskError, match="other problems in every process"):
        ReasoningGymTask("codeio")
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(TaskError, match="PYTHONHASHSEED=0"):
        ReasoningGymTask("isomorphic_strings", num_train=5, num_test=5)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert len(ReasoningGymTask("isomorphic_strings", num_train=5, num_test=5).test) == 5


def test_make_task_and_lazy_import():
    task = make_task("reasoning_gym:leg_counting")
    assert len(task.test) == TEST_SIZE and 0 < len(task.train) <= TRAIN_SIZE
    code = "import sys, tasks; assert 'reasoning_gym' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
