"""Countdown: reach a target from given numbers with + - * / and parentheses, each number at most once. The task of
TinyZero (Pan et al. 2025, github.com/Jiayi-Pan/TinyZero) and nano-aha-moment (Kazemnejad et al. 2025). The model's
expression is parsed and evaluated exactly by tasks/arithmetic.py: model text is never given to `eval`."""

import random
from collections import Counter
from collections.abc import Iterator

from tasks.arithmetic import parse_expression
from tasks.base import Example, Task, TaskError, last_tagged
from tasks.data import Row, load_split


def score_expression(expression: str | None, numbers: list[int], target: int, require_all: bool = False
                     ) -> tuple[bool, bool]:
    """(well formed, correct): an expression that parses, uses only the given numbers, each at most as often as
    given (all of them with `require_all`, TinyZero's rule), and equals the target exactly."""
    parsed = parse_expression(expression) if expression is not None else None
    if parsed is None:
        return False, False
    value, used = parsed
    allowed = Counter(numbers)
    fair = not Counter(used) - allowed and (not require_all or Counter(used) == allowed)
    return True, fair and value == target


class CountdownTask(Task):
    """TinyZero's Countdown. Problems, procedural and offline by default, drawn as TinyZero's generator draws them:
    3 or 4 numbers uniform in [1, 100] and a target uniform in [1, 1000] (so many problems have no solution, as in
    TinyZero's; a solver would tell, but none runs here). The problems do not depend on --seed (fixed generator seeds,
    the test set apart from the training stream); --seed sets only their order. `countdown:<source>` reads
    Countdown-Tasks-3to4's format instead (`nums`, `target`): the hub id `Jiayi-Pan/Countdown-Tasks-3to4`, whose one
    split gives TinyZero's 327,680 training and the next 1,024 test rows, or a local copy with train/test files.

    The answer is the last `<answer>...</answer>` of the completion: an expression such as `(1 + 2) * 3`. Reward
    (TinyZero's): 1 correct, 0.1 for an answer in tags that is wrong or misuses the numbers, 0 without one. Correct
    means reward 1; `eval/well_formed` is the share of held-out answers in tags that parse as expressions."""
    min_completion_length = 256  # room to think (TinyZero's template asks for <think> first) and answer
    system_prompt = "You are a helpful assistant. You first think about the reasoning process and then answer."
    require_all = False  # each number at most once (TinyZero: exactly once)
    partial_credit_for_parsing = False  # 0.1 for any answer in tags (TinyZero); True: only for one that parses

    def __init__(self, source: str | None = None, num_train: int = 100_000, num_test: int = 500) -> None:
        if source is None:
            test_draws = tinyzero_draws(random.Random(4321))
            self.test = [self.example(*next(test_draws)) for _ in range(num_test)]
            held_out = {(tuple(sorted(e.data["numbers"])), e.data["target"]) for e in self.test}
            draws = (d for d in tinyzero_draws(random.Random(4322)) if (tuple(sorted(d[0])), d[1]) not in held_out)
            self.train = [self.example(*next(draws)) for _ in range(num_train)]
            return
        if source == "Jiayi-Pan/Countdown-Tasks-3to4":  # one hub split; TinyZero's cut
            rows = load_split(source, "train")
            self.train = [self.example(*self.fields(row)) for row in rows[:327_680]]
            self.test = [self.example(*self.fields(row)) for row in rows[327_680:327_680 + 1024]]
            return
        self.train = [self.example(*self.fields(row)) for row in load_split(source, "train")]
        self.test = [self.example(*self.fields(row)) for row in load_split(source, "test")]

    @staticmethod
    def fields(row: Row) -> tuple[list[int], int]:
        numbers, target = row.need("nums", "target")
        if not (isinstance(numbers, list) and numbers and all(type(n) is int for n in numbers)
                and type(target) is int):  # not bool, which is an int too
            raise TaskError(f"{row.origin}: `nums` must be a list of integers and `target` an integer")
        return numbers, target

    def example(self, numbers: list[int], target: int, solution: str = "") -> Example:
        return Example(self.prompt(numbers, target), solution, {"numbers": list(numbers), "target": target})

    def prompt(self, numbers: list[int], target: int) -> str:
        return (f"Using the numbers {numbers}, create an equation that equals {target}. You may use +, -, * and / "
                "and parentheses, and each number at most once. Think it through inside <think> </think> tags, "
                "then give only the expression inside <answer> </answer> tags, for example "
                "<answer> (1 + 2) / 3 </answer>.")

    def answer(self, completion: str) -> str | None:
        return last_tagged(completion)

    def judge(self, completion: str, example: Example) -> tuple[bool, bool, bool]:
        """(answered, well formed, correct)."""
        expression = self.answer(completion)
        formed, right = score_expression(expression, example.data["numbers"], example.data["target"],
                                         self.require_all)
        return expression is not None, formed, right

    def score(self, completion: str, example: Example) -> tuple[float, bool]:
        answered, formed, right = self.judge(completion, example)
        partial = formed if self.partial_credit_for_parsing else answered
        return (1.0 if right else 0.1 if partial else 0.0), right

    def reward(self, completion: str, example: Example) -> float:
        return self.score(completion, example)[0]

    def correct(self, completion: str, example: Example) -> bool:
        return self.judge(completion, example)[2]

    def eval_metrics(self, completion: str, example: Example) -> dict[str, float]:
        return {"well_formed": float(self.judge(completion, example)[1])}


