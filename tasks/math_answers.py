"""Competition math: MATH (train) / MATH-500 (test) with `\\boxed{}` answers, and DAPO-Math-17k (train) / AIME 2024
(test) with DAPO's `Answer:` line. Scored strictly (the answer where the prompt asked for it) for the reward and every
accuracy, and leniently (math-verify on the whole completion) as `eval/accuracy_lenient`.

math-verify (Hugging Face) does the symbolic comparison. Its known traps and what we do about them:

- An unparsable gold answer. `parse` of a gold it cannot read gives `[]` or only a raw string; reward code that skips
  such golds with a reward of 1 (huggingface/cookbook#335, open-r1's early `accuracy_reward`) pays every completion.
  Here a gold without a single sympy candidate is never correct, whatever the completion.
- Several candidates (dhcode-cpp/X-R1#53). `parse` returns the parsed sympy object AND a fallback string, e.g.
  `parse("$\\frac{1}{2}$") == [Rational(1, 2), "\\frac{1}{2}"]`; `verify(gold, pred)` is True when ANY pair of the
  product gold x pred matches, where sympy-vs-sympy is the symbolic/numeric test, str-vs-str is plain equality of the
  stripped, non-empty strings, and mixed pairs never match. So two unparsable strings that are equal (a malformed gold
  copied into the completion) count as correct. We drop the string candidates on both sides before `verify`: only
  sympy-vs-sympy pairs can make an answer correct.
- Timeouts by `signal.alarm`, which works in the main thread only (elsewhere math-verify raises ValueError). Our
  rewards run in each process's main thread, with a timeout; from any other thread the timeouts are switched off
  (`parsing_timeout=None`, `timeout_seconds=None`), so a call from a worker thread works but is not time-limited.
- Exceptions: anything math-verify raises (or a timeout escaping it) means "not correct", never a crash.

math_verify is imported on first use, so importing the task package stays fast."""

from __future__ import annotations

import re
import threading
from functools import lru_cache
from typing import Any

from tasks.base import Example, Task, TaskError
from tasks.data import Row, load_split

PARSE_TIMEOUT_S = 5  # math-verify's defaults, per parse and per comparison (main thread only, see above)
VERIFY_TIMEOUT_S = 5

# ---------------------------------------------------------------------------------------------------------------------
# Answer extraction and comparison
# ---------------------------------------------------------------------------------------------------------------------

BOX_OPENING = re.compile(r"\\(?:boxed|fbox)\s*\{|\\boxed\s+(?=[^\s{$])")


def boxed_answer(text: str) -> str | None:
    """The content of the last `\\boxed{...}` or `\\fbox{...}` (braces matched, `\\{` and `\\}` skipped), or of the
    last `\\boxed x` (one token: up to a space or `$`, a sentence's final `.` or `,` dropped). None when there is no
    box or the last one never closes (a completion cut off inside its answer)."""
    openings = list(BOX_OPENING.finditer(text))
    if not openings:
        return None
    opening = openings[-1]
    start = opening.end()
    if not opening.group().endswith("{"):
        token = re.match(r"[^\s$]+", text[start:]).group()
        return token.rstrip(".,")
    depth, i = 1, start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # an escaped character (`\{`, `\}`, `\\`) never opens or closes a group
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def _timeouts() -> tuple[int | None, int | None]:
    """(parse, verify) timeouts: math-verify's signal alarm where it works (the main thread), none elsewhere."""
    if threading.current_thread() is threading.main_thread():
        return PARSE_TIMEOUT_S, VERIFY_TIMEOUT_S
    return None, None


def _parse(text: str) -> list[Any]:
    """math-verify's parse with its default extraction (LaTeX incl. `\\boxed{}`, then plain expressions; the last
    match), keeping only the sympy candidates; [] when it fails in any way."""
    from math_verify import parse
    from math_verify.errors import TimeoutException

    try:
        candidates = parse(text, parsing_timeout=_timeouts()[0])
    except (Exception, TimeoutException):
        return []
    return [candidate for candidate in candidates if not isinstance(candidate, str)]


@lru_cache(maxsize=8192)
def _gold_candidates(gold: str) -> tuple[Any, ...]:
    """The sympy candidates of a gold answer read as LaTeX math (cached: every sample of a prompt has the same)."""
    return tuple(_parse(f"${gold.strip()}$")) if gold.strip() else ()


