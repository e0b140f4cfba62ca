"""Gymnasium text environments, trained unchanged: `--task my_env.py:MyEnv` for a `gymnasium.Env` subclass, `--task
gym:my_env.py:MyEnv` for a class in the older gym API, `--task gym:MyText-v0` (or `gym:my_package.envs:MyText-v0`) for
a registered id, made by `gymnasium.make`.

An episode: a fresh environment, `reset(seed=the episode's start seed)` (tasks/base.py, Environment; the row's own
`seed` field where it has one; `options=` the row when there is one and reset takes options) whose observation is
the prompt (appended to the row's prompt, if any); then each model turn's text is the action, and `step` returns the
observation that is the reply, a reward, and the end: gymnasium's 5-tuple (observation, reward, terminated,
truncated, info) or gym's 4-tuple (observation, reward, done, info). The episode's reward is the sum of the step
rewards; it is correct when the sum is 1 or more.
Observations and actions are text; a non-text observation stops the run with a message naming the class and method.
Every call runs on the episode's own thread, bounded by --env-time-limit-s (tasks/adapters.py): a step past it ends
the episode (counted as episode/failed_timeout); a reset past it stops the run."""

from dataclasses import replace

from tasks.adapters import AdapterTask, CallTimeout, EnvironmentThread, EnvOptions, takes_argument
from tasks.base import Environment, Example


def is_gymnasium_class(value: object) -> bool:
    """A subclass of gymnasium.Env (gymnasium imported only when the class's module already did)."""
    import sys

    gymnasium = sys.modules.get("gymnasium")
    return gymnasium is not None and isinstance(value, type) and issubclass(value, gymnasium.Env)


class GymTextTask(AdapterTask):
    """Episodes of one Gymnasium (or gym) text environment: `make()` gives a fresh one per episode."""

    def __init__(self, make: object, name: str, options: EnvOptions | None = None) -> None:
        super().__init__(options)
        self.make, self.name = make, name

    def environment(self) -> "GymTextEnvironment":
        return GymTextEnvironment(self)

    def environment_record(self) -> dict[str, object]:
        return {"contract": "Gymnasium text environment", "environment": self.name, "rows": self.rows}


class GymTextEnvironment(Environment):
    event_names = ("failed_timeout",)
    probe_text = None  # an empty action may be no valid action: the probe resets and finishes only

    def __init__(self, task: GymTextTask) -> None:
        self.task, self.name = task, task.name
        self.environment: object = None

    def reset(self, example: Example) -> str | None:
        self.thread = EnvironmentThread(self.name, self.task.options.time_limit_s)
        self.environment = self.thread.run(f"{self.name}()", self.task.make)
        reset = self.environment.reset
        keywords = {"seed": example.data.get("seed", self.seed)} if takes_argument(reset, "seed") else {}
        if example.data and takes_argument(reset, "options"):
            keywords["options"] = dict(example.data)
        result = self.thread.run(f"{self.name}.reset", reset, **keywords)
        observation = result[0] if isinstance(result, tuple) and len(result) == 2 else result  # gym: the observation
        if not isinstance(observation, str):
            raise TypeError(f"{self.name}.reset returned the observation {observation!r:.60} "
                            f"({type(observation).__name__}): a text environment's observations are strings")
        self.example = replace(example, prompt=example.prompt + observation)
        return observation

    def step(self, text: str) -> tuple[str | None, float, bool]:
        what = f"{self.name}.step"
        try:
            result = self.thread.run(what, self.environment.step, text)
        except CallTimeout:
            self.events["failed_timeout"] += 1
            return None, 0.0, True
        if isinstance(result, tuple) and len(result) == 5:
            observation, reward, terminated, truncated, _ = result
            done = bool(terminated) or bool(truncated)
        elif isinstance(result, tuple) and len(result) == 4:
            observation, reward, done, _ = result
            done = bool(done)
        else:
            raise TypeError(f"{what} returned {result!r:.80}: gymnasium's step returns (observation, reward, "
                            "terminated, truncated, info), gym's (observation, reward, done, info)")
        reward = self.task.finite_reward(reward, f"{what}'s reward")
        if done:
            return None, reward, True
        if not isinstance(observation, str):
            raise TypeError(f"{what} returned the observation {observation!r:.60} ({type(observation).__name__}): a "
                            "text environment's observations are strings")
        return observation, reward, False

    def finish(self) -> float:
        """The environment closed (its `close`, if it has one: within the limit, a timeout ignored)."""
        try:
            close = getattr(self.environment, "close", None)
            if close is not None and self.thread.abandoned is None:
                try:
                    self.thread.run(f"{self.name}.close", close)
                except CallTimeout:
                    pass  # the episode is over: a close that hangs costs its thread, not the run
            return 0.0
        finally:
            self.thread.close()


def gym_task(argument: str, options: EnvOptions | None = None) -> GymTextTask:
    """`--task gym:<argument>`: a class (`file.py:Class`, `package.module:Class`) made with no arguments, or a
    registered id (`MyText-v0`, `package.module:MyText-v0`) made by gymnasium.make."""
    from functools import partial

    from tasks.base import TaskError
    from tasks.loading import user_class

    location, _, name = argument.rpartition(":")
    if location and (location.endswith(".py") or name.isidentifier()):
        cls = user_class(location, name)
        if not (isinstance(cls, type) and callable(getattr(cls, "reset", None)) and callable(getattr(cls, "step",
                                                                                                   None))):
            raise TaskError(f"gym:{argument} is not an environment class: it needs reset and step methods")
        return GymTextTask(cls, cls.__name__, options)
    import gymnasium

    try:
        gymnasium.make(argument).close()  # registered, and made without error: checked before any model loads
    except Exception as error:
        raise TaskError(f"gymnasium cannot make {argument!r}: {error}") from error
    return GymTextTask(partial(gymnasium.make, argument), argument, options)
