"""The contract of a task, all a task author needs besides a dataset: `Example` (one prompt, its reference, its
structured fields), `Task` (a train and a test list of examples, a `reward` for training, a `correct` for every
accuracy, the settings it needs) and, for a multi-turn task, `Environment` (the other side of an episode). docs/tasks.md
walks through a single-turn and a multi-turn task; tasks/data.py reads dataset files; tasks/tools.py runs tools."""

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class TaskError(ValueError):
    """A task's data or settings cannot work; the message says what to change."""


@dataclass(frozen=True)
class Example:
    prompt: str  # the user's message: the text the model continues (before any chat template)
    answer: str  # the reference the scorer checks against ("" where a task checks structure instead)
    data: dict[str, Any] = field(default_factory=dict, compare=False)  # structured fields (numbers, level, ...)


class Environment:
    """The other side of a multi-turn episode; docs/tasks.md shows one in a complete task.

    The turn loop (common/llm/episodes.py) makes one per episode (`Task.environment()`), sets `max_turns`
    (--max-turns), an empty `events` and `correct = None`, calls `reset(example)`, and after every model turn sets
    `turn` (0 for the first) and calls `step(text)` with that turn's text (the sampled ids decoded, the final EOS
    dropped, special tokens skipped). `step` returns (reply, reward, done):
    - reply: text appended to the episode as the environment's tokens (loss mask 0, logprob 0.0; with a chat
      template, as a tool message), or None: nothing more to say, the episode ends. Write it in characters the
      model's tokenizer knows: a reply that does not survive encoding is warned about once, and refused by the probe;
    - reward: a finite number; the episode's score (what the algorithm learns from) is the sum over its turns;
    - done: True ends the episode (its reply is not appended).
    The episode also ends after `max_turns` model turns, or when --max-completion-length (every turn's model and
    environment tokens together) runs out: a reply that would leave no room for another model token is rolled back.
    `step` may set `correct`, what train/accuracy and eval/accuracy count (left None: a score of 1 or more is
    correct), and count what happened in `events` under the names of `event_names` (logged as episode/<name>, the
    mean per episode; an undeclared name stops the run).

    Before `reset` the loop also sets `seed`, the episode's start-state seed (32 bits): in training a function of
    (--seed, step, prompt), the same for a prompt's G samples, so an environment that draws its start state from it
    gives the group one start to compare answers from; in evaluation a function of the test prompt's index alone (the
    same held-out starts for every --seed). `reset` may return text when the task sets `environment_prompts`: the
    text extends the prompt's user message (TRL's `reset` contract), and the episode's prompt is encoded anew. After
    the episode has ended, however it ended (an answer, the budget, the turn limit), the loop calls `finish()` once:
    its number is added to the episode's reward (a score read off the environment's final state), and it releases
    what `reset` took.

    Before any model loads, each rank probes one fresh environment: `reset(the first training example)`, then
    `step(probe_text)`, whose result must have the types above, then `finish()`. Set `probe_text = None` when a step
    has side effects a probe must not cause (the probe then resets and finishes only). A `reset`, `step` or `finish`
    that raises, or returns the wrong types, later stops every rank with a message naming the prompt and the model's
    text."""
    event_names: tuple[str, ...] = ()
    probe_text: str | None = ""  # the model text of the start-up probe; None: reset and finish only
    correct: bool | None = None
    events: Counter
    max_turns: int  # --max-turns: the model turns an episode may have
    turn: int  # the model turn that `step` answers, from 0
    seed: int  # the start-state seed, set before `reset` (above)

    def reset(self, example: Example) -> str | None:
        self.example = example
        return None

    def step(self, text: str) -> tuple[str | None, float, bool]:
        raise NotImplementedError

    def finish(self) -> float:
        """Called once after the episode ended: a last reward (0.0 here), and the place to release what `reset`
        took (a server's session, a thread)."""
        return 0.0


class Task:
    """Subclass it, fill `train` and `test` in `__init__`, and give `reward` (and `correct` when the reward gives
    partial credit). The class attributes are the settings the task needs; the run stops with a message when its
    arguments cannot meet them. A multi-turn task declares `tools` (or returns its own `environment`); a single-turn
    task does neither."""
    train: list[Example]
    test: list[Example]
    min_completion_length: int = 1  # --max-completion-length below this cannot hold an answer: refused
    chat_template: bool = True  # apply the tokenizer's chat template when it has one
    system_prompt: str | None = None  # a system message before each prompt (as plain text without a template)
    tools: tuple[Callable[..., str], ...] = ()  # functions the model may call (tasks/tools.py): typed signatures
    # and docstrings, from which a chat template writes the tools' description into the prompt
    environment_prompts: bool = False  # the environment's `reset` returns text that extends each prompt (TRL's
    # contract): every episode's prompt is then encoded after its reset, up to --max-prompt-length

    def environment(self) -> Environment | None:
        """A fresh environment for one episode, or None. Left as it is, a task with `tools` gets a ToolEnvironment
        (tasks/tools.py: each model turn calls a tool, whose text is the reply, or answers, which `score` scores and
        which ends the episode) and a task without is single-turn; override it for an environment of your own."""
        return None

    def environment_record(self) -> dict[str, object]:
        """What the run's manifest.json records about where the environment runs (a server's URL and version); none
        for an environment in this process."""
        return {}

    def reward(self, completion: str, example: Example) -> float:
        """The training signal of one completion (the text after the prompt, the final EOS dropped)."""
        raise NotImplementedError

    def correct(self, completion: str, example: Example) -> bool:
        """Whether the completion solves the problem: what train/accuracy and eval/accuracy count. By default a
        reward of 1 or more; a task whose reward gives partial credit says what correct means."""
        return self.reward(completion, example) >= 1.0

    def score(self, completion: str, example: Example) -> tuple[float, bool]:
        """(reward, correct) of one completion, what training asks for. Override it when both come from one check
        that is costly to run twice (a symbolic verifier)."""
        return self.reward(completion, example), self.correct(completion, example)

    def eval_metrics(self, completion: str, example: Example) -> dict[str, float]:
        """More held-out metrics of one greedy completion (e.g. a lenient accuracy), each averaged over the test
        prompts and logged as eval/<name>. None by default."""
        return {}

    def format_prompt(self, tokenizer: object, example: Example) -> str:
        """The prompt text the model sees: the chat template when the task wants it and the tokenizer has one (so
        instruct models see what they were trained on), else the system prompt (if any) and the prompt."""
        if self.chat_template and getattr(tokenizer, "chat_template", None):
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            messages = [*system, {"role": "user", "content": example.prompt}]
            tools = {"tools": list(self.tools)} if self.tools else {}  # the template describes them
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **tools)
        return f"{self.system_prompt}\n{example.prompt}" if self.system_prompt else example.prompt


def last_tagged(text: str, tag: str = "answer") -> str | None:
    """The stripped text inside the last `<tag>...</tag>` (the last opening before the last closing), or None. Two
    searches from the end: linear in the completion, where a regex over many unclosed tags is quadratic."""
    end = text.rfind(f"</{tag}>")
    start = text.rfind(f"<{tag}>", 0, end) if end >= 0 else -1
    return text[start + len(tag) + 2:end].strip() if start >= 0 else None


