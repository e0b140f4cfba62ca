"""A tiny task where a tool makes the difference: multiply two two-digit numbers, `37*58:`, with a calculator at hand.
A 0.9M-parameter character-level model (assets/tiny-calculator) cannot multiply two 2-digit numbers reliably, but it
can copy: copy the numbers into a call, copy the result into its answer. So the reward depends on whether it calls
the tool, and RL on two CPU cores can teach it to. `calculator_tiny:off` is the same task with the tool unavailable
(a call is answered `=?;`), the control of the comparison run; `calculator_tiny:python` answers each call by running
`print(expression)` in the python tool's sandbox (tasks/sandbox.py): the same episodes through model-written code.

An episode, in characters (one token each), the environment's tokens in brackets of their own here:

    37*58:[37*58]<eos>{=2146;}2146<eos>     a call, the calculator's reply (loss mask 0), the answer
    37*58:2146<eos>                          a direct answer, without the tool

A model turn of the form `[expression]` calls the calculator (tasks/tools.py) on the expression; a turn that starts
with `[` but is not of that form is a malformed call; any other turn is the answer, which ends the episode: reward 1
when its text is exactly the product, else 0. Every call that gives no number (malformed, not an expression, or the
tool off) is answered `=?;`: the model's alphabet has no letters to read an error message with."""

from __future__ import annotations

import random
from collections import Counter

from tasks.base import Example, Task, TaskError
from tasks.sandbox import python
from tasks.tools import ToolCall, ToolEnvironment, calculator

NO_RESULT = "?"  # the result of a call that gives no number: a reply the character-level model can read


class TinyCalculatorEnvironment(ToolEnvironment):
    """The bracket call syntax of TinyCalculatorTask: `[37*58]` calls the calculator, the reply is `=2146;`. With
    `available` False the call is counted but never run: the reply is `=?;`."""

    def __init__(self, task: Task, available: bool = True) -> None:
        super().__init__(task)
        self.available = available

    def reset(self, example: Example) -> None:
        super().reset(example)
        self.events, self.correct = Counter(), None

    def parse_call(self, text: str) -> ToolCall | str | None:
        if not text.startswith("["):
            return None  # an answer
        if len(text) < 3 or not text.endswith("]") or "[" in text[1:-1] or "]" in text[1:-1]:
            return "a call is one [expression], e.g. [12*34]"
        if "python" in self.tools:  # the model's text becomes code: whatever it writes runs in the sandbox
            return ToolCall("python", {"code": f"print({text[1:-1]})"})
        return ToolCall("calculator", {"expression": text[1:-1]})

    def format_reply(self, result: str) -> str:
        return f"={result};"

    def call(self, call: ToolCall | str) -> str:
        if isinstance(call, str):  # malformed: counted as failed_malformed; its message is unreadable here
            super().call(call)
            return NO_RESULT
        if not self.available:
            return NO_RESULT
        result = super().call(call).strip()
        return result if result.isdigit() else NO_RESULT  # the calculator's "error: ..." (e.g. `[12**3]`), a traceback


class TinyCalculatorTask(Task):
    """`a*b:` with a, b in [10, 99], answered by the product alone, with a calculator to call (see the module
    docstring). The problems do not depend on --seed: 500 test pairs and 20,000 training pairs drawn with fixed
    seeds, no test pair nor its commutative twin among the training ones. `calculator_tiny:off` takes the tool away."""
    tools = (calculator,)
    chat_template = False
    system_prompt = None
    # the longest tool episode: the call `[99*99]` and EOS (8), the reply `=9801;` (6), the answer and EOS (5)
    min_completion_length = 20

    def __init__(self, tool: str = "", num_train: int = 20_000, num_test: int = 500) -> None:
        if tool not in ("", "off", "python"):
            raise TaskError("calculator_tiny takes no argument, `off` (the tool unavailable) or `python` (calls run "
                            f"in the sandbox), got {tool!r}")
        self.tool_available = tool != "off"
        if tool == "python":
            self.tools = (python,)
        rng = random.Random(1357)
        self.test, held_out = [], set()
        while len(self.test) < num_test:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            if (min(a, b), max(a, b)) not in held_out:
                held_out.add((min(a, b), max(a, b)))
                self.test.append(self.example(a, b))
        rng, self.train = random.Random(1358), []
        while len(self.train) < num_train:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            if (min(a, b), max(a, b)) not in held_out:
                self.train.append(self.example(a, b))

    @staticmethod
    def example(a: int, b: int) -> Example:
        return Example(f"{a}*{b}:", str(a * b), {"a": a, "b": b})  # no spaces: the tokenizer class drops them

    def environment(self) -> TinyCalculatorEnvironment:
        return TinyCalculatorEnvironment(self, available=self.tool_available)

    def reward(self, completion: str, example: Example) -> float:
        """1 when the answer turn is exactly the product, else 0."""
        return float(completion.strip() == example.answer)
