"""Environments written for other trainers, run by tests/test_environments.py and benchmarks/env_adapters.py: one
problem, `a*b` for two-digit a and b with a calculator at hand, written to TRL's `environment_factory` contract, to
Gymnasium's and to OpenEnv's, each as its authors would (none imports this repository), in the characters of the
embedded `assets/tiny-calculator` (digits and `*[]=;:?`): the reset's text `37*58:` is the prompt, a turn `[37*58]`
calls the calculator, whose reply is `=2146;`, and any other turn is the answer. The tiny model calls the calculator
in about a quarter of its samples and cannot multiply: RL teaches it to call (docs/tasks.md, calculator_tiny).

Each draws its problem from the seed its reset is given, so the G samples of a prompt, which share a start seed,
share the problem. Also here: the classes the refusal tests need (a reset that raises, a tool that hangs)."""

import random
import threading

import gymnasium
from fastmcp import FastMCP
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Action, Observation, State

from tasks import EnvironmentClassTask
from tasks.tools import ToolCall


def product_of(expression: str) -> str:
    """`a*b` of whole numbers, exactly; `?` for anything else (the tiny model reads no error message)."""
    terms = expression.split("*")
    if len(terms) != 2 or not all(term.isdigit() and len(term) <= 4 for term in terms):
        return "?"
    return str(int(terms[0]) * int(terms[1]))


class MultiplyWithCalculator:
    """TRL's contract: reset draws the problem and writes the prompt, two tools, and the reward from the state."""

    def reset(self, seed: int | None = None, **row: object) -> str:
        rng = random.Random(seed)
        self.a, self.b, self.answer = rng.randint(10, 99), rng.randint(10, 99), None
        return f"{self.a}*{self.b}:"

    def calculator(self, expression: str) -> str:
        """Multiply two whole numbers exactly.

        Args:
            expression: two whole numbers joined by *, e.g. "37*58"
        """
        return product_of(expression)

    def submit(self, answer: str) -> str:
        """Give the final answer.

        Args:
            answer: the product, in digits
        """
        self.answer = answer.strip()
        return "ok"

    def get_reward(self) -> float:
        return float(self.answer == str(self.a * self.b))


class TinyCalls(EnvironmentClassTask):
    """What the class does not say: the tiny model's call syntax (`[37*58]`, replied `=2146;`) and that its answer
    turn goes to `submit`."""
    environment_class = MultiplyWithCalculator
    answer_tool = "submit"
    min_completion_length = 20  # `[99*99]` and EOS, `=9801;`, the answer and EOS

    def parse_call(self, text: str) -> ToolCall | str | None:
        if not text.startswith("["):
            return None
        if not text.endswith("]") or "[" in text[1:-1] or "]" in text[1:-1]:
            return "a call is one [expression]"
        return ToolCall("calculator", {"expression": text[1:-1]})

    def format_reply(self, text: str) -> str:
        return f"={text};"


class MultiplyText(gymnasium.Env):
    """Gymnasium's contract: text observations and actions, the 5-tuple step, the problem from the seeded np_random."""

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        self.a, self.b = (int(x) for x in self.np_random.integers(10, 100, size=2))
        return f"{self.a}*{self.b}:", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if action.startswith("["):
            return f"={product_of(action[1:-1]) if action.endswith(']') else '?'};", 0.0, False, False, {}
        return "", float(action.strip() == str(self.a * self.b)), True, False, {}


class MultiplyAction(Action):
    text: str


class MultiplyObservation(Observation):
    text: str = ""


class MultiplyServer(Environment[MultiplyAction, MultiplyObservation, State]):
    """OpenEnv's contract: a server-side environment, one instance per session, seeded by reset."""
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: object) -> MultiplyObservation:
        rng = random.Random(seed)
        self.a, self.b = rng.randint(10, 99), rng.randint(10, 99)
        self._state = State(episode_id=episode_id, step_count=0)
        return MultiplyObservation(text=f"{self.a}*{self.b}:")

    def step(self, action: MultiplyAction, timeout_s: float | None = None, **kwargs: object) -> MultiplyObservation:
        self._state.step_count += 1
        text = action.text
        if text.startswith("["):
            return MultiplyObservation(text=f"={product_of(text[1:-1]) if text.endswith(']') else '?'};")
        return MultiplyObservation(text="", reward=float(text.strip() == str(self.a * self.b)), done=True)

    @property
    def state(self) -> State:
        return self._state


class OneSessionServer(MultiplyServer):
    """OpenEnv's default: one session at a time."""
    SUPPORTS_CONCURRENT_SESSIONS = False


class BrokenReset(MultiplyWithCalculator):
    """A reset that raises: refused by the probe, before any model loads."""

    def reset(self, seed: int | None = None, **row: object) -> str:
        raise ValueError("no problem table loaded")


class HangingCalculator(MultiplyWithCalculator):
    """A tool that never returns (until released): its call must end at the time limit, not hang the rank."""
    release = threading.Event()

    def calculator(self, expression: str) -> str:
        """Never answers.

        Args:
            expression: anything
        """
        HangingCalculator.release.wait()
        return "0"


class HangingCalls(TinyCalls):
    environment_class = HangingCalculator


class CalculatorTools(MCPEnvironment):
    """OpenEnv's MCP tool environments: the tools a FastMCP server registers, called by `call_tool` steps."""
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        server = FastMCP("calculator")

        @server.tool()
        def multiply(a: int, b: int) -> int:
            """Multiply two whole numbers exactly."""
            return a * b

        super().__init__(server)
        self._state = State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: object) -> Observation:
        self._state = State(episode_id=episode_id, step_count=0)
        return Observation()

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: object) -> Observation:
        return Observation(done=True, reward=0.0)  # no action but the tools'

    @property
    def state(self) -> State:
        return self._state
