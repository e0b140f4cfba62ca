"""Tasks as a plug-in (tasks/): names, arguments and users' classes; local dataset files and their errors; the
settings a task needs; Countdown's scorer on hand-made answers; the held-out splits of Countdown and of the addition
task; pass@k."""

import json
import math
import re
from pathlib import Path

import pytest
from conftest import ROOT, check, only_run_dir, read_metrics, run_script
from transformers import AutoTokenizer

from common.llm.evaluation import pass_at_k
from tasks import TASKS, AdditionTask, CountdownTask, Example, TaskError, TinyCountdownTask, check_task_fits, make_task
from tasks.arithmetic import parse_expression
from tasks.countdown import score_expression, tinyzero_draws
from tasks.data import load_split

TINY_ADDER = ROOT / "assets" / "tiny-adder"


def readme_task_file(directory: Path) -> Path:
    """The complete user task of README.md's "Add a task" section, written to a file as a user would save it."""
    section = (ROOT / "README.md").read_text().split("## Add a task", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    path = directory / "small_sums.py"
    path.write_text(code)
    return path


# ---------------------------------------------------------------- names, arguments, users' classes


def test_unknown_names_and_arguments_are_refused_with_the_list():
    with pytest.raises(TaskError) as error:
        make_task("countdwn")
    assert "unknown task 'countdwn'" in str(error.value) and all(name in str(error.value) for name in TASKS)
    with pytest.raises(TaskError, match="takes no argument"):
        make_task("addition:extra")
    with pytest.raises(TaskError, match="needs an argument"):
        make_task("reasoning_gym")


def test_a_users_task_from_a_file_and_from_a_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = readme_task_file(tmp_path)
    task = make_task(f"{path}:SmallSums")
    example = task.test[0]
    total = sum(example.data["terms"])
    assert example.answer == str(total) and example.prompt == "+".join(map(str, example.data["terms"])) + "="
    assert task.reward(str(total), example) == 1.0 and task.correct(str(total), example)
    wrong = str(total + 1) if len(str(total + 1)) == len(str(total)) else str(total - 1)
    assert task.reward(wrong, example) == 0.1 and not task.correct(wrong, example)  # partial credit is not correct
    assert {e.prompt for e in task.test}.isdisjoint(e.prompt for e in task.train)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert type(make_task("small_sums:SmallSums")).__name__ == "SmallSums"


def test_a_users_task_that_cannot_load_says_why(tmp_path: Path):
    with pytest.raises(TaskError, match="does not exist"):
        make_task(f"{tmp_path}/missing.py:Task")
    (tmp_path / "broken.py").write_text("import no_such_module_anywhere\n")
    with pytest.raises(TaskError, match="does not import.*no_such_module_anywhere"):
        make_task(f"{tmp_path}/broken.py:Task")
    (tmp_path / "other.py").write_text("from tasks import Task\nclass Mine(Task):\n    pass\nclass Plain:\n"
                                       "    pass\n")
    with pytest.raises(TaskError, match=r"has no class 'Yours' \(the classes it defines: \['Mine', 'Plain'\]\)"):
        make_task(f"{tmp_path}/other.py:Yours")
    with pytest.raises(TaskError, match="not a subclass of tasks.Task, nor an environment class"):  # no reset
        make_task(f"{tmp_path}/other.py:Plain")
    with pytest.raises(TaskError, match="task module 'no_such_package.tasks' does not import"):
        make_task("no_such_package.tasks:Task")


# ---------------------------------------------------------------- local dataset files


def test_local_files_by_folder_and_by_split_pattern(tmp_path: Path):
    rows = {"train": [{"nums": [1, 2, 3], "target": 6}], "test": [{"nums": [4, 5, 6], "target": 15}]}
    for split, split_rows in rows.items():
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in split_rows))
        (tmp_path / f"cd_{split}.jsonl").write_text("\n" + "".join(json.dumps(r) + "\n" for r in split_rows))
    by_folder, by_pattern = make_task(f"countdown:{tmp_path}"), make_task(f"countdown:{tmp_path}/cd_{{split}}.jsonl")
    for task in (by_folder, by_pattern):
        assert [e.data for e in task.train] == [{"numbers": [1, 2, 3], "target": 6}]
        assert task.test[0].data["target"] == 15 and "[4, 5, 6]" in task.test[0].prompt
    parquet = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    (tmp_path / "hub" / "data").mkdir(parents=True)
    for split, split_rows in rows.items():
        parquet.write_table(pyarrow.Table.from_pylist(split_rows), tmp_path / "hub" / "data" /
                            f"{split}-00000-of-00001.parquet")
    assert make_task(f"countdown:{tmp_path / 'hub'}").test[0].data["numbers"] == [4, 5, 6]  # HF's layout


