"""The embedded default task: `a+b=`, answered by the sum alone."""

import random

from tasks.base import Example, Task


class AdditionTask(Task):
    """`a+b=` with a, b uniform in [0, 10**digits). The completion must be exactly the sum. The test set is fixed by
    `test_seed` and excluded from the training stream as unordered pairs: neither `a+b=` nor its commutative twin
    `b+a=` is trained on, so held-out accuracy measures generalisation rather than recall of the swapped sum.
    The problems do not depend on --seed (only their order does). The embedded model reads no chat template."""
    min_completion_length = 4  # the longest sum's four digits (the reward reads the digits; the EOS may be cut)

    def __init__(self, digits: int = 3, num_train: int = 100_000, num_test: int = 500, test_seed: int = 1234) -> None:
        self.digits = digits
        self.test = addition_examples(num_test, digits, random.Random(test_seed))
        held_out = {addition_operands(example.prompt) for example in self.test}
        rng, high = random.Random(test_seed + 1), 10**digits - 1
        self.train = []
        while len(self.train) < num_train:  # the draws of addition_examples, one pair at a time, kept when not held out
            a, b = rng.randint(0, high), rng.randint(0, high)
            if (min(a, b), max(a, b)) not in held_out:
                self.train.append(Example(prompt=f"{a}+{b}=", answer=str(a + b)))

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
