"""TinyCalculatorTask (tasks/calculator_tiny.py): its problems, its bracket call syntax, the environment's
replies and rewards, and the `:off` control."""

import pytest

from tasks import TaskError, make_task
from tasks.calculator_tiny import TinyCalculatorEnvironment, TinyCalculatorTask
from tasks.tools import ToolCall, calculator


@pytest.fixture(scope="module")
def task() -> TinyCalculatorTask:
    return make_task("calculator_tiny")


def environment(task: TinyCalculatorTask, index: int = 0) -> TinyCalculatorEnvironment:
    env = task.environment()
    env.reset(task.test[index])
    return env


def test_problems_are_two_digit_products_with_disjoint_splits(task: TinyCalculatorTask) -> None:
    assert len(task.train) == 20_000 and len(task.test) == 500
    pairs = [(e.data["a"], e.data["b"]) for e in task.test]
    assert len({(min(p), max(p)) for p in pairs}) == 500  # no test pair twice, in either order
    for example in task.train + task.test:
        a, b = example.data["a"], example.data["b"]
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert example.prompt == f"{a}*{b}:" and example.answer == str(a * b)
    held_out = {(min(p), max(p)) for p in pairs}
    assert not held_out & {(min(e.data["a"], e.data["b"]), max(e.data["a"], e.data["b"])) for e in task.train}
    assert TinyCalculatorTask().test == task.test  # fixed seeds
    assert task.tools == (calculator,) and task.chat_template is False and task.min_completion_length >= 19


def test_parse_call_and_format_reply(task: TinyCalculatorTask) -> None:
    env = environment(task)
    assert env.parse_call("[37*58]") == ToolCall("calculator", {"expression": "37*58"})
    for malformed in ("[37*58", "[", "[]", "[37]*58]", "[37*[58]]", "[37*58]1"):
        assert isinstance(env.parse_call(malformed), str), malformed
    for answer in ("2146", "", "21[46]", "*"):
        assert env.parse_call(answer) is None, answer
    assert env.format_reply("2146") == "=2146;"


def test_step_on_a_call_then_an_answer(task: TinyCalculatorTask) -> None:
    example = task.test[0]
    a, b = example.data["a"], example.data["b"]
    env = environment(task)
    assert env.step(f"[{a}*{b}]") == (f"={a * b};", 0.0, False)
    assert env.events["tool_calls"] == 1 and env.correct is None
    assert env.step(str(a * b)) == (None, 1.0, True) and env.correct is True
    env = environment(task)
    assert env.step(str(a * b + 1)) == (None, 0.0, True) and env.correct is False
    assert env.events["tool_calls"] == 0


def test_calls_without_a_number_are_answered_with_a_question_mark(task: TinyCalculatorTask) -> None:
    env = environment(task)
    assert env.step("[37*58") == ("=?;", 0.0, False) and env.events["failed_malformed"] == 1
    assert env.step("[37**58]") == ("=?;", 0.0, False)  # the calculator's error text is unreadable here
    assert env.events["tool_calls"] == 2


def test_off_counts_the_call_and_gives_no_result() -> None:
    off = make_task("calculator_tiny:off")
    assert isinstance(off, TinyCalculatorTask) and off.test == TinyCalculatorTask().test
    env = environment(off)
    assert env.step("[37*58]") == ("=?;", 0.0, False) and env.events["tool_calls"] == 1
    answer = off.test[0].answer
    assert env.step(answer) == (None, 1.0, True) and env.correct is True  # a right answer still counts
    with pytest.raises(TaskError, match="off"):
        make_task("calculator_tiny:on")


def test_reward(task: TinyCalculatorTask) -> None:
    example = task.test[0]
    assert task.reward(example.answer, example) == 1.0 and task.correct(example.answer, example)
    assert task.reward(example.answer + "0", example) == 0.0 and not task.correct("", example)
    assert task.reward(f"[{example.prompt[:-1]}]", example) == 0.0
