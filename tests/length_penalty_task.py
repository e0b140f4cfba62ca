"""The addition prompts with a length penalty (-len(completion) / 8), for the model-family tests: a random model
never solves the addition, so without it every group's rewards tie and the gradients are zero; with it they differ,
and a run trains for real. Smaller splits than the default task's, for a fast start."""

from tasks import AdditionTask, Example


class LengthPenaltyTask(AdditionTask):
    def __init__(self) -> None:
        super().__init__(num_train=2_000, num_test=64)

    def reward(self, completion: str, example: Example) -> float:
        return -len(completion) / 8
