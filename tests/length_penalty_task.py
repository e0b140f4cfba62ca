"""The addition prompts with a length penalty (-len(completion) / 8): a random model never solves the addition, so
without it every group's rewards tie and the gradients are zero; with it they differ, and a run trains for real."""

from tasks import AdditionTask, Example


class LengthPenaltyTask(AdditionTask):
    def reward(self, completion: str, example: Example) -> float:
        return -len(completion) / 8
