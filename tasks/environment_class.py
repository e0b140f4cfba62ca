"""Environment classes in TRL's contract (`GRPOTrainer(environment_factory=...)`), trained unchanged:
`--task my_env.py:MyEnv` (or a module path), or a dict of such classes routed by each row's `environment` field
(`--task my_env.py:ENVIRONMENTS`). The contract: `MyEnv()` takes no arguments; `reset(**row)` returns None or text,
which extends the prompt's user message; every other public method is a tool, with typed arguments and a Google-style
docstring with an `Args:` section (our tool format, tasks/tools.py); an optional `get_reward()` returns a number once
per finished episode. A reset without `**row` gets the row's fields its signature names (as an OpenEnv server
filters them), so `reset(self)` works on a dataset with a `prompt` field.

Each episode gets a fresh instance (TRL keeps one per rollout slot and resets it): an episode is then a function of
the class, its row and its seed alone, whichever rank, thread or step runs it, so two runs and a resumed run give the
same bits without saving any instance's state. A `reset` that takes a `seed` argument gets the episode's start seed
(tasks/base.py, Environment) unless the row has its own `seed`. Every call runs on the instance's own thread, bounded
by --env-time-limit-s (tasks/adapters.py).

The episode's reward is the task's reward of the answer turn (0.0 unless a subclass defines `reward`) plus
`reward_weight` x `get_reward()`; it is correct when that sum is 1 or more. A turn calls a tool in the Hermes format
(tasks/tools.py); a turn that calls none is the answer and ends the episode. A subclass of `EnvironmentClassTask`
changes what the class does not say: `environment_class`, `reward_weight`, `parse_call` and `format_reply` (a call
syntax the model can write) and `answer_tool` (the tool an answer turn is handed to, for a class that learns the
answer through a tool, as TRL's environments do)."""

import inspect
from dataclasses import replace

from tasks.adapters import (
    AdapterTask,
    CallTimeout,
    EnvironmentThread,
    EnvOptions,
    accepted_keywords,
    takes_argument,
)
from tasks.base import Example, TaskError
from tasks.tools import ToolCall, ToolEnvironment, ToolTimeout, hermes_call

NOT_TOOLS = ("reset", "get_reward")  # TRL's reserved names; the other public methods are tools


def tool_methods(instance: object) -> dict[str, object]:
    """An instance's tools, as TRL finds them: its public bound methods but `reset` and `get_reward`."""
    return {name: member for name, member in inspect.getmembers(instance, predicate=inspect.ismethod)
            if not name.startswith("_") and name not in NOT_TOOLS}


def is_environment_class(value: object) -> bool:
    """A class in TRL's contract, or a dict of them: each has a `reset`."""
    classes = value.values() if isinstance(value, dict) else [value]
    return bool(classes) and all(isinstance(c, type) and callable(getattr(c, "reset", None)) for c in classes)


class EnvironmentClassTask(AdapterTask):
    """Episodes of environment classes in TRL's contract (the module docstring). `--task file.py:MyEnv` builds one
    around the class; subclass it (setting `environment_class`) to change the settings below."""
    environment_class: type | dict[str, type] | None = None
    reward_weight: float = 1.0  # get_reward()'s weight in the episode's reward (TRL's is 1)
    answer_tool: str | None = None  # hand the answer turn's text to this tool (its one argument), then end

    def __init__(self, options: EnvOptions | None = None, classes: type | dict[str, type] | None = None,
                 name: str | None = None) -> None:
        super().__init__(options)
        classes = classes or self.environment_class
        if not is_environment_class(classes):
            raise TaskError(f"{name or type(self).__name__}: an environment class in TRL's contract has a reset "
                            f"method (reset(self, **row) -> str | None), or a dict maps names to such classes; got "
                            f"{classes!r:.80}")
        self.routed = isinstance(classes, dict)
        self.classes: dict[str | None, type] = dict(classes) if self.routed else {None: classes}
        self.name = name or type(self).__name__
        self.tool_schemas = {key: self.check_class(cls) for key, cls in self.classes.items()}
        if self.routed:
            if self.options.dataset is None:
                raise TaskError(f"{self.name} routes rows to {sorted(self.classes)} by their `environment` field: "
                                "name the rows with --env-dataset")
            for example in self.train + self.test:
                if example.data.get("environment") not in self.classes:
                    raise TaskError(f"a row of {self.options.dataset} has environment "
                                    f"{example.data.get('environment')!r}; the environments are {sorted(self.classes)}")

    def check_class(self, cls: type) -> list[dict]:
        """One instance, made as an episode makes it, must construct with no arguments, and its tools must be in
        TRL's format: their JSON schemas (what a chat template describes), or TaskError naming the class and method."""
        from transformers.utils import get_json_schema

        thread = EnvironmentThread(cls.__name__, self.options.time_limit_s)
        try:
            instance = thread.call(f"{cls.__name__}()", cls)
        except Exception as error:
            raise TaskError(f"{cls.__name__}() failed: {error!r} (TRL's contract makes an environment with no "
                            "arguments)") from error
        finally:
            thread.close()
        tools, schemas = tool_methods(instance), []
        if self.answer_tool is not None and self.answer_tool not in tools:
            raise TaskError(f"answer_tool {self.answer_tool!r} is not a tool of {cls.__name__} (its tools: "
                            f"{sorted(tools)})")
        for name, method in tools.items():
            try:
                schemas.append(get_json_schema(method))
            except Exception as error:
                raise TaskError(f"{cls.__name__}.{name} is a tool (a public method) but {error}: a tool has typed "
                                "arguments and a Google-style docstring with an Args: section") from error
        return schemas

    def class_of(self, example: Example) -> type:
        return self.classes[example.data.get("environment") if self.routed else None]

    def environment(self) -> "ClassEnvironment":
        return ClassEnvironment(self)

    def parse_call(self, text: str) -> ToolCall | str | None:
        """The turn's tool call (None: an answer; a string: why it is malformed). Hermes format by default."""
        return hermes_call(text)

    def format_reply(self, text: str) -> str:
        """The reply appended after a call: the tool's result as text (TRL's `str(result)`)."""
        return text

    def format_prompt(self, tokenizer: object, example: Example) -> str:
        """The task's prompt, with the example's environment's tools described by the chat template."""
        if self.chat_template and getattr(tokenizer, "chat_template", None):
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            schemas = self.tool_schemas[example.data.get("environment") if self.routed else None]
            return tokenizer.apply_chat_template([*system, {"role": "user", "content": example.prompt}],
                                                 tokenize=False, add_generation_prompt=True,
                                                 **({"tools": schemas} if schemas else {}))
        return super().format_prompt(tokenizer, example)

    def environment_record(self) -> dict[str, object]:
        return {"contract": "TRL environment class", "classes": {str(key): f"{cls.__module__}.{cls.__qualname__}"
                                                                for key, cls in self.classes.items()},
                "rows": self.rows, "reward_weight": self.reward_weight, "answer_tool": self.answer_tool}


