"""What every task is: `Example` (one prompt, its reference, its structured fields) and `Task` (a train and a test
list of examples, a `reward` for training, a `correct` for every accuracy, and the settings it needs). Also the data
loading the dataset tasks share: hub ids on users' machines, local files in the same format everywhere, with errors
that name the file and the line."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class TaskError(ValueError):
    """A task's data or settings cannot work; the message says what to change."""


@dataclass(frozen=True)
class Example:
    prompt: str  # the user's message: the text the model continues (before any chat template)
    answer: str  # the reference the scorer checks against ("" where a task checks structure instead)
    data: dict[str, Any] = field(default_factory=dict, compare=False)  # structured fields (numbers, level, ...)


class Environment:
    """The other side of a multi-turn episode. The turn loop (common/episodes.py) makes one per episode
    (`Task.environment`), calls `reset(example)`, then `step(text)` after every model turn with that turn's text
    (decoded from the sampled ids, its final EOS dropped). `step` returns the reply to append (None: nothing more to
    say, the episode ends), the turn's reward (the episode's score is the sum) and whether the episode is over.
    `step` may set `correct` (what the accuracies count; left None, a score of 1 or more is correct) and count what
    happened in `events` under the names of `event_names` (logged as episode/<name>, the mean per episode)."""
    event_names: tuple[str, ...] = ()
    correct: bool | None = None
    events: Counter

    def reset(self, example: Example) -> None:
        self.example = example

    def step(self, text: str) -> tuple[str | None, float, bool]:
        raise NotImplementedError


class Task:
    """Subclass it, fill `train` and `test` in `__init__`, and give `reward` (and `correct` when the reward gives
    partial credit). The class attributes are the settings the task needs; the run stops with a message when its
    arguments cannot meet them. A multi-turn task declares `tools` (or returns its own `environment`); a single-turn
    task does neither."""
    train: list[Example]
    test: list[Example]
    min_completion_length: int = 1  # --max-completion-length below this cannot hold an answer: refused
    chat_template: bool = True  # apply the tokenizer's chat template when it has one
    system_prompt: str | None = None  # a system message before each prompt (as plain text without a template)
    tools: tuple[Callable[..., str], ...] = ()  # functions the model may call (common/tools.py): typed signatures
    # and docstrings, from which a chat template writes the tools' description into the prompt

    def environment(self) -> Environment | None:
        """A fresh environment for one episode; None for a single-turn task. With `tools`, a ToolEnvironment: each
        model turn either calls a tool (the result is the reply) or answers (scored by `score`, the episode ends)."""
        if not self.tools:
            return None
        from common.tools import ToolEnvironment

        return ToolEnvironment(self)

    def reward(self, completion: str, example: Example) -> float:
        """The training signal of one completion (the text after the prompt, the final EOS dropped)."""
        raise NotImplementedError

    def correct(self, completion: str, example: Example) -> bool:
        """Whether the completion solves the problem: what train/accuracy and eval/accuracy count. By default a
        reward of 1 or more; a task whose reward gives partial credit says what correct means."""
        return self.reward(completion, example) >= 1.0

    def score(self, completion: str, example: Example) -> tuple[float, bool]:
        """(reward, correct) of one completion, what training asks for. Override it when both come from one check
        that is costly to run twice (a symbolic verifier)."""
        return self.reward(completion, example), self.correct(completion, example)

    def eval_metrics(self, completion: str, example: Example) -> dict[str, float]:
        """More held-out metrics of one greedy completion (e.g. a lenient accuracy), each averaged over the test
        prompts and logged as eval/<name>. None by default."""
        return {}

    def format_prompt(self, tokenizer: object, example: Example) -> str:
        """The prompt text the model sees: the chat template when the task wants it and the tokenizer has one (so
        instruct models see what they were trained on), else the system prompt (if any) and the prompt."""
        if self.chat_template and getattr(tokenizer, "chat_template", None):
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            messages = [*system, {"role": "user", "content": example.prompt}]
            tools = {"tools": list(self.tools)} if self.tools else {}  # the template describes them
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **tools)
        return f"{self.system_prompt}\n{example.prompt}" if self.system_prompt else example.prompt