def test_bad_dataset_files_are_named_with_their_line(tmp_path: Path):
    (tmp_path / "train.jsonl").write_text('{"nums": [1, 2], "target": 3}\n{"nums": [1, 2], "target": \n')
    (tmp_path / "test.jsonl").write_text('{"numbers": [1, 2], "target": 3}\n')
    with pytest.raises(TaskError, match=re.escape(f"{tmp_path / 'train.jsonl'}:2: not a JSON object")):
        make_task(f"countdown:{tmp_path}")
    (tmp_path / "train.jsonl").write_text('{"nums": [1, 2], "target": 3}\n')
    with pytest.raises(TaskError, match=re.escape(f"{tmp_path / 'test.jsonl'}:1: no field 'nums'")):
        make_task(f"countdown:{tmp_path}")
    (tmp_path / "test.jsonl").write_text('{"nums": "1 2", "target": 3}\n')
    with pytest.raises(TaskError, match="`nums` must be a list of integers"):
        make_task(f"countdown:{tmp_path}")
    with pytest.raises(TaskError, match="has no validation file"):
        load_split(str(tmp_path), "validation")
    with pytest.raises(TaskError, match="no test file"):
        load_split(str(tmp_path / "missing_{split}.jsonl"), "test")


# ---------------------------------------------------------------- the settings a task needs


def test_settings_that_cannot_work_are_refused():
    tokenizer = AutoTokenizer.from_pretrained(TINY_ADDER)  # digits, + and = only
    task = TinyCountdownTask(num_train=64, num_test=8)
    texts = [task.format_prompt(tokenizer, e) for e in task.train[:16]]
    ids = tokenizer(texts).input_ids
    with pytest.raises(TaskError, match="needs completions of at least 8 tokens.*--max-completion-length 8"):
        check_task_fits(task, "countdown_tiny", tokenizer, "tiny-adder", texts, ids, max_completion_length=7)
    # `3,5,7->22:` keeps its digits only: more than half of the characters are lost
    with pytest.raises(TaskError, match="cannot express the prompts of task 'countdown_tiny'"):
        check_task_fits(task, "countdown_tiny", tokenizer, "tiny-adder", texts, ids, max_completion_length=8)
    adder = make_task("addition")
    texts = [adder.format_prompt(tokenizer, e) for e in adder.train[:16]]
    check_task_fits(adder, "addition", tokenizer, "tiny-adder", texts, tokenizer(texts).input_ids, 8)  # fits


def test_a_system_prompt_and_the_chat_template_switch():
    class Chat:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, messages: list[dict], tokenize: bool, add_generation_prompt: bool) -> str:
            return " | ".join(f"{m['role']}: {m['content']}" for m in messages)

    task, example = CountdownTask(num_train=4, num_test=2), Example("question?", "")
    assert task.format_prompt(Chat(), example) == f"system: {task.system_prompt} | user: question?"
    assert task.format_prompt(object(), example) == f"{task.system_prompt}\nquestion?"  # no template: plain text
    assert TinyCountdownTask(num_train=4, num_test=2).format_prompt(Chat(), example) == "question?"  # no template


