"""Tools a multi-turn task may declare (`Task.tools`), and the environment that runs them. A tool is a plain function
with a typed signature and a docstring (Google style, an `Args:` section), returning text: transformers' chat
templates turn those into the tool description of the prompt (`get_json_schema`), and `describe_tools` writes the
same as plain text for a prompt without a template. A model turn calls one tool in the Hermes / Qwen2.5 format,
`<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>`, and the reply is the tool's
text; a task with another call syntax overrides `ToolEnvironment.parse_call` and `format_reply`. A task without a
chat template writes its own prompt: `describe_tools` gives it the tools' description.

A tool call never stops the run: a malformed call, an unknown tool, wrong arguments, a raise, a non-text result or a
call past its time limit each become a reply that says what happened, counted as episode/failed_<kind>. The time
limit of an in-process tool is a SIGALRM timer (the turn loop runs in the main thread): a tool past it makes two runs
differ, so keep tools far from it. Code the model writes runs in tasks/sandbox.py's separate processes, never here.

`environment_of(task)` is the environment the turn loop runs for a task: its own `environment()`, else a
ToolEnvironment when it declares tools, else None (a single-turn task)."""

import inspect
import json
import re
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

from tasks.arithmetic import parse_expression
from tasks.base import Environment, Task

FAILURE_KINDS = ("malformed", "unknown_tool", "bad_arguments", "error", "non_text", "timeout")
MAX_REPLY_CHARS = 2_000  # a tool's text is cut here (with a note): the reply still has to fit the token budget
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: non-negative integers with + - * / and parentheses, e.g. "(12+3)*45/6"
    """
    parsed = parse_expression(expression)  # a small grammar over exact fractions: no eval
    if parsed is None:
        return ("error: not an arithmetic expression of integers, + - * / and parentheses, or it divides by zero: "
                f"{expression!r}")
    value = parsed[0]
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def describe_tools(tools: tuple[Callable[..., str], ...]) -> str:
    """The tools as plain text for a prompt without a chat template: one line each, name(arguments: types) and the
    first line of its docstring."""
    lines = []
    for tool in tools:
        signature = inspect.signature(tool)
        arguments = ", ".join(f"{name}: {getattr(parameter.annotation, '__name__', parameter.annotation)}"
                              for name, parameter in signature.parameters.items())
        lines.append(f"{tool.__name__}({arguments}): {(inspect.getdoc(tool) or '').splitlines()[0]}")
    return "\n".join(lines)


@dataclass
class ToolCall:
    name: str
    arguments: dict


def hermes_call(text: str) -> ToolCall | str | None:
    """The last `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` of a turn (the Hermes / Qwen2.5 format);
    None when the turn calls no tool; a string saying why when the call is malformed."""
    calls = CALL.findall(text)
    if not calls:
        return None
    try:
        call = json.loads(calls[-1])
    except json.JSONDecodeError as error:
        return f"the tool call is not JSON ({error.msg} at character {error.pos})"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(
            call.get("arguments", {}), dict):
        return 'a tool call is {"name": "<tool>", "arguments": {...}}'
    return ToolCall(call["name"], call.get("arguments", {}))


class ToolTimeout(Exception):
    """An in-process tool ran past ToolEnvironment.time_limit_s."""


class ToolEnvironment(Environment):
    """Tool use: each model turn either calls one of the task's tools, whose text is the reply, or answers, which
    ends the episode with the task's `score` of that turn's text (reward and correct)."""
    event_names = ("tool_calls", *(f"failed_{kind}" for kind in FAILURE_KINDS))
    time_limit_s = 10.0  # wall clock per in-process call (sandboxed tools have their own limits)

    def __init__(self, task: Task) -> None:
        self.task = task
        self.tools = {tool.__name__: tool for tool in task.tools}

    def parse_call(self, text: str) -> ToolCall | str | None:
        """The turn's last tool call; None when it calls none (an answer); a string saying why when it is
        malformed."""
        return hermes_call(text)

    def format_reply(self, text: str) -> str:
        """The reply appended after a call (with a chat template: the content of its tool message)."""
        return text

    def step(self, text: str) -> tuple[str | None, float, bool]:
        call = self.parse_call(text)
        if call is None:
            reward, correct = self.task.score(text, self.example)
            self.correct = bool(correct)
            return None, float(reward), True
        self.events["tool_calls"] += 1
        return self.format_reply(self.call(call)), 0.0, False

    def failed(self, kind: str, message: str) -> str:
        self.events[f"failed_{kind}"] += 1
        return f"error: {message}"

    def call(self, call: ToolCall | str) -> str:
        """Run one call: the tool's text, or a reply that says what went wrong."""
        if isinstance(call, str):
            return self.failed("malformed", call)
        tool = self.tools.get(call.name)
        if tool is None:
            return self.failed("unknown_tool", f"no tool {call.name!r}; the tools are {', '.join(self.tools)}")
        try:
            inspect.signature(tool).bind(**call.arguments)
        except TypeError as error:
            return self.failed("bad_arguments", f"{call.name}: {error}")
        try:
            result = self.run_with_time_limit(tool, call.arguments)
        except ToolTimeout:
            return self.failed("timeout", f"{call.name} ran past its {self.time_limit_s:g} s limit")
        except Exception as error:  # the tool's own failure is the model's information, not the run's end
            return self.failed("error", f"{call.name} raised {type(error).__name__}: {error}")
        if not isinstance(result, str):
            return self.failed("non_text", f"{call.name} returned {type(result).__name__}, not text")
        return result if len(result) <= MAX_REPLY_CHARS else result[:MAX_REPLY_CHARS] + "\n[output cut]"

    def run_with_time_limit(self, tool: Callable[..., str], arguments: dict) -> object:
        sandboxed = getattr(tool, "sandbox", None) is not None  # its own limits, and notes that say which one acted
        if sandboxed or threading.current_thread() is not threading.main_thread():  # signals: the main thread only
            return tool(**arguments)

        def expire(signum: int, frame: object) -> None:
            raise ToolTimeout

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, self.time_limit_s)
        try:
            return tool(**arguments)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)



def environment_of(task: Task) -> Environment | None:
    """A fresh environment for one episode of `task`: the task's own, else a ToolEnvironment when it declares tools,
    else None (single-turn)."""
    environment = task.environment()
    if environment is None and task.tools:
        return ToolEnvironment(task)
    return environment


def check_tools(task: Task, allow_unisolated: bool) -> str | None:
    """Why the task's sandboxed tools (those with a `sandbox`, tasks/sandbox.py) cannot start on this platform, or
    None: a tool that runs model-written code refuses to start without isolation unless the user opts out."""
    for tool in task.tools:
        sandbox = getattr(tool, "sandbox", None)
        problem = sandbox.check(allow_unisolated) if sandbox is not None else None
        if problem:
            return f"tool {tool.__name__!r}: {problem}"
    return None


def sandbox_descriptions(task: Task) -> dict[str, str]:
    """What each sandboxed tool's calls get here (isolation, memory bound), for the log and the manifest."""
    return {tool.__name__: tool.sandbox.describe() for tool in task.tools if getattr(tool, "sandbox", None)}