class Row(dict):
    """One dataset row, which knows where it came from (file and line, or hub id, split and index)."""

    def __init__(self, values: dict, origin: str) -> None:
        super().__init__(values)
        self.origin = origin

    def need(self, *names: str) -> list[Any]:
        """The values of these fields, or a TaskError naming the row and the fields it has."""
        missing = [name for name in names if name not in self]
        if missing:
            raise TaskError(f"{self.origin}: no field {', '.join(map(repr, missing))} (its fields: {sorted(self)})")
        return [self[name] for name in names]

    def need_text(self, *names: str) -> list[str]:
        """`need`, and each value must be a string."""
        values = self.need(*names)
        for name, value in zip(names, values):
            if not isinstance(value, str):
                raise TaskError(f"{self.origin}: field {name!r} must be text, got {type(value).__name__} {value!r:.40}")
        return values


def last_tagged(text: str, tag: str = "answer") -> str | None:
    """The stripped text inside the last `<tag>...</tag>` (the last opening before the last closing), or None. Two
    searches from the end: linear in the completion, where a regex over many unclosed tags is quadratic."""
    end = text.rfind(f"</{tag}>")
    start = text.rfind(f"<{tag}>", 0, end) if end >= 0 else -1
    return text[start + len(tag) + 2:end].strip() if start >= 0 else None


DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


def is_local(source: str) -> bool:
    return source.startswith(("/", "./", "../", "~")) or Path(source).exists() or Path(source).suffix in \
        DATA_SUFFIXES or "{split}" in source


def local_split_file(source: str, split: str) -> Path:
    """A split's file in a local copy: `source` is a folder (HF's layouts: `train.jsonl`, `test.parquet`,
    `data/train-00000-of-00001.parquet`, ...) or a file name with `{split}` in it (`gsm8k_{split}.jsonl`)."""
    if "{split}" in source:
        path = Path(source.replace("{split}", split)).expanduser()
        if not path.is_file():
            raise TaskError(f"no {split} file {str(path)!r} (from {source!r})")
        return path
    folder = Path(source).expanduser()
    if not folder.is_dir():
        raise TaskError(f"{source!r} is neither a folder nor a file name with {{split}} in it (e.g. "
                        f"data/my_{{split}}.jsonl for data/my_train.jsonl and data/my_test.jsonl)")
    candidates = [path for pattern in (f"{split}{suffix}" for suffix in DATA_SUFFIXES)
                  for path in [folder / pattern, folder / "data" / pattern] if path.is_file()]
    candidates += sorted((folder / "data").glob(f"{split}-*.parquet")) + sorted(folder.glob(f"{split}-*.parquet"))
    if not candidates:
        raise TaskError(f"{source!r} has no {split} file: expected {split}.jsonl, {split}.json or {split}.parquet "
                        f"(there or under data/); it holds {sorted(p.name for p in folder.iterdir())}")
    return candidates[0]


def read_local(path: Path) -> list[Row]:
    """Every row of a JSONL, JSON (a list of objects) or Parquet file; a malformed line is named with its number."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as parquet

        return [Row(row, f"{path} row {i + 1}") for i, row in enumerate(parquet.read_table(path).to_pylist())]
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise TaskError(f"{path}: not UTF-8 text (byte {error.start}: {error.reason})") from None
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as error:
            raise TaskError(f"{path}:{error.lineno}: not valid JSON ({error.msg})") from None
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise TaskError(f"{path} item {i + 1}: a row must be a JSON object, got {type(row).__name__}")
        return [Row(row, f"{path} item {i + 1}") for i, row in enumerate(rows)]
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise TaskError(f"{path}:{number}: not a JSON object ({error.msg}): {line[:80]!r}") from None
        if not isinstance(row, dict):
            raise TaskError(f"{path}:{number}: a row must be a JSON object, got {type(row).__name__}")
        rows.append(Row(row, f"{path}:{number}"))
    return rows


def load_split(source: str, split: str, hub_config: str | None = None) -> list[Row]:
    """The rows of one split: from a local copy (see `local_split_file`) or from the hub (`datasets`)."""
    if is_local(source):
        return read_local(local_split_file(source, split))
    from datasets import load_dataset

    data = load_dataset(source, hub_config, split=split) if hub_config else load_dataset(source, split=split)
    return [Row(row, f"{source} ({split}) row {i + 1}") for i, row in enumerate(data)]