# ---------------------------------------------------------------- Countdown


def test_expressions_are_parsed_exactly_and_never_evaluated():
    assert parse_expression("(1 + 2) / 3") == (1, [1, 2, 3])
    assert parse_expression("7/2*2") == (7, [7, 2, 2])  # exact rationals: no rounding of 3.5
    assert parse_expression("1/3+1/3+1/3")[0] == 1
    assert parse_expression("10-2-3")[0] == 5 and parse_expression("2+3*4")[0] == 14  # left to right, precedence
    for bad in ("", "1+", "(1+2", "1+2)", "-3+5", "2**3", "1.5*2", "3 4", "2/(1-1)", "__import__('os').getcwd()",
                "(" * 300 + "1" + ")" * 300):
        assert parse_expression(bad) is None, bad
    assert parse_expression("(" * 100 + "1" + ")" * 100) == (1, [1])  # deep but within the length limit


def test_countdown_rewards_follow_tinyzero():
    task = CountdownTask(num_train=4, num_test=2)
    example = Example("", "", {"numbers": [3, 5, 7], "target": 22})
    think = "<think>5 * 3 = 15, 15 + 7 = 22</think>"
    assert task.reward(f"{think}<answer> 5 * 3 + 7 </answer>", example) == 1.0
    assert task.correct(f"{think}<answer>5*3+7</answer>", example)
    assert task.reward("<answer>5 * 3</answer> no wait <answer>(7 + 5) * 3 - 14</answer>", example) == 0.1  # the last
    assert task.reward("<answer>7 * 3 + 1</answer>", example) == 0.1  # 1 is not given
    assert task.reward("<answer>7 + 7 + 5 + 3</answer>", example) == 0.1  # 7 used twice
    assert task.reward("<answer>5 * 3 + 7 = 22</answer>", example) == 0.1  # an equation sign is not an expression
    assert task.reward("<answer>import os</answer>", example) == 0.1  # in tags, malformed: TinyZero's format score
    assert task.reward("5 * 3 + 7", example) == 0.0 and not task.correct("5 * 3 + 7", example)  # no tags
    assert task.reward("", example) == 0.0
    assert task.eval_metrics("<answer>7 * 3 + 1</answer>", example) == {"well_formed": 1.0}
    assert task.eval_metrics("<answer>7 * </answer>", example) == {"well_formed": 0.0}
    assert score_expression("7 + 5", [3, 5, 7], 12) == (True, True)  # at most once: 3 may stay unused
    assert score_expression("7 + 5", [3, 5, 7], 12, require_all=True) == (True, False)  # TinyZero: all, once each


def test_tinyzero_draws_and_the_held_out_split():
    draws = tinyzero_draws(__import__("random").Random(0))
    sample = [next(draws) for _ in range(2000)]
    assert {len(n) for n, _ in sample} == {3, 4}
    assert min(min(n) for n, _ in sample) == 1 and max(max(n) for n, _ in sample) == 100
    assert min(t for _, t in sample) >= 1 and max(t for _, t in sample) > 950 and max(t for _, t in sample) <= 1000
    task, again = CountdownTask(num_train=2000, num_test=200), CountdownTask(num_train=2000, num_test=200)
    assert [e.prompt for e in task.train] == [e.prompt for e in again.train]  # no dependence on anything but code
    key = lambda e: (tuple(sorted(e.data["numbers"])), e.data["target"])  # noqa: E731
    assert not {key(e) for e in task.test} & {key(e) for e in task.train}


