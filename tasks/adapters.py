"""What the adapters for environments written for other trainers share (docs/environments.md): the run's settings for
them (`EnvOptions`, from the --env-* flags), their rows (`environment_rows`: a dataset, or empty rows whose episodes
the environment's seeded reset makes), the thread every call into one environment instance runs on, each call bounded
in time (`EnvironmentThread`), and the task they build on (`AdapterTask`). The adapters: tasks/environment_class.py
(TRL's `environment_factory` classes), tasks/gym_text.py (Gymnasium text environments), tasks/openenv_client.py
(OpenEnv servers)."""

import inspect
import math
import numbers
import queue
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from tasks.base import Example, Task, TaskError
from tasks.data import Row, load_split, read_local


@dataclass
class EnvOptions:
    """The run's settings an adapter needs (each the flag of the same name in common/llm/run.py, or derived from
    the run's shape)."""
    dataset: str | None = None  # --env-dataset: the rows; None: empty rows
    prompts_per_step: int = 64  # rows without a dataset: one step's worth, each episode told apart by its seed
    num_generations: int = 8
    num_eval_prompts: int = 500  # held-out rows without a dataset (0: 500)
    eval_samples: int = 0
    generating_ranks: int = 1  # ranks that run episodes (all, or the split layout's rollout ranks)
    generates: bool = True  # this rank runs episodes (a split layout's trainer does not)
    time_limit_s: float = 60.0  # --env-time-limit-s: each call into the environment
    action_field: str | None = None  # --env-action-field (OpenEnv): the action's text field
    observation_field: str | None = None  # --env-observation-field (OpenEnv): the observation's text field

    def episodes_at_once(self, test_count: int) -> int:
        """The most episodes this rank runs at once: one training step's rows (a prompt's G samples included), or
        its share of an evaluation (with --eval-samples k, k episodes per held-out prompt); 1 where it runs none
        (its start-up probe's)."""
        if not self.generates:
            return 1
        training = self.prompts_per_step * self.num_generations // self.generating_ranks
        count = min(self.num_eval_prompts, test_count) if self.num_eval_prompts else test_count
        return max(training, math.ceil(count / self.generating_ranks) * max(1, self.eval_samples))

    def explain_episodes(self, test_count: int) -> str:
        """Where `episodes_at_once` comes from, for a refusal."""
        count = min(self.num_eval_prompts, test_count) if self.num_eval_prompts else test_count
        samples = f" x {self.eval_samples} samples" if self.eval_samples else ""
        return (f"{self.prompts_per_step} prompts x {self.num_generations} samples / {self.generating_ranks} ranks in "
                f"training, {count} held-out prompts{samples} / {self.generating_ranks} ranks in evaluation")