class ClassEnvironment(ToolEnvironment):
    """One episode of one instance: reset on the row, tools called through the tool loop, `get_reward` at the end."""
    event_names = (*ToolEnvironment.event_names, "answers")

    def __init__(self, task: EnvironmentClassTask) -> None:
        super().__init__(task)
        self.time_limit_s = task.options.time_limit_s  # what a timeout's reply names
        self.thread: EnvironmentThread | None = None

    def reset(self, example: Example) -> str | None:
        cls = self.task.class_of(example)
        self.thread = EnvironmentThread(cls.__name__, self.task.options.time_limit_s)
        self.instance = self.thread.run(f"{cls.__name__}()", cls)
        row = {k: v for k, v in example.data.items() if not (self.task.routed and k == "environment")}
        if takes_argument(self.instance.reset, "seed") and "seed" not in row:
            row["seed"] = self.seed
        opening = self.thread.run(f"{cls.__name__}.reset", self.instance.reset,
                                  **accepted_keywords(self.instance.reset, row))
        if opening is not None and not isinstance(opening, str):
            raise TypeError(f"{cls.__name__}.reset returned {type(opening).__name__}: TRL's contract is text (which "
                            "extends the prompt) or None")
        self.tools = tool_methods(self.instance)
        self.example = replace(example, prompt=example.prompt + (opening or ""))
        return opening

    def step(self, text: str) -> tuple[str | None, float, bool]:
        call = self.task.parse_call(text)
        if call is None:  # the answer: the task scores it, get_reward follows in finish()
            if self.task.answer_tool is not None:
                self.events["answers"] += 1
                parameter = next(iter(inspect.signature(self.tools[self.task.answer_tool]).parameters))
                self.call(ToolCall(self.task.answer_tool, {parameter: text}))
            return None, self.task.finite_reward(self.task.reward(text, self.example), "the task's reward"), True
        self.events["tool_calls"] += 1
        reply = self.task.format_reply(self.call(call))
        if self.thread.abandoned is not None:  # the call hangs on: the instance cannot answer again, the episode ends
            return None, 0.0, True
        return reply, 0.0, False

    def run_with_time_limit(self, tool: object, arguments: dict) -> str:
        """The tool on the instance's thread; its result as text, as TRL passes it on."""
        try:
            result = self.thread.call(f"{type(self.instance).__name__}.{tool.__name__}", tool, **arguments)
        except CallTimeout as error:
            raise ToolTimeout(str(error)) from error
        return "" if result is None else str(result)

    def finish(self) -> float:
        """`reward_weight` x get_reward() (0.0 without one, or when a call of the episode was abandoned)."""
        try:
            get_reward = getattr(self.instance, "get_reward", None)
            if get_reward is None or self.thread.abandoned is not None:
                return 0.0
            what = f"{type(self.instance).__name__}.get_reward"
            try:
                value = self.thread.run(what, get_reward)
            except CallTimeout:
                self.events["failed_timeout"] += 1
                return 0.0
            return self.task.reward_weight * self.task.finite_reward(value, what)
        finally:
            self.thread.close()