def same_answer(gold: list[Any] | tuple[Any, ...], pred: list[Any] | tuple[Any, ...]) -> bool:
    """math-verify's `verify` on the sympy candidates only (strings dropped from both lists, see the module
    docstring); False when the gold has none, when verify raises, or when it times out."""
    from math_verify import verify
    from math_verify.errors import TimeoutException

    gold = [candidate for candidate in gold if not isinstance(candidate, str)]
    pred = [candidate for candidate in pred if not isinstance(candidate, str)]
    if not gold or not pred:
        return False
    try:
        return bool(verify(gold, pred, timeout_seconds=_timeouts()[1]))
    except (Exception, TimeoutException):
        return False


def strict_correct(completion: str, gold: str) -> bool:
    """The last boxed answer of the completion equals the gold (both read as LaTeX math by math-verify). No box, an
    empty or unclosed box, or a gold math-verify cannot parse: False."""
    answer = boxed_answer(completion)
    if answer is None or not answer.strip():
        return False
    return same_answer(_gold_candidates(gold), _parse(f"${answer.strip()}$"))


def lenient_correct(completion: str, gold: str) -> bool:
    """math-verify's default extraction from the whole completion (a `\\boxed{}`, an "answer is" phrase, or the last
    LaTeX or plain expression) equals the gold, as TRL and open-r1 score. An unparsable gold: False. Measured with
    math-verify 0.9: several boxes are read together as a set (`\\boxed{3} ... \\boxed{5}` is {3, 5}: right for
    gold "3, 5", wrong for "5"), and an unclosed last box is still read."""
    if not completion.strip():
        return False
    return same_answer(_gold_candidates(gold), _parse(completion))


# DAPO's answer format: the last line `Answer: <answer>`; its scorer (verl's math_dapo.py) reads only the last 300
# characters, takes the text after the last "Answer:" on its line, normalizes it and compares strings.
DAPO_TAIL_CHARS = 300
ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)


def normalize_dapo_answer(text: str) -> str:
    """An answer in a canonical form for string comparison: `$`, `**`, `\\boxed{}`, `\\text{}` and LaTeX spacing
    unwrapped, whitespace and a final period dropped, and integers (`1,000`, `073`, `+5`) written plainly. Units are
    NOT stripped (DAPO's Minerva normalization drops a list of unit words; `34 degrees` is wrong here, lenient is
    where such answers count)."""
    text = text.strip()
    boxed = boxed_answer(text)
    if boxed is not None:
        text = boxed
    text = re.sub(r"\\(?:text|textbf|mathrm)\{([^{}]*)\}", r"\1", text)
    text = text.replace("\\$", "").replace("$", "").replace("*", "").replace("{,}", ",")
    text = re.sub(r"\\[,!;: ]", "", text)
    text = re.sub(r"\s+", "", text).rstrip(".")
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+", text):
        text = text.replace(",", "")
    if re.fullmatch(r"[-+]?\d+", text):
        text = str(int(text))
    return text


def dapo_answer(completion: str) -> str | None:
    """The normalized text after the last `Answer:` in the completion's last 300 characters (DAPO's window), or
    None when there is none."""
    matches = ANSWER_LINE.findall(completion[-DAPO_TAIL_CHARS:])
    return normalize_dapo_answer(matches[-1]) if matches else None


def dapo_correct(completion: str, gold: str) -> bool:
    """DAPO's strict check: the `Answer:` line equals the gold after the same normalization (so `073` == `73`)."""
    answer = dapo_answer(completion)
    return bool(answer) and answer == normalize_dapo_answer(gold)


# ---------------------------------------------------------------------------------------------------------------------
# MATH / MATH-500
# ---------------------------------------------------------------------------------------------------------------------

MATH_HUB_ID = "EleutherAI/hendrycks_math"
MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
                 "prealgebra", "precalculus")  # its configs, concatenated in this order (7,500 train problems)