def row_example(row: dict, origin: str) -> Example:
    """A dataset row as an Example: its `prompt` (text, or chat messages whose last one's text is taken; none: ""),
    its `answer` as text ("" without one), and the whole row as its data (what the environment's reset receives)."""
    prompt = row.get("prompt", "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        prompt = prompt[-1].get("content", "")
    if not isinstance(prompt, str):
        raise TaskError(f"{origin}: its prompt must be text or chat messages with text content, got {prompt!r:.60}")
    return Example(prompt, str(row.get("answer", "")), dict(row))


def environment_rows(options: EnvOptions) -> tuple[list[Example], list[Example], str]:
    """The training and held-out rows, and where they come from (for the manifest). From --env-dataset: its train and
    test splits (a local file alone, or a source without a test split: the training rows are also the held-out ones,
    which the note says). Without: empty rows, one step's worth to train on and --num-eval-prompts held out (500 for
    0), each episode's start made by the environment from its seed."""
    if options.dataset is None:
        test_count = options.num_eval_prompts or 500
        return ([Example("", "") for _ in range(options.prompts_per_step)], [Example("", "") for _ in range(
            test_count)], f"no dataset: {options.prompts_per_step} empty training rows and {test_count} held-out ones, "
                          "each episode made by the environment's reset from its seed")
    path = Path(options.dataset).expanduser()
    if path.is_file():
        train = read_local(path)
        test, note = train, f"{path}: one file, whose rows are both the training and the held-out rows"
    else:
        train = load_split(options.dataset, "train")
        try:
            test, note = load_split(options.dataset, "test"), f"{options.dataset}: its train and test splits"
        except (TaskError, ValueError):  # no test split: a local copy says TaskError, `datasets` ValueError
            test, note = train, f"{options.dataset}: no test split, its training rows are also the held-out rows"
    examples = [[row_example(row, row.origin if isinstance(row, Row) else options.dataset) for row in rows]
                for rows in (train, test)]
    return examples[0], examples[1], note


def takes_argument(function: object, name: str) -> bool:
    """Whether `function`'s signature names the parameter `name` (a `**kwargs` alone does not count: a seed is
    passed only to a reset that asks for one)."""
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """One line on stderr, the first time a process meets the kind of trouble it names (its first word)."""
    kind = message.split()[0]
    if kind not in _warned:
        _warned.add(kind)
        sys.stderr.write(f"warning: {message}\n")


def accepted_keywords(function: object, keywords: dict) -> dict:
    """The keywords `function` takes: all of them where it has `**kwargs`, else those its signature names (as an
    OpenEnv server filters a reset's fields): a row's `prompt` does not break a `reset(self, seed=None)`."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return keywords
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return keywords
    return {name: value for name, value in keywords.items() if name in parameters}


class CallTimeout(Exception):
    """A call into an environment ran past --env-time-limit-s (or was not made: an earlier one still runs)."""


class EnvironmentThread:
    """The one thread on which every call into one environment instance runs (its constructor, reset, steps, tools),
    each waited for at most the time limit. One thread per instance, as an OpenEnv server gives each session its own
    executor: an environment may hold thread-bound state (an event loop, a browser). An async method's coroutine runs
    on that thread's own event loop (TRL allows async tools and `get_reward`).

    A call past its limit cannot be stopped (Python cannot kill a thread): it is abandoned and runs on in its thread,
    and the instance is not called again (every later call fails at once: its state is whatever the abandoned call
    leaves). The thread is a daemon, so an abandoned call cannot hold the process at exit. A timeout is wall-clock
    time: a run where a call passes its limit may differ from one where it did not, so keep the limit far above what
    the environment takes."""

    def __init__(self, name: str, time_limit_s: float) -> None:
        self.name, self.time_limit_s = name, time_limit_s
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.abandoned: str | None = None  # the call that ran past its limit
        threading.Thread(target=self.serve, name=f"environment {name}", daemon=True).start()

    def serve(self) -> None:
        loop = None
        while (job := self.jobs.get()) is not None:
            function, arguments, keywords, box, done = job
            try:
                result = function(*arguments, **keywords)
                if inspect.isawaitable(result):
                    import asyncio  # only for an async environment: its import costs a third of a second

                    loop = loop or asyncio.new_event_loop()
                    result = loop.run_until_complete(result)
                box.append((True, result))
            except BaseException as error:  # what the caller re-raises, SystemExit included
                box.append((False, error))
            done.set()
        if loop is not None:
            loop.close()

    def call(self, what: str, function: object, *arguments: object, **keywords: object) -> object:
        """`function(*arguments, **keywords)` on this thread: its result, its exception, or CallTimeout naming `what`
        (e.g. `MyEnv.step`) and the limit."""
        if self.abandoned is not None:
            raise CallTimeout(f"{what} not called: {self.abandoned} still runs past its {self.time_limit_s:g} s limit")
        box, done = [], threading.Event()
        self.jobs.put((function, arguments, keywords, box, done))
        if not done.wait(self.time_limit_s):
            self.abandoned = what
            warn_once(f"{what} ran past its {self.time_limit_s:g} s limit (--env-time-limit-s): the call is "
                      "abandoned on its thread and its episode ends (counted as episode/failed_timeout); warned once")
            raise CallTimeout(f"{what} ran past its {self.time_limit_s:g} s limit (--env-time-limit-s)")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def run(self, what: str, function: object, *arguments: object, **keywords: object) -> object:
        """`call`, with an exception raised by the environment named: `RuntimeError("MyEnv.reset raised ...")`."""
        try:
            return self.call(what, function, *arguments, **keywords)
        except CallTimeout:
            raise
        except Exception as error:
            raise RuntimeError(f"{what} raised {error!r}") from error

    def close(self) -> None:
        """The thread ends after its current call (an abandoned one: whenever that returns)."""
        self.jobs.put(None)


class AdapterTask(Task):
    """What the adapters' tasks share: rows from --env-dataset or empty ones (`environment_rows`), prompts the
    environment's reset writes (`environment_prompts`), and a task reward of 0: the environment's rewards are the
    episode's. A subclass may give `reward` (the answer turn's score, added) where its environment reports none."""
    environment_prompts = True

    def __init__(self, options: EnvOptions | None = None) -> None:
        self.options = options or EnvOptions()
        self.train, self.test, self.rows = environment_rows(self.options)

    def reward(self, completion: str, example: Example) -> float:
        return 0.0

    def finite_reward(self, value: object, what: str) -> float:
        """A reward an environment returned, as a float, or TypeError naming the method that returned it."""
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise TypeError(f"{what} returned {value!r}: a reward is a finite number")
        return float(value)  # numpy's scalars too
