"""The embedded addition task with 2,000 training problems instead of 100,000, for the tests' short runs (a few
hundred problems drawn at most): building and encoding the 100,000 took each rank about a second at start-up, and
made the heap that the engine's two collections at shutdown walk a fifth larger. The problems are the default task's
first 2,000, the test set its own."""

from tasks import AdditionTask


class SmallAdditionTask(AdditionTask):
    def __init__(self) -> None:
        super().__init__(num_train=2_000)
