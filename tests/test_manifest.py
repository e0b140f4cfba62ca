"""What manifest.json records of the install and the machine (common/tracking.py, common/distributed.py): the lock
file the installed packages match and every pin they differ from, the locks themselves pairing torch with its own
torchvision and torchaudio, and the open-file limit, raised to the hard one with both values kept."""

from pathlib import Path


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