def test_tiny_countdown_is_solvable_and_held_out():
    task = TinyCountdownTask(num_train=5000, num_test=300)
    for example in task.train[:500] + task.test:
        numbers, target = example.data["numbers"], example.data["target"]
        assert task.reward(example.answer, example) == 1.0 and 1 <= target <= 100 and len(numbers) == 3
        assert example.prompt == f"{','.join(map(str, numbers))}->{target}:"
        assert len(example.answer) + 1 <= task.min_completion_length  # the answer and the EOS fit
    example = task.test[0]
    numbers = example.data["numbers"]
    assert task.reward(f"{numbers[0]}+{numbers[1]}", example) == 0.1  # not every number: parses, not correct
    assert task.reward("((", example) == 0.0 and task.reward("9+9+9+9", example) == 0.1  # four numbers of three
    key = lambda e: (tuple(sorted(e.data["numbers"])), e.data["target"])  # noqa: E731
    assert not {key(e) for e in task.test} & {key(e) for e in task.train}


# ---------------------------------------------------------------- the addition task


def test_addition_task_held_out_split():
    task = AdditionTask(num_train=2000, num_test=100)
    assert not {e.prompt for e in task.test} & {e.prompt for e in task.train}
    example = Example("12+30=", "42")
    assert task.reward("42", example) == 1.0 and task.reward(" 42 ", example) == 1.0
    assert task.reward("43", example) == 0.0 and task.reward("4", example) == 0.0


def test_addition_held_out_excludes_commutative_twins():
    """No test prompt `a+b=` has its twin `b+a=` (nor itself) in the training stream of the default task."""
    import random

    from tasks import addition_examples

    task = AdditionTask()
    train = {example.prompt for example in task.train}
    twins = {"{1}+{0}=".format(*example.prompt.removesuffix("=").split("+")) for example in task.test}
    assert len(task.train) == 100_000 and not twins & train and not {example.prompt for example in task.test} & train
    # negative control: the same random stream, filtered by exact prompt only, would have leaked twins
    raw = {example.prompt for example in addition_examples(len(task.train), task.digits, random.Random(1234 + 1))}
    assert len(twins & raw - {example.prompt for example in task.test}) > 10


# ---------------------------------------------------------------- pass@k


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 4, 2) == 1.0 and pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 1, 2) == 0.5 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(8, 2, 4) == pytest.approx(1 - math.comb(6, 4) / math.comb(8, 4))  # 1 - 15 / 70
    assert pass_at_k(32, 5, 1) == pytest.approx(5 / 32)  # pass@1 is the mean share correct


# ---------------------------------------------------------------- under torchrun


def test_grpo_trains_a_users_task_with_sampled_evaluation(tmp_path: Path):
    """README's task through `--task file.py:Class`, 2 ranks, with --eval-samples 4: the task's own held-out metric,
    mean@4 and pass@2/4 at every evaluation; reward with partial credit, accuracy without."""
    task_file = readme_task_file(tmp_path)
    result = run_script("grpo_llm.py", ["--task", f"{task_file}:SmallSums", "--prompts-per-step", "16",
                                        "--num-generations", "4", "--total-steps", "2", "--eval-every", "2",
                                        "--num-eval-prompts", "30", "--eval-samples", "4",
                                        "--run-root", str(tmp_path / "runs")], nproc=2, timeout=300)
    check(result)
    metrics = read_metrics(only_run_dir(tmp_path / "runs"))
    for evaluation in (metrics[0], metrics[2]):
        for key in ("eval/accuracy", "eval/right_length", "eval/mean@4", "eval/pass@2", "eval/pass@4"):
            assert 0 <= evaluation[key] <= 1, key
        assert evaluation["eval/mean@4"] <= evaluation["eval/pass@2"] <= evaluation["eval/pass@4"]
        assert evaluation["eval/mean@4"] < evaluation["eval/pass@4"] and "eval/pass@1" not in evaluation
    assert all(m["train/score"] > m["train/accuracy"] for m in metrics[1:])  # 0.1 for the right length counts