MATH500_HUB_ID = "HuggingFaceH4/MATH-500"
# Qwen2.5-Math's chain-of-thought instruction (its README puts it in the system message; we append it to the problem
# so that models without a chat template see it too).
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def math_level(value: Any) -> int | None:
    """MATH's `Level 5` or MATH-500's 5 as 5; `Level ?` (a few MATH problems) or nothing as None."""
    match = re.fullmatch(r"(?:Level\s*)?(\d+)", str(value).strip()) if value is not None else None
    return int(match.group(1)) if match else None


class MathTask(Task):
    """MATH (Hendrycks et al., "Measuring Mathematical Problem Solving With the MATH Dataset", arXiv:2103.03874):
    train on its 7,500 training problems (`EleutherAI/hendrycks_math`, one config per subject, fields `problem`,
    `level` ("Level 3"), `type` (the subject), `solution`; the gold is the solution's last `\\boxed{}`), test on
    MATH-500 (`HuggingFaceH4/MATH-500`, split `test`: `problem`, `solution`, `answer`, `subject`, `level` (int),
    `unique_id`), the 500 test problems of Lightman et al. ("Let's Verify Step by Step"), disjoint from the train set.

    A local `source` (a folder with train/test files, or a `{split}` file name) gives both splits; a row in either
    format works in either split (the gold is `answer` when present, else the solution's last box).

    The prompt asks for a `\\boxed{}` answer. Reward 1 when `strict_correct` (the last box equals the gold under
    math-verify), else 0; `correct` is the same check; `eval/accuracy_lenient` is math-verify on the whole
    completion."""
    min_completion_length = 256  # step-by-step solutions take a few hundred tokens before the box

    def __init__(self, source: str | None = None) -> None:
        if source is None:
            train_rows = [row for subject in MATH_SUBJECTS for row in load_split(MATH_HUB_ID, "train", subject)]
            test_rows = load_split(MATH500_HUB_ID, "test")
        else:
            train_rows, test_rows = load_split(source, "train"), load_split(source, "test")
        self.train = [self.example(row) for row in train_rows]
        self.test = [self.example(row) for row in test_rows]

    @staticmethod
    def example(row: Row) -> Example:
        (problem,) = row.need_text("problem")
        answer = row.get("answer")
        if answer is None or not str(answer).strip():
            solution = row.get("solution")
            answer = boxed_answer(solution) if isinstance(solution, str) else None
        if answer is None or not str(answer).strip():
            raise TaskError(f"{row.origin}: no answer: neither an 'answer' field nor a closed \\boxed{{}} in "
                            f"'solution' (its fields: {sorted(row)})")
        return Example(prompt=f"{problem}\n{BOXED_INSTRUCTION}", answer=str(answer).strip(),
                       data={"level": math_level(row.get("level")), "subject": row.get("subject", row.get("type"))})

    def reward(self, completion: str, example: Example) -> float:
        return float(strict_correct(completion, example.answer))

    def correct(self, completion: str, example: Example) -> bool:
        return strict_correct(completion, example.answer)

    def score(self, completion: str, example: Example) -> tuple[float, bool]:
        right = strict_correct(completion, example.answer)  # one math-verify check for both
        return float(right), right

    def eval_metrics(self, completion: str, example: Example) -> dict[str, float]:
        return {"accuracy_lenient": float(lenient_correct(completion, example.answer))}


# ---------------------------------------------------------------------------------------------------------------------
# DAPO-Math-17k / AIME 2024
# ---------------------------------------------------------------------------------------------------------------------

DAPO_HUB_ID = "BytedTsinghua-SIA/DAPO-Math-17k"
AIME_HUB_ID = "HuggingFaceH4/aime_2024"  # one split, `train`: the 30 problems of AIME I and II 2024
# DAPO's instruction around each problem, verbatim from its data (the AIME prompts must read like the training ones).
DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.")
DAPO_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'


def dapo_prompt(problem: str) -> str:
    return f"{DAPO_PREFIX}\n\n{problem.strip()}\n\n{DAPO_SUFFIX}"