def tinyzero_draws(rng: random.Random) -> Iterator[tuple[list[int], int]]:
    """TinyZero's generator, endless: 3 or 4 numbers uniform in [1, 100], a target uniform in [1, 1000]."""
    while True:
        size = rng.choice((3, 4))
        yield [rng.randint(1, 100) for _ in range(size)], rng.randint(1, 1000)


class TinyCountdownTask(CountdownTask):
    """Countdown small enough for the embedded character-level models and two CPU cores: three numbers in [1, 9],
    all used, a target that some expression of them reaches (positive, at most 100), and a bare prompt `3,5,7->22:`
    answered by the bare expression (`(7-5)*3`... no tags, no template). Each example's `answer` is the expression
    that made its target (for supervised warm-up: assets/build_tiny_model.py). Reward: 1 correct, 0.1 for an
    expression that parses but is wrong or misuses the numbers, 0 otherwise. The problems do not depend on --seed;
    the test problems (numbers as a multiset, and target) never occur in training."""
    min_completion_length = 8  # the longest expression, `(9-8)*7`, and the EOS
    system_prompt = None
    chat_template = False
    require_all = True
    partial_credit_for_parsing = True  # no tags to reward: the expression must parse

    def __init__(self, num_train: int = 20_000, num_test: int = 500) -> None:
        rng = random.Random(2468)
        self.test, held_out = [], set()
        while len(self.test) < num_test:
            numbers, target, expression = tiny_draw(rng)
            if (tuple(sorted(numbers)), target) not in held_out:
                held_out.add((tuple(sorted(numbers)), target))
                self.test.append(self.example(numbers, target, expression))
        rng, self.train = random.Random(2469), []
        while len(self.train) < num_train:
            numbers, target, expression = tiny_draw(rng)
            if (tuple(sorted(numbers)), target) not in held_out:
                self.train.append(self.example(numbers, target, expression))

    def prompt(self, numbers: list[int], target: int) -> str:
        return f"{','.join(map(str, numbers))}->{target}:"  # no spaces: Qwen2's tokenizer class drops them

    def answer(self, completion: str) -> str | None:
        return completion.strip()


def tiny_draw(rng: random.Random) -> tuple[list[int], int, str]:
    """Three numbers in [1, 9] and an expression of all three in a random order and shape, redrawn until its value
    is an integer in [1, 100]."""
    while True:
        numbers = [rng.randint(1, 9) for _ in range(3)]
        a, b, c = rng.sample(numbers, 3)
        first, second = rng.choice("+-*/"), rng.choice("+-*/")
        expression = rng.choice((f"{a}{first}{b}{second}{c}", f"({a}{first}{b}){second}{c}",
                                 f"{a}{first}({b}{second}{c})"))
        parsed = parse_expression(expression)
        if parsed and parsed[0].denominator == 1 and 1 <= parsed[0] <= 100:
            return numbers, int(parsed[0]), expression
