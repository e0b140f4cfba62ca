"""common/: checkpoints, fingerprints, per-sample seeds, tasks, and the transformers rollout engine."""

from pathlib import Path

import pytest
import torch
from conftest import ROOT

from common.checkpoint import resolve_checkpoint, save_checkpoint
from common.determinism import parameter_hash
from common.llm.engines import HFEngine, sample_seed
from tasks import AdditionTask, Example, GSM8KTask, gsm8k_flexible, gsm8k_strict, make_task

TINY = str(ROOT / "assets" / "tiny-adder")


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


def test_parameter_hash_sees_one_flipped_bit():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    before = parameter_hash(model)
    assert parameter_hash(model) == before
    with torch.no_grad():
        model.weight.view(-1).view(torch.int32)[5] ^= 1  # the lowest mantissa bit of one weight
    assert parameter_hash(model) != before


def test_sample_seed_depends_on_every_coordinate():
    base = sample_seed(1, 2, 3, 4)
    assert base == sample_seed(1, 2, 3, 4)
    assert len({base, sample_seed(2, 2, 3, 4), sample_seed(1, 3, 3, 4), sample_seed(1, 2, 4, 4),
                sample_seed(1, 2, 3, 5)}) == 5
    many = [sample_seed(1, 1, p, 0) for p in range(100)]
    assert all(0 <= s < 2**63 for s in many) and max(many) >= 2**62  # all 63 bits in use, not 31


def test_addition_task_held_out_split():
    task = AdditionTask(num_train=2000, num_test=100)
    assert not {e.prompt for e in task.test} & {e.prompt for e in task.train}
    example = Example("12+30=", "42")
    assert task.reward("42", example) == 1.0 and task.reward(" 42 ", example) == 1.0
    assert task.reward("43", example) == 0.0 and task.reward("4", example) == 0.0


def test_gsm8k_extraction_strict_and_flexible():
    text = "She pays 3 * $1,200 = $3,600.\n#### 3,600"
    assert gsm8k_strict(text) == "3600" and gsm8k_flexible(text) == "3600"
    assert gsm8k_strict("so the answer is 72") is None and gsm8k_flexible("so the answer is 72.") == "72"
    task = GSM8KTask.__new__(GSM8KTask)  # no download: only the reward functions
    example = Example("q", "72")
    assert task.reward("... #### 72", example) == 1.0 and task.reward("the answer is 72", example) == 0.0
    assert task.flexible_reward("the answer is 72", example) == 1.0


def test_gsm8k_task_from_a_local_copy(tmp_path: Path):
    import json

    rows = [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
            {"question": "A box holds 1,200 pens. How many in 2 boxes?", "answer": "2 * 1200 = 2400\n#### 2,400"}]
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    task = make_task(f"gsm8k:{tmp_path}")
    assert [e.answer for e in task.test] == ["7", "2400"]
    assert task.train[0].prompt.startswith("Tom has 3 apples") and task.train[0].prompt.endswith('after "####".')
    assert task.reward("so 2,400 pens\n#### 2,400", task.test[1]) == 1.0
    boxed = r"so it is \boxed{2400}"  # lenient (math-verify) finds it; strict (`#### N`) does not
    assert task.eval_metrics(boxed, task.test[1]) == {"accuracy_flexible": 1.0, "accuracy_lenient": 1.0}
    assert not task.correct(boxed, task.test[1]) and task.eval_metrics("2400 or 2500", task.test[1]) == {
        "accuracy_flexible": 0.0, "accuracy_lenient": 0.0}
    assert task.eval_metrics("so it is \\boxed{2400}", task.test[1]) == {"accuracy_flexible": 1.0,
                                                                          "accuracy_lenient": 1.0}
    assert not task.correct("so it is \\boxed{2400}", task.test[1])  # strict: only `#### N` counts


def test_hf_engine_samples_do_not_depend_on_batch_mates():
    engine = HFEngine(TINY, torch.float32, torch.device("cpu"))
    prompts = [[3, 4, 12, 5, 13], [6, 12, 7, 8, 13], [9, 10, 11, 12, 4, 13]]
    together = engine.generate(prompts, [11, 22, 33], max_tokens=6, temperature=1.0, eos_ids=[1])
    alone = engine.generate(prompts[1:2], [22], max_tokens=6, temperature=1.0, eos_ids=[1])
    assert together[1].completion_ids == alone[0].completion_ids
    # another batch shape rounds the float32 matmuls otherwise: measured 1.2e-6 on logprobs up to 3 in size
    torch.testing.assert_close(torch.tensor(together[1].logprobs), torch.tensor(alone[0].logprobs), atol=1e-4, rtol=0)
    # negative control: other seeds for the same prompt give other samples
    reseeded = engine.generate(prompts[1:2] * 16, list(range(16)), max_tokens=6, temperature=2.0, eos_ids=[1])
    assert len({tuple(s.completion_ids) for s in reseeded}) > 4


