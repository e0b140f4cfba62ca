"""A two-turn task on the embedded adder, for the multi-turn tests: after the model's first answer the environment
replies `+0=` (the same sum again); the episode's reward is the addition reward of the first answer, given when the
second ends it (so both turns' tokens carry its advantage, and the reply's none)."""

from tasks import AdditionTask, Environment


class SecondLookEnvironment(Environment):
    event_names = ("second_looks",)

    def __init__(self, task: AdditionTask) -> None:
        self.task = task

    def step(self, text: str) -> tuple[str | None, float, bool]:
        if not self.events["second_looks"]:
            self.events["second_looks"] += 1
            self.first_reward = self.task.reward(text, self.example)
            return "+0=", 0.0, False
        return None, self.first_reward, True


class SecondLookTask(AdditionTask):
    min_completion_length = 11  # two answers of 4 digits and their EOS, and the 3-token reply

    def environment(self) -> Environment:
        return SecondLookEnvironment(self)


class BrokenOnRankOneTask(SecondLookTask):
    """Its environment raises on rank 1 only, after the engines started (no start-up probe): every rank must still
    stop with the message, none may hang."""

    def environment(self) -> Environment:
        import os

        environment = SecondLookEnvironment(self)
        environment.probe_text = None
        if os.environ.get("RANK") == "1":
            environment.step = lambda text: 1 / 0
        return environment


class UnevenTurnsTask(SecondLookTask):
    """Rank 1's episodes end after one turn (no second look), rank 0's after two: the ranks' episodes end at other
    turns, as real ones do."""

    def environment(self) -> Environment:
        import os

        environment = SecondLookEnvironment(self)
        if os.environ.get("RANK") == "1":
            environment.step = lambda text: (None, self.reward(text, environment.example), True)
        return environment


class CountedTask(SecondLookTask):
    """Writes its rank to the file $ENVIRONMENT_COUNT_FILE for each environment it builds, for the test that counts
    them against the episodes that ran."""

    def environment(self) -> Environment:
        import os

        with open(os.environ["ENVIRONMENT_COUNT_FILE"], "a") as built:
            built.write(f"{os.environ.get('RANK', '0')}\n")
        return super().environment()
