"""Checkpoints (common/checkpoint.py): a save is published whole or not at all (a temporary directory renamed, then
the `latest` pointer), `--keep-last` prunes the oldest, and an incomplete directory is never resumed from. Faults
across ranks (a damaged file, a failed write, a full disk): tests/test_faults.py and tests/test_preemption.py."""

from pathlib import Path

import pytest
import torch

from common.checkpoint import resolve_checkpoint, save_checkpoint


def write_state(value: int):
    def write(path: Path) -> None:
        torch.save({"value": value}, path / "trainer_state.pt")
    return write


def test_checkpoint_publish_and_keep_last(tmp_path: Path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, write_state(step), keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    assert torch.load(resolve_checkpoint(str(tmp_path)) / "trainer_state.pt")["value"] == 3
    assert resolve_checkpoint(str(tmp_path / "latest")).name == "step_00000003"  # the pointer file itself


def test_interrupted_save_leaves_latest_checkpoint_intact(tmp_path: Path):
    save_checkpoint(tmp_path, 1, write_state(1), keep_last=0)

    def crash(path: Path) -> None:
        (path / "trainer_state.pt").write_bytes(b"half a file")
        raise KeyboardInterrupt  # a kill in the middle of writing

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, crash, keep_last=0)
    assert not (tmp_path / "step_00000002").exists()
    assert resolve_checkpoint(str(tmp_path)).name == "step_00000001"
    assert torch.load(resolve_checkpoint(str(tmp_path)) / "trainer_state.pt")["value"] == 1
    save_checkpoint(tmp_path, 2, write_state(2), keep_last=0)  # the next save cleans the leftover temporary directory
    assert not list(tmp_path.glob(".*.tmp"))


def test_resolve_checkpoint_rejects_incomplete(tmp_path: Path):
    (tmp_path / "step_00000001").mkdir()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resolve_checkpoint(str(tmp_path / "step_00000001"))
