"""reasoning-gym (Stojanovski et al., "Reasoning Gym", arXiv:2505.24760): 100+ seeded generators of reasoning
problems, each with its own scorer, offline. `--task reasoning_gym:<dataset>`, e.g. `reasoning_gym:basic_arithmetic`
or `reasoning_gym:countdown`, with the dataset's default configuration."""

from __future__ import annotations

import difflib
import os

from tasks.base import Example, Task, TaskError, last_tagged

# Problem i of a dataset is drawn from Random(seed + i), so the two seed ranges must not meet: train uses the seeds
# 1 .. 10,000, test 1,000,000 .. 1,000,499.
TRAIN_SIZE = 10_000  # the dataset size of reasoning-gym's own GRPO configs (training/configs/*.yaml)
TRAIN_SEED = 1
TEST_SIZE = 500  # reasoning-gym's default dataset size
TEST_SEED = 1_000_000

# Datasets whose problems depend on Python's string hashing (they draw from sets of strings): without a fixed
# PYTHONHASHSEED every rank, and every resume, would see other problems. Found by generating 5 and 40 problems of
# every dataset of reasoning-gym 0.1.25 under PYTHONHASHSEED 1, 2 and 3 (another dataset may still depend on it in
# problems not drawn there).
HASH_DEPENDENT = frozenset({"intermediate_integration", "isomorphic_strings", "knight_swap", "list_functions",
                            "polynomial_multiplication", "ransom_note", "word_ladder"})
# Datasets that cannot work from their default configuration
NEEDS_CONFIG = {"composite": "it mixes other datasets named in its configuration; pick one dataset instead"}
# Datasets whose problems differ from process to process even with a fixed PYTHONHASHSEED (found as above)
NONDETERMINISTIC = {"codeio": "it runs code samples to make its problems, and their outputs change from run to run"}
# Datasets whose scorer raises on an answer a model will write: the first such completion would stop the run
RAISING_SCORERS = {"prime_factorization": "reasoning-gym 0.1.25's scorer raises ValueError on a non-numeric factor"}


class ReasoningGymTask(Task):
    """One reasoning-gym dataset in its default configuration. The train set is its first `num_train` problems from
    seed TRAIN_SEED, less any whose question is also in the test set; the test set is its first `num_test` problems
    from seed TEST_SEED (a repeated question kept once). The problems never depend on --seed (only the order in which
    training draws them does). `--task` gives the constants' sizes (the arguments are for tests; a smaller `num_test`
    gives a prefix of the same test set). Every rank makes them at start-up, on one core: from under a second
    (basic_arithmetic) to minutes (countdown, about 0.02 s a problem) or an hour (knight_swap, futoshiki, 0.3-0.4 s).

    The system prompt is reasoning-gym's default (think step by step, then the answer inside <answer></answer>). The
    reward is the dataset's own `score_answer` on the last <answer>...</answer> of the completion (`last_tagged`:
    what reasoning-gym's `extract_answer` reads, in linear time; None when there is none), so it gives the partial
    credit the dataset gives (countdown: 0.05 for a wrong expression, 0.01 for none). Correct means a reward of
    exactly 1.0, the dataset's full marks. A scorer that raises is not caught: the run stops with the prompt and the
    completion (so prime_factorization, whose scorer raises on a non-numeric answer, is refused). Held out, also
    eval/reward (the mean partial-credit reward) and eval/answer_tags (the share of completions with an answer in
    tags). Scorers that parse the answer with sympy (countdown's) run it on model text: see docs/tasks.md, "The
    registered tasks"."""

    def __init__(self, dataset: str, num_train: int = TRAIN_SIZE, num_test: int = TEST_SIZE) -> None:
        try:
            import reasoning_gym
            from reasoning_gym.utils import SYSTEM_PROMPTS
        except ImportError as error:
            raise TaskError(f"task reasoning_gym needs the reasoning-gym package ({error}): pip install "
                            "reasoning-gym==0.1.25") from error
        names = sorted(reasoning_gym.factory.DATASETS)
        if dataset not in names:
            close = difflib.get_close_matches(dataset, names, n=5, cutoff=0.5)
            some = close or ["basic_arithmetic", "chain_sum", "countdown", "gsm_symbolic", "leg_counting"]
            raise TaskError(f"unknown reasoning-gym dataset {dataset!r}; {'close' if close else 'some'}: "
                            f"{', '.join(some)} ({len(names)} in all: python -c \"import reasoning_gym; "
                            "print(sorted(reasoning_gym.factory.DATASETS))\")")
        if dataset in NEEDS_CONFIG:
            raise TaskError(f"reasoning-gym dataset {dataset!r} needs a configuration: {NEEDS_CONFIG[dataset]}")
        if dataset in RAISING_SCORERS:
            raise TaskError(f"reasoning-gym's {dataset!r} cannot train: {RAISING_SCORERS[dataset]}")
        if dataset in NONDETERMINISTIC:
            raise TaskError(f"reasoning-gym's {dataset!r} gives other problems in every process (each rank, each "
                            f"resume): {NONDETERMINISTIC[dataset]}")
        if dataset in HASH_DEPENDENT and not os.environ.get("PYTHONHASHSEED", "").isdigit():
            raise TaskError(f"reasoning-gym's {dataset!r} draws its problems from sets of strings, so they change "
                            "with Python's hash seed: every rank and every resume would see other problems. Fix the "
                            f"seed: PYTHONHASHSEED=0 <your command> --task reasoning_gym:{dataset}")
        self.dataset = dataset
        self.system_prompt = SYSTEM_PROMPTS["default"]
        test_set = reasoning_gym.create_dataset(dataset, size=num_test, seed=TEST_SEED)
        self.test, held_out = [], set()
        for entry in test_set:
            if entry["question"] not in held_out:
                held_out.add(entry["question"])
                self.test.append(self.example(entry))
        train_set = reasoning_gym.create_dataset(dataset, size=num_train, seed=TRAIN_SEED)
        self.train = [self.example(entry) for entry in train_set if entry["question"] not in held_out]
        if not self.train:
            raise TaskError(f"every training problem of reasoning-gym's {dataset!r} is also in its test set")
        self.score_answer = test_set.score_answer  # the scorer reads only the entry, not the dataset's seed or size
        # the <answer></answer> tags (about 8 tokens) around the longest reference, at about 4 characters a token (an
        # estimate on the low side: it only refuses budgets that cannot hold an answer); at least a short reasoning
        longest = max(len(example.answer) for example in self.train + self.test)
        self.min_completion_length = max(32, 8 + longest // 4)

    @staticmethod
    def example(entry: dict) -> Example:
        answer = entry["answer"]  # None for datasets with many right answers (rubiks_cube): the scorer checks them
        return Example(prompt=entry["question"], answer="" if answer is None else str(answer), data=entry)

    def reward(self, completion: str, example: Example) -> float:
        return float(self.score_answer(last_tagged(completion), example.data))

    def correct(self, completion: str, example: Example) -> bool:
        return self.reward(completion, example) == 1.0

    def score(self, completion: str, example: Example) -> tuple[float, bool]:
        reward = self.reward(completion, example)  # one call of the dataset's scorer for both
        return reward, reward == 1.0

    def eval_metrics(self, completion: str, example: Example) -> dict[str, float]:
        return {"reward": self.reward(completion, example), "answer_tags": float(last_tagged(completion) is not None)}
