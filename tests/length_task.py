"""The addition task with a length penalty, for the model-zoo tests (tests/test_model_families.py): a random-weight
model never writes a right sum, so every reward would be 0 and no gradient would flow; a penalty of 1/8 per character
of the completion gives every group a spread. Smaller splits than the default task's, for a fast start."""

from tasks import AdditionTask, Example


class ShortAnswersTask(AdditionTask):
    def __init__(self) -> None:
        super().__init__(num_train=2_000, num_test=64)

    def reward(self, completion: str, example: Example) -> float:
        return float(completion.strip() == example.answer) - len(completion) / 8

    def correct(self, completion: str, example: Example) -> bool:
        return completion.strip() == example.answer