def test_a_correct_that_raises_stops_every_rank(tmp_path: Path):
    task_file = readme_task_file(tmp_path)
    task_file.write_text(task_file.read_text() + "\n\nclass Broken(SmallSums):\n    def correct(self, c, e):"
                                                 "\n        raise RuntimeError('scorer bug')\n")
    result = run_script("grpo_llm.py", ["--task", f"{task_file}:Broken", "--prompts-per-step", "16",
                                        "--num-generations", "4", "--total-steps", "2", "--num-eval-prompts", "8",
                                        "--run-root", str(tmp_path / "runs")], nproc=2, timeout=300)
    assert result.returncode != 0
    assert result.stderr.count("error: the task's correct function failed on prompt") == 2, result.stderr[-2000:]
    assert "RuntimeError('scorer bug')" in result.stderr


def test_eval_metrics_must_keep_their_names(capsys: pytest.CaptureFixture):
    """The held-out metrics of a task are reduced by name over ranks: a completion that gives other names, or a
    reserved name, stops every rank with a message instead of a KeyError on some ranks and a wait on the others."""
    from common.llm.evaluation import task_metric_sums

    class Tags(TinyCountdownTask):
        def eval_metrics(self, completion: str, example: Example) -> dict[str, float]:
            return {"tags": 1.0} if completion else {}

    task = Tags(num_train=8, num_test=4)
    examples = task.test[:2]
    assert task_metric_sums(TinyCountdownTask(8, 4), examples[0], examples, ["1+2", "(("]) == {"well_formed": 1.0}
    with pytest.raises(SystemExit) as stopped:
        task_metric_sums(task, examples[0], examples, ["", "1+2"])
    assert stopped.value.code == 2 and "must always give the same names" in capsys.readouterr().err

    class Reserved(TinyCountdownTask):
        def eval_metrics(self, completion: str, example: Example) -> dict[str, float]:
            return {"accuracy": 0.5}

    with pytest.raises(SystemExit):
        task_metric_sums(Reserved(num_train=8, num_test=4), examples[0], examples, ["", ""])
    assert "reserved name(s) ['accuracy']" in capsys.readouterr().err


def test_answers_in_tags_are_read_in_linear_time():
    from tasks.base import last_tagged

    assert last_tagged("<answer> 1 </answer> then <answer>2</answer>") == "2"
    assert last_tagged("<answer>1<answer>2</answer>") == "2" and last_tagged("<answer>1") is None
    assert last_tagged("</answer><answer>") is None and last_tagged("<answer></answer>") == ""
    hostile = "<answer>" * 50_000  # a regex over unclosed tags takes seconds here; two searches from the end do not
    task, example = CountdownTask(num_train=4, num_test=2), Example("", "", {"numbers": [1, 2], "target": 3})
    assert task.score(hostile, example) == (0.0, False) and task.score(hostile + "1+2</answer>", example) == (1.0, True)


def test_bad_rows_are_named(tmp_path: Path):
    (tmp_path / "train.json").write_text('[{"nums": [1, 2], "target": 3}, 7]')
    (tmp_path / "test.jsonl").write_bytes(b'{"nums": [1, 2], "target": 3}\n\xff\n')
    with pytest.raises(TaskError, match=re.escape(f"{tmp_path / 'train.json'} item 2: a row must be a JSON object")):
        make_task(f"countdown:{tmp_path}")
    (tmp_path / "train.json").write_text('[{"nums": [1, 2], "target": true}]')
    with pytest.raises(TaskError, match="`target` an integer"):  # a bool is an int to Python, not to the task
        make_task(f"countdown:{tmp_path}")
    (tmp_path / "train.json").write_text('[{"nums": [1, 2], "target": 3}]')
    with pytest.raises(TaskError, match=re.escape(f"{tmp_path / 'test.jsonl'}: not UTF-8 text")):
        make_task(f"countdown:{tmp_path}")
    (tmp_path / "train.jsonl").write_text('{"question": "Two?", "answer": 2}\n')
    (tmp_path / "test.jsonl").write_text('{"question": "Two?", "answer": "#### 2"}\n')
    with pytest.raises(TaskError, match=re.escape(f"{tmp_path / 'train.jsonl'}:1: field 'answer' must be text")):
        make_task(f"gsm8k:{tmp_path}")
