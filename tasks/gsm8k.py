"""GSM8K (Cobbe et al., arXiv:2110.14168): grade-school word problems, the answer after `####`."""

import re

from tasks.base import Example, Task
from tasks.data import Row, load_split
from tasks.math_answers import lenient_correct

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def gsm8k_strict(completion: str) -> str | None:
    """The number after the last `#### `, as verl's strict extraction (commas and `$` dropped)."""
    matches = re.findall(r"#### (\-?[0-9\.\,]+)", completion)
    return matches[-1].replace(",", "").replace("$", "").rstrip(".") if matches else None


def gsm8k_flexible(completion: str) -> str | None:
    """The last number anywhere in the completion, as verl's flexible extraction."""
    numbers = [n for n in re.findall(r"(\-?[0-9\.\,]+)", completion) if n not in ("", ".", ",")]
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


class GSM8KTask(Task):
    """openai/gsm8k ("main"), or a local copy in its format (`question`, `answer` ending in `#### N`). Correct (and
    rewarded 1) when the strict `####` answer equals the reference (verl's metric); held-out also
    `eval/accuracy_flexible` (the last number, verl's flexible) and `eval/accuracy_lenient` (math-verify on the
    completion: `\\boxed{}` or the last expression, as TRL and open-r1 score)."""
    min_completion_length = 16  # `#### N` and a line of working (real runs give it hundreds of tokens)

    def __init__(self, source: str | None = None) -> None:
        source = source or "openai/gsm8k"
        self.train = [self.example(row) for row in load_split(source, "train", "main")]
        self.test = [self.example(row) for row in load_split(source, "test", "main")]

    @staticmethod
    def example(row: Row) -> Example:
        question, solution = row.need_text("question", "answer")
        answer = solution.split("####")[-1].strip().replace(",", "")
        return Example(prompt=f"{question} {GSM8K_INSTRUCTION}", answer=answer)

    def reward(self, completion: str, example: Example) -> float:
        return float(gsm8k_strict(completion) == example.answer)

    def flexible_reward(self, completion: str, example: Example) -> float:
        return float(gsm8k_flexible(completion) == example.answer)

    def eval_metrics(self, completion: str, example: Example) -> dict[str, float]:
        return {"accuracy_flexible": self.flexible_reward(completion, example),
                "accuracy_lenient": float(lenient_correct(completion, example.answer))}
