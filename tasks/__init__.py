"""Tasks with verifiable rewards, chosen by `--task`:

- a registered name (`TASKS`), with an argument after a colon where the task takes one: a local copy of a hub
  dataset (`gsm8k:data/gsm8k`, a folder with train/test files, or `gsm8k:data/gsm8k_{split}.jsonl`), or a dataset of
  reasoning-gym (`reasoning_gym:basic_arithmetic`);
- or a user's own `Task` subclass, from a file or an importable module: `--task my_task.py:MyTask`,
  `--task mypackage.tasks:MyTask` (constructed with no arguments). A new task needs no edit here.

The contract (`Example`, `Task`, `Environment`) is in tasks/base.py and is importable from here; docs/tasks.md shows
a complete single-turn and multi-turn task in one file each."""

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from tasks.addition import AdditionTask, addition_examples, addition_operands
from tasks.base import Environment, Example, Task, TaskError
from tasks.calculator_tiny import TinyCalculatorTask
from tasks.countdown import CountdownTask, TinyCountdownTask
from tasks.gsm8k import GSM8KTask, gsm8k_flexible, gsm8k_strict
from tasks.math_answers import DapoMathTask, MathTask
from tasks.reasoning_gym_tasks import ReasoningGymTask

# name -> the task's class; `name:argument` passes the argument (a local copy, a dataset name) to its constructor
TASKS: dict[str, Callable[..., Task]] = {
    "addition": AdditionTask,
    "countdown": CountdownTask,
    "countdown_tiny": TinyCountdownTask,
    "calculator_tiny": TinyCalculatorTask,
    "gsm8k": GSM8KTask,
    "math": MathTask,
    "dapo_math": DapoMathTask,
    "reasoning_gym": ReasoningGymTask,
}
TAKES_ARGUMENT = {"calculator_tiny": "optional", "countdown": "optional", "gsm8k": "optional", "math": "optional",
                  "dapo_math": "optional", "reasoning_gym": "required"}

TASK_HELP = (f"a registered task ({', '.join(TASKS)}); `name:argument` for a local copy of a hub task "
             "(`gsm8k:path/folder` or `gsm8k:path/gsm8k_{split}.jsonl`) or a reasoning-gym dataset "
             "(`reasoning_gym:basic_arithmetic`); or your own Task class: `path/to/file.py:Class` or "
             "`package.module:Class`")

__all__ = ["TASKS", "TASK_HELP", "AdditionTask", "CountdownTask", "DapoMathTask", "Environment", "Example",
           "GSM8KTask", "MathTask", "ReasoningGymTask", "Task", "TaskError", "TinyCalculatorTask", "TinyCountdownTask",
           "addition_examples", "addition_operands", "characters_kept", "check_task_fits", "gsm8k_flexible",
           "gsm8k_strict", "make_task"]


def make_task(spec: str) -> Task:
    """The task `spec` names (see the module docstring). Raises TaskError with what to change for an unknown name,
    a missing or wrong argument, or a file, module or class that cannot be loaded."""
    name, _, argument = spec.partition(":")
    if name in TASKS:
        kind = TAKES_ARGUMENT.get(name)
        if argument and not kind:
            raise TaskError(f"task {name!r} takes no argument, got {spec!r}")
        if not argument and kind == "required":
            raise TaskError(f"task {name!r} needs an argument: --task {name}:<name>")
        return TASKS[name](argument) if argument else TASKS[name]()
    if not argument:
        raise TaskError(f"unknown task {spec!r}; the tasks are {', '.join(TASKS)}, or your own class as "
                        "path/to/file.py:Class or package.module:Class")
    task_class = user_class(name, argument)
    if not (isinstance(task_class, type) and issubclass(task_class, Task)):
        raise TaskError(f"{spec!r} is not a subclass of tasks.Task")
    return task_class()


def user_class(location: str, class_name: str) -> type:
    """`class_name` from a Python file (`.py`) or an importable module."""
    if location.endswith(".py"):
        path = Path(location).expanduser().resolve()
        if not path.is_file():
            raise TaskError(f"task file {location!r} does not exist")
        module_name = f"user_task_{path.stem}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses and pickling look a class's module up here
        try:
            spec.loader.exec_module(module)
        except (Exception, SystemExit) as error:  # a script that exits on import
            raise TaskError(f"task file {location!r} does not import: {error!r}") from error
    else:
        try:
            module = importlib.import_module(location)
        except (Exception, SystemExit) as error:
            raise TaskError(f"task module {location!r} does not import: {error!r}; a file needs the .py suffix, "
                            f"and a registered task is one of {', '.join(TASKS)}") from error
    if not hasattr(module, class_name):
        found = sorted(n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, Task))
        raise TaskError(f"{location!r} has no class {class_name!r} (its Task classes: {found})")
    return getattr(module, class_name)


def check_task_fits(task: Task, spec: str, tokenizer: object, model: str, texts: list[str], ids: list[list[int]],
                    max_completion_length: int) -> None:
    """Refuse settings that cannot work: a completion budget below the task's minimum, or a tokenizer that cannot
    express the prompts (more than half of their characters lost, or read as the unknown token)."""
    if max_completion_length < task.min_completion_length:
        raise TaskError(f"task {spec!r} needs completions of at least {task.min_completion_length} tokens: "
                        f"--max-completion-length {max_completion_length} cannot hold an answer; pass "
                        f"--max-completion-length {task.min_completion_length} or more")
    kept = sum(characters_kept(tokenizer, text, row) for text, row in zip(texts, ids))
    total = sum(map(len, texts))
    if total and kept < total / 2:
        raise TaskError(f"the tokenizer of {model!r} cannot express the prompts of task {spec!r}: only "
                        f"{kept / total:.0%} of their characters survive encoding (the rest are unknown to it); "
                        "use a model whose tokenizer covers the task's text (--model-name-or-path)")


def characters_kept(tokenizer: object, text: str, ids: list[int] | None = None) -> int:
    """How many of `text`'s characters survive its encoding `ids` (default: its plain encoding): the length of what the
    ids other than the unknown token decode to, at most the text's. A tokenizer that lacks a script (a
    character-level model and an English word) drops or unknowns them."""
    if ids is None:
        ids = tokenizer(text, add_special_tokens=False).input_ids
    unknown = getattr(tokenizer, "unk_token_id", None)
    known = [i for i in ids if i != unknown]
    return min(len(text), len(tokenizer.decode(known, skip_special_tokens=False)))