def dapo_hub_rows(hub_id: str = DAPO_HUB_ID) -> list[Row]:
    """The hub's DAPO-Math-17k holds each of its ~17.4k problems about a hundred times (1.79M rows). Keep the first
    row of each prompt, found on the Arrow column, so the copies never become Python objects (GBs on every rank)."""
    import pyarrow.compute as pc
    from datasets import load_dataset

    data = load_dataset(hub_id, split="train")
    texts = pc.struct_field(pc.list_element(data.data.column("prompt"), 0), "content")
    seen: set[str] = set()
    keep: list[int] = []
    index = 0
    for chunk in texts.chunks:
        for text in chunk.to_pylist():
            if text not in seen:
                seen.add(text)
                keep.append(index)
            index += 1
    return [Row(row, f"{hub_id} (train) row {i + 1}") for i, row in zip(keep, data.select(keep))]


class DapoMathTask(Task):
    """DAPO (Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", arXiv:2503.14476): train
    on DAPO-Math-17k (`BytedTsinghua-SIA/DAPO-Math-17k`: `prompt` a list of chat messages whose user message already
    wraps the problem in DAPO's "...The last line of your response should be of the form Answer: $Answer..."
    instruction, `reward_model` = {"ground_truth": an integer as a string, "style"}, `data_source`, `ability`,
    `extra_info` = {"index"}; duplicated rows are dropped, the first of each prompt kept), test on AIME 2024
    (`HuggingFaceH4/aime_2024`: `id`, `problem`, `solution`, `answer` (an integer 0-999 as a string), `url`, `year`;
    each problem wrapped in the same DAPO instruction).

    A local `source` gives both splits: train rows in the DAPO format, test rows in the AIME format (either format
    works in either split).

    Correct (DAPO's own check): the `Answer:` line, normalized, equals the gold; reward 1 when correct, else 0.
    DAPO's paper rewards 1 / -1; with group-normalized advantages ((r - mean) / std, our GRPO default) the two give
    the same advantages, and 1 / 0 keeps the reward equal to the accuracy as in every other task (without the std
    division 1 / -1 would only double the advantage, i.e. the step size). `eval/accuracy_lenient`: math-verify on the
    whole completion (a `\\boxed{}` counts there). Papers report AIME as the mean accuracy over 32 samples per problem
    (avg@32): the evaluation offers `--eval-samples` for that; 30 greedy answers are a noisy number."""
    min_completion_length = 256  # room for some reasoning and the `Answer:` line (DAPO itself samples up to 20k)

    def __init__(self, source: str | None = None) -> None:
        if source is None:
            train_rows, test_rows = dapo_hub_rows(), load_split(AIME_HUB_ID, "train")
        else:
            train_rows, test_rows = load_split(source, "train"), load_split(source, "test")
        train, seen = [], set()
        for row in train_rows:
            example = self.example(row)
            if example.prompt not in seen:
                seen.add(example.prompt)
                train.append(example)
        self.train = train
        self.test = [self.example(row) for row in test_rows]

    @staticmethod
    def example(row: Row) -> Example:
        """A DAPO row (`prompt` messages or text, `reward_model.ground_truth`) or an AIME row (`problem`, `answer`)."""
        if "prompt" in row:
            prompt, reward_model = row.need("prompt", "reward_model")
            if isinstance(prompt, list):
                users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
                prompt = users[-1] if users else None
            answer = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
            if not (isinstance(prompt, str) and prompt.strip()):
                raise TaskError(f"{row.origin}: 'prompt' must be text or chat messages with a user message")
            extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
            data = {"source": row.get("data_source"), "index": extra.get("index")}
        else:
            problem, answer = row.need("problem", "answer")
            prompt, data = dapo_prompt(str(problem)), {"id": row.get("id")}
        if answer is None or not str(answer).strip():
            raise TaskError(f"{row.origin}: no answer: 'reward_model.ground_truth' or 'answer' is missing or empty "
                            f"(its fields: {sorted(row)})")
        return Example(prompt=prompt, answer=str(answer).strip(), data=data)

    def reward(self, completion: str, example: Example) -> float:
        return float(dapo_correct(completion, example.answer))

    def correct(self, completion: str, example: Example) -> bool:
        return dapo_correct(completion, example.answer)

    def score(self, completion: str, example: Example) -> tuple[float, bool]:
        right = dapo_correct(completion, example.answer)
        return float(right), right

    def eval_metrics(self, completion: str, example: Example) -> dict[str, float]:
        return {"accuracy_lenient": float(lenient_correct(completion, example.answer))}
