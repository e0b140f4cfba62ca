"""A local OpenEnv server for an environment class, in a process of its own that the trainer starts and stops
(`--task openenv:my_env.py:MyEnvironment`): openenv-core's own HTTP/WebSocket app (`create_fastapi_app`) under
uvicorn, serving as many sessions at once as the rank runs episodes.

One server per rank: no port, readiness or lifetime is shared between processes (a server shared by a node's ranks
would need one rank to start it, the others to wait, and the last to stop it, and a preempted rank could take it from
the others), and each rank's capacity is its own. The port: the trainer binds a socket to port 0 on 127.0.0.1 and
hands the bound socket to the server (uvicorn's `fd`), so no other process can take the port in between. Readiness:
`/health` answers within --env-time-limit-s, else the start is refused with the server's own output. Cleanup: the
trainer stops the server's process group at exit (SIGTERM, then SIGKILL after 5 s), and the server stops itself when
its trainer dies without that (Linux's parent-death signal), so a failed, stopped or preempted rank leaves none behind.

    python -m tasks.openenv_launch path/to/my_env.py:MyEnvironment --fd N --sessions K --parent PID
"""

import argparse
import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import typing
import urllib.request
from pathlib import Path

from tasks.base import TaskError
from tasks.loading import user_class

ROOT = Path(__file__).resolve().parent.parent


def action_and_observation(cls: type) -> tuple[type, type]:
    """The action and observation classes of an OpenEnv environment class: the first two type arguments of its
    `Environment[Action, Observation, State]` base, else `step`'s annotations; TaskError when neither says."""
    from openenv.core.env_server.types import Action, Observation

    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            arguments = typing.get_args(base)
            if len(arguments) >= 2 and all(isinstance(a, type) for a in arguments[:2]) and issubclass(
                    arguments[0], Action) and issubclass(arguments[1], Observation):
                return arguments[0], arguments[1]
    try:
        hints = typing.get_type_hints(cls.step)
        action = next(hint for name, hint in hints.items() if name not in ("return", "timeout_s"))
        if issubclass(action, Action) and issubclass(hints["return"], Observation):
            return action, hints["return"]
    except (Exception, StopIteration):  # unannotated or unresolvable: the message below says what to write
        pass
    raise TaskError(f"cannot tell the action and observation classes of {cls.__name__}: declare it as "
                    f"class {cls.__name__}(Environment[MyAction, MyObservation, State])")


def check_environment_class(cls: object, spec: str, sessions: int, explanation: str) -> None:
    """An OpenEnv Environment subclass that can serve `sessions` at once, or TaskError saying why not."""
    from openenv.core.env_server.interfaces import Environment

    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise TaskError(f"{spec!r} is not an OpenEnv environment class (a subclass of "
                        "openenv.core.env_server.interfaces.Environment); a running server is named by its URL, "
                        "--task openenv:http://host:port")
    action_and_observation(cls)
    if sessions > 1 and not getattr(cls, "SUPPORTS_CONCURRENT_SESSIONS", False):
        raise TaskError(f"{cls.__name__} does not set SUPPORTS_CONCURRENT_SESSIONS = True, so its server serves one "
                        f"session at a time, and this rank runs {sessions} episodes at once ({explanation}); mark the "
                        "class concurrency-safe (no state shared between its instances) or run fewer episodes at once")


class LaunchedServer:
    """The server process of one rank: started, waited for, and stopped at exit (the module docstring)."""

    def __init__(self, location: str, name: str, sessions: int, wait_s: float) -> None:
        if location.endswith(".py"):
            location = str(Path(location).expanduser().resolve())
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(512)
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="openenv-server-", suffix=".log", delete=False)
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get(
            "PYTHONPATH")]))}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tasks.openenv_launch", f"{location}:{name}", "--fd", str(listener.fileno()),
             "--sessions", str(sessions), "--parent", str(os.getpid())],
            pass_fds=[listener.fileno()], stdout=self.log, stderr=subprocess.STDOUT, env=environment,
            start_new_session=True)  # its own process group: stopped whole, and not by a signal meant for the rank
        listener.close()  # the server holds its copy
        atexit.register(self.stop)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1.0):
                    return
            except OSError:
                time.sleep(0.1)
        output = self.output()
        self.stop()
        state = f"exited with status {self.process.returncode}" if self.process.returncode is not None else \
            f"did not answer {self.url}/health within {wait_s:g} s (--env-time-limit-s)"
        raise TaskError(f"the OpenEnv server for {location}:{name} {state}; its output ends:\n{output}")

    def output(self) -> str:
        """The last 3000 characters the server printed."""
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        """The server's process group ended (SIGTERM, then SIGKILL after 5 s) and its log removed."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


def die_with_parent(parent: int) -> None:
    """Linux's parent-death signal: SIGTERM when the trainer dies, however it dies; and an exit now if it is already
    gone."""
    try:
        import ctypes
        import ctypes.util

        ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError, TypeError):  # not Linux: the trainer's exit handler stops the server
        pass
    if os.getppid() != parent:
        sys.exit("the trainer that started this server is gone")


def serve(arguments: list[str]) -> None:
    parser = argparse.ArgumentParser(description="serve one OpenEnv environment class (started by the trainer)")
    parser.add_argument("environment", help="path/to/file.py:Class or package.module:Class")
    parser.add_argument("--fd", type=int, required=True, help="a bound, listening socket to serve on")
    parser.add_argument("--sessions", type=int, required=True, help="sessions served at once (max_concurrent_envs)")
    parser.add_argument("--parent", type=int, required=True, help="the trainer's process id")
    options = parser.parse_args(arguments)
    die_with_parent(options.parent)
    import uvicorn
    from openenv.core.env_server.http_server import create_fastapi_app

    location, _, name = options.environment.rpartition(":")
    cls = user_class(location, name)
    action, observation = action_and_observation(cls)
    app = create_fastapi_app(cls, action, observation, max_concurrent_envs=options.sessions)
    uvicorn.Server(uvicorn.Config(app, fd=options.fd, log_level="warning", timeout_graceful_shutdown=2)).run()


if __name__ == "__main__":
    serve(sys.argv[1:])
