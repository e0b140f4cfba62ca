"""Tasks with verifiable rewards, chosen by `--task`:

- a registered name (`TASKS`), with an argument after a colon where the task takes one: a local copy of a hub
  dataset (`gsm8k:data/gsm8k`, a folder with train/test files, or `gsm8k:data/gsm8k_{split}.jsonl`), or a dataset of
  reasoning-gym (`reasoning_gym:basic_arithmetic`);
- a user's own `Task` subclass, from a file or an importable module: `--task my_task.py:MyTask`,
  `--task mypackage.tasks:MyTask` (constructed with no arguments). A new task needs no edit here;
- an environment written for another trainer, unchanged (docs/environments.md): a class in TRL's
  `environment_factory` contract or a dict of them (`--task my_env.py:MyEnv`), a `gymnasium.Env` text environment
  (`--task my_env.py:MyTextEnv`, `--task gym:MyText-v0`), an OpenEnv server (`--task openenv:http://host:port`) or an
  OpenEnv environment class served by a server this run starts (`--task openenv:my_env.py:MyEnvironment`).

The contract (`Example`, `Task`, `Environment`) is in tasks/base.py and is importable from here; docs/tasks.md shows
a complete single-turn and multi-turn task in one file each."""

from collections.abc import Callable

from tasks.adapters import AdapterTask, EnvOptions
from tasks.addition import AdditionTask, addition_examples, addition_operands
from tasks.base import Environment, Example, Task, TaskError
from tasks.calculator_tiny import TinyCalculatorTask
from tasks.countdown import CountdownTask, TinyCountdownTask
from tasks.environment_class import EnvironmentClassTask, is_environment_class
from tasks.gsm8k import GSM8KTask, gsm8k_flexible, gsm8k_strict
from tasks.gym_text import GymTextTask, gym_task, is_gymnasium_class
from tasks.loading import user_class
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
             "(`reasoning_gym:basic_arithmetic`); your own Task class: `path/to/file.py:Class` or "
             "`package.module:Class`; or an environment of another trainer's (docs/environments.md): a TRL "
             "environment class (or a dict of them) or a gymnasium.Env text environment as `file.py:Name`, "
             "`gym:MyText-v0`, `openenv:http://host:port`, or `openenv:file.py:MyEnvironment` (a server started "
             "per rank)")

__all__ = ["TASKS", "TASK_HELP", "AdapterTask", "AdditionTask", "CountdownTask", "DapoMathTask", "EnvOptions",
           "Environment", "EnvironmentClassTask", "Example", "GSM8KTask", "GymTextTask", "MathTask",
           "ReasoningGymTask", "Task", "TaskError", "TinyCalculatorTask", "TinyCountdownTask", "addition_examples",
           "addition_operands", "characters_kept", "check_task_fits", "gsm8k_flexible", "gsm8k_strict", "make_task",
           "user_class"]


def make_task(spec: str, options: EnvOptions | None = None) -> Task:
    """The task `spec` names (see the module docstring); `options` are the run's settings for an environment of
    another trainer's. Raises TaskError with what to change for an unknown name, a missing or wrong argument, or a
    file, module or class that cannot be loaded."""
    name, _, argument = spec.partition(":")
    if name in TASKS:
        kind = TAKES_ARGUMENT.get(name)
        if argument and not kind:
            raise TaskError(f"task {name!r} takes no argument, got {spec!r}")
        if not argument and kind == "required":
            raise TaskError(f"task {name!r} needs an argument: --task {name}:<name>")
        return TASKS[name](argument) if argument else TASKS[name]()
    if name in ("openenv", "gym") and not argument:
        raise TaskError(f"--task {name}: needs what follows the colon: openenv:http://host:port or "
                        "openenv:my_env.py:MyEnvironment; gym:MyText-v0 or gym:my_env.py:MyEnv")
    if name == "openenv":
        from tasks.openenv_client import OpenEnvTask  # openenv-core and websockets: imported when used

        return OpenEnvTask(argument, options)
    if name == "gym":
        return gym_task(argument, options)
    if not argument:
        raise TaskError(f"unknown task {spec!r}; the tasks are {', '.join(TASKS)}, or your own class as "
                        "path/to/file.py:Class or package.module:Class")
    value = user_class(name, argument)
    if isinstance(value, type) and issubclass(value, EnvironmentClassTask):
        return value(options)
    if isinstance(value, type) and issubclass(value, Task):
        return value()
    if is_openenv_class(value):
        from tasks.openenv_client import OpenEnvTask

        return OpenEnvTask(spec, options)
    if is_gymnasium_class(value):
        return GymTextTask(value, value.__name__, options)
    if is_environment_class(value):
        return EnvironmentClassTask(options, value, name=argument)
    raise TaskError(f"{spec!r} is not a subclass of tasks.Task, nor an environment class in TRL's contract (a class "
                    "with reset(self, **row), or a dict of such classes), a gymnasium.Env or an OpenEnv Environment "
                    "subclass")


def is_openenv_class(value: object) -> bool:
    """A subclass of OpenEnv's server-side Environment (openenv checked only when the class's module imported it)."""
    import sys

    interfaces = sys.modules.get("openenv.core.env_server.interfaces")
    return interfaces is not None and isinstance(value, type) and issubclass(value, interfaces.Environment)


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
