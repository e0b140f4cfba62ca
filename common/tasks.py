"""Prompt datasets with verifiable rewards, behind one interface: `Task.train`, `Task.test`, `Task.reward`."""

import os
import random
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    prompt: str  # the text the model continues (before any chat template)
    answer: str  # the reference the reward checks against


class Task:
    train: list[Example]
    test: list[Example]

    def reward(self, completion: str, example: Example) -> float:
        raise NotImplementedError

    def format_prompt(self, tokenizer: object, example: Example) -> str:
        """Apply the tokenizer's chat template when it has one, so instruct models see what they were trained on."""
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": example.prompt}]
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return example.prompt


class AdditionTask(Task):
    """`a+b=` with a, b uniform in [0, 10**digits). The completion must be exactly the sum. The test set is fixed by
    `test_seed` and excluded from the training stream as unordered pairs: neither `a+b=` nor its commutative twin
    `b+a=` is trained on, so held-out accuracy measures generalisation rather than recall of the swapped sum."""

    def __init__(self, digits: int = 3, num_train: int = 100_000, num_test: int = 500, test_seed: int = 1234) -> None:
        self.digits = digits
        self.test = addition_examples(num_test, digits, random.Random(test_seed))
        held_out = {addition_operands(example.prompt) for example in self.test}
        rng = random.Random(test_seed + 1)
        self.train = []
        while len(self.train) < num_train:
            example = addition_examples(1, digits, rng)[0]
            if addition_operands(example.prompt) not in held_out:
                self.train.append(example)

    def reward(self, completion: str, example: Example) -> float:
        return float(completion.strip() == example.answer)


def addition_operands(prompt: str) -> tuple[int, int]:
    """The unordered pair {a, b} of an `a+b=` prompt, smaller first: `a+b=` and `b+a=` give the same pair."""
    a, b = prompt.removesuffix("=").split("+")
    return min(int(a), int(b)), max(int(a), int(b))


def addition_examples(count: int, digits: int, rng: random.Random) -> list[Example]:
    high = 10**digits - 1
    pairs = [(rng.randint(0, high), rng.randint(0, high)) for _ in range(count)]
    return [Example(prompt=f"{a}+{b}=", answer=str(a + b)) for a, b in pairs]


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
    """openai/gsm8k ("main"): reward 1 when the strict `####` answer equals the reference, else 0."""

    def __init__(self, dataset_name: str = "openai/gsm8k") -> None:
        from datasets import load_dataset

        # a local copy (a directory of train/test files) has no "main" configuration
        data = load_dataset(dataset_name) if os.path.isdir(dataset_name) else load_dataset(dataset_name, "main")
        self.train = [self._example(row) for row in data["train"]]
        self.test = [self._example(row) for row in data["test"]]

    @staticmethod
    def _example(row: dict[str, str]) -> Example:
        answer = row["answer"].split("####")[-1].strip().replace(",", "")
        return Example(prompt=f"{row['question']} {GSM8K_INSTRUCTION}", answer=answer)

    def reward(self, completion: str, example: Example) -> float:
        return float(gsm8k_strict(completion) == example.answer)

    def flexible_reward(self, completion: str, example: Example) -> float:
        return float(gsm8k_flexible(completion) == example.answer)


def make_task(name: str) -> Task:
    """`addition` (the embedded default), `gsm8k`, or a local/hub dataset path in the GSM8K format."""
    return AdditionTask() if name == "addition" else GSM8KTask("openai/gsm8k" if name == "gsm8k" else name)
