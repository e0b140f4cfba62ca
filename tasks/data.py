"""Dataset files for the tasks that read one: a hub id on a user's machine (`datasets`), or a local copy in the same
format anywhere (JSONL, JSON or Parquet, in HF's folder layouts), with errors that name the file and the line."""

import json
from pathlib import Path
from typing import Any

from tasks.base import TaskError


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