def test_addition_held_out_excludes_commutative_twins():
    """No test prompt `a+b=` has its twin `b+a=` (nor itself) in the training stream of the default task."""
    import random

    from tasks import addition_examples

    task = AdditionTask()
    train = {example.prompt for example in task.train}
    twins = {"{1}+{0}=".format(*example.prompt.removesuffix("=").split("+")) for example in task.test}
    assert len(task.train) == 100_000 and not twins & train and not {example.prompt for example in task.test} & train
    # negative control: the same random stream, filtered by exact prompt only, would have leaked twins
    raw = {example.prompt for example in addition_examples(len(task.train), task.digits, random.Random(1234 + 1))}
    assert len(twins & raw - {example.prompt for example in task.test}) > 10


def test_manifest_lock_record_picks_the_matching_lock_and_names_what_differs(tmp_path: Path, monkeypatch):
    """The manifest's `lock` entry: the lock file the installed packages match best, its sha256, and every pinned
    package installed at another version (or missing)."""
    import hashlib
    import importlib.metadata

    from common import tracking

    torch_version, numpy_version = importlib.metadata.version("torch"), importlib.metadata.version("numpy")
    (tmp_path / "requirements-a.lock.txt").write_text(f"# a comment\ntorch=={torch_version}\nNumPy==0.0.1\n")
    (tmp_path / "requirements-b.lock.txt").write_text(f"torch=={torch_version}\nnumpy=={numpy_version}\n"
                                                      "no-such-package==1.0\n")
    (tmp_path / "requirements-c.lock.txt").write_text(f"torch=={torch_version}\nnumpy=={numpy_version}\n")
    monkeypatch.setattr(tracking, "ROOT", tmp_path)
    record = tracking._lock()
    assert record["file"] == "requirements-c.lock.txt" and record["differs"] == []
    assert record["sha256"] == hashlib.sha256((tmp_path / "requirements-c.lock.txt").read_bytes()).hexdigest()
    (tmp_path / "requirements-c.lock.txt").unlink()
    record = tracking._lock()  # a and b each differ in one package: the first of equals wins
    assert record["file"] == "requirements-a.lock.txt"
    assert record["differs"] == [f"numpy==0.0.1 (installed: {numpy_version})"]


def test_the_locks_pair_torch_with_its_own_torchvision_and_torchaudio():
    """torch 2.N pairs with torchvision 0.(N+15) and torchaudio 2.N of the same patch release; a lock holding another
    pair installs wheels built against another torch (the GPU lock once held torchaudio 2.11.0 beside torch 2.13.0)."""
    root = Path(__file__).resolve().parent.parent
    for lock in ("requirements-gpu.lock.txt", "requirements-cpu.lock.txt"):
        pins = dict(line.split("==", 1) for line in (root / lock).read_text().splitlines()
                    if "==" in line and not line.startswith("#"))
        torch_version = pins["torch"].split("+")[0]
        major, minor, patch = map(int, torch_version.split("."))
        if "torchvision" in pins:
            assert pins["torchvision"].split("+")[0] == f"0.{minor + 15}.{patch}", (lock, pins["torchvision"])
        if "torchaudio" in pins:
            assert pins["torchaudio"].split("+")[0] == torch_version, (lock, pins["torchaudio"])


def test_the_open_file_limit_is_raised_to_the_hard_one():
    """Run in a child whose soft limit starts at 256: after raise_open_file_limit it is the hard limit, and both the
    starting and the raised values are kept for the manifest."""
    import subprocess
    import sys

    probe = ("import resource, sys\nsys.path.insert(0, sys.argv[1])\n"
             "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
             "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
             "from common.distributed import open_file_limits, raise_open_file_limit\nraise_open_file_limit()\n"
             "print(open_file_limits() == {'soft_at_start': 256, 'soft': hard, 'hard': hard},"
             " resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard)")
    root = str(Path(__file__).resolve().parent.parent)
    result = subprocess.run([sys.executable, "-c", probe, root], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "True True", result.stderr[-2000:]
