"""Run model-written Python in separate, limited, isolated processes: the `python` tool a task may declare.

A call is one pre-started `python -I -S tasks/confinement.py` (the base interpreter, standard library only; see that
file for its three processes), given its configuration and code over a pipe and used for exactly one call; the next
one starts while this one runs, which hides the interpreter's start-up. What the code gets:
- a root of its own: a fresh tmpfs holding read-only binds of the system's programs and libraries (/usr, /bin, /lib,
  ...), the interpreter's installation and `read_only_paths`, a minimal /etc and /dev, its own /proc, a writable
  /work (max_disk_bytes) and /dev/shm (1 MiB). pivot_root into it: nothing else of the host's file system exists
  there, and /proc/self/mountinfo lists only these mounts. New user, mount, network (a loopback that is down), PID,
  IPC, UTS and cgroup namespaces; a root trainer runs it as `unprivileged_uid` with the mounts locked, a non-root one
  as its own user mapped to itself. No capabilities, no_new_privs, no nested user namespaces;
- a seccomp filter (the system's libseccomp through ctypes): io_uring, perf_event_open, userfaultfd, bpf, the
  keyring, ptrace, process_vm_*, pidfd_getfd, SysV and POSIX message-queue IPC, memfd, the mount family,
  unshare/setns, modify_ldt, clone with namespace flags, sockets other than AF_UNIX/AF_INET/AF_INET6, socket buffers
  past the system's default size, and another process's limits or scheduling (its init's) get EPERM; system calls
  newer than the filter's review (Linux 6.18) get ENOSYS;
- its own session and process group, a fresh session keyring; the stop signals ignored (a scheduler's SIGUSR1 does
  not change a call's result);
- bounds: wall clock (the monitor, outside the code's reach, kills the namespace), CPU time of all its processes
  together, output (read here incrementally), processes (its own: each call has its own user namespace, so calls
  side by side do not share the bound), open files, file size, and memory: in total per call with a cgroup (v2 under
  $RL_SANDBOX_CGROUP, a delegated directory; v1 when the trainer runs as root with the memory and pids controllers
  writable), else per process, max_processes x memory_bytes at most (the IPC that no rlimit counts is denied by the
  filter; socket buffers stay at net.core.wmem_default, about 208 KiB, and a process holds at most max_open_files
  sockets, its user about as many more in flight over SCM_RIGHTS). The CPU total is the cgroup's counter (v2's
  cpu.stat; v1 with the cpuacct controller writable), else the init's sum over the processes, which misses the
  children the kernel reaps (their parent ignores SIGCHLD or set SA_NOCLDWAIT): each of those has cpu_seconds of its
  own, and all of them together the wall clock on each core (max_processes at once). `describe()` says which, in the
  run's manifest and log;
- nothing of a call outlives its monitor, whatever ends it (the OOM killer, an operator's kill): the init dies with
  it (a parent-death signal), the namespace with the init, and this side kills whatever is left in the call's cgroup
  leaves before removing them;
- its result: one line written by the monitor (outside the code's PID namespace, holding the only descriptor to us),
  from what the init (non-dumpable: its descriptors are closed to the code) saw; anything but one well-formed line
  is a sandbox_error.

Not isolated: the kernel itself (the filter narrows it; it is still the boundary), CPU and disk bandwidth and the
page cache shared with the trainer, timing side channels. A run near its CPU or wall-clock limit is not reproducible:
the same code may finish or be killed. The platform must offer unprivileged user namespaces (or a root trainer) and
seccomp; without them `check` refuses unless the run passes `--allow-unisolated-tools`, which keeps the rlimits, the
filter where it loads, a fresh directory and a process-group kill only: the code then sees the network and every
file its user may read, and a process that leaves the group (setsid) outlives the call (so does the whole call when
its monitor is killed from outside and there is no cgroup)."""

from __future__ import annotations

import atexit
import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from tasks.confinement import MEMORY_EXIT, STOP_SIGNALS

KIB, MIB = 1024, 1024 * 1024
STATUSES = ("ok", "error", "timeout", "memory", "output_cut", "killed", "sandbox_error")
REPO = str(Path(__file__).resolve().parents[1])
CONFINEMENT = str(Path(__file__).resolve().with_name("confinement.py"))
CGROUP_VARIABLE = "RL_SANDBOX_CGROUP"  # a delegated cgroup v2 directory the calls' leaves go under
WORKDIR_INODES = 4096  # files in the working directory (each costs kernel memory that size= does not count)
GRACE_S = 2.0  # past the wall clock, the monitor itself is killed if it has not reported
REPORT_LIMIT = 4096


@dataclass
class SandboxResult:
    output: str  # stdout and stderr interleaved, at most max_output_bytes (UTF-8, invalid bytes replaced)
    status: str  # one of STATUSES
    exit_code: int | None  # the code's exit status, -N for signal N, None when it was stopped
    note: str = ""  # what happened when status is not "ok", e.g. "[timeout: killed after 10 s wall clock]"
    seconds: float = 0.0  # wall clock of the call

    @property
    def text(self) -> str:
        """The output followed by the note: what the model reads."""
        if not self.note:
            return self.output
        return f"{self.output}{'' if not self.output or self.output.endswith(chr(10)) else chr(10)}{self.note}"


@dataclass
class Cgroup:
    """Where each call's cgroup leaf goes: `parents` (one directory for v2; for v1 the memory and pids directories,
    then the cpuacct one where it is writable)."""
    version: int
    parents: list[str]

    @property
    def counts_cpu(self) -> bool:
        return self.version == 2 or len(self.parents) > 2

    def cpu_usage_file(self, leaves: list[str]) -> str | None:
        """The file that counts the CPU time of every process the leaf has held, alive or gone: v2's cpu.stat (there
        without the cpu controller), v1's cpuacct.usage. None: the init sums the processes' own times."""
        if not self.counts_cpu:
            return None
        return os.path.join(leaves[0], "cpu.stat") if self.version == 2 else os.path.join(leaves[2], "cpuacct.usage")

    def make_leaf(self, name: str, memory_bytes: int, max_tasks: int) -> list[str]:
        leaves = [os.path.join(parent, name) for parent in self.parents]
        for leaf in leaves:
            os.mkdir(leaf)
        if self.version == 2:
            for key, value in (("memory.max", memory_bytes), ("memory.swap.max", 0), ("pids.max", max_tasks),
                               ("memory.oom.group", 1)):
                _write_control(leaves[0], key, value, optional=key == "memory.swap.max")
        else:
            _write_control(leaves[0], "memory.limit_in_bytes", memory_bytes)
            _write_control(leaves[0], "memory.memsw.limit_in_bytes", memory_bytes, optional=True)  # no swap
            _write_control(leaves[1], "pids.max", max_tasks)
        return leaves

    @staticmethod
    def join(leaves: list[str], pid: int) -> None:
        for leaf in leaves:
            _write_control(leaf, "cgroup.procs", pid)

    def oom_killed(self, leaves: list[str]) -> bool:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            lines = Path(leaves[0], name).read_text().splitlines()
        except OSError:
            return False
        counts = dict(line.split() for line in lines if len(line.split()) == 2)
        return int(counts.get("oom_kill", 0)) > 0 or int(counts.get("oom_group_kill", 0)) > 0

    @staticmethod
    def remove(leaves: list[str]) -> None:
        """Kill what is left in the leaves, then remove them once their processes are gone (the kernel frees them a
        moment after they exit). Called when the monitor is gone: whatever ended it (the OOM killer, an operator's
        kill), nothing of its call outlives it."""
        if leaves:
            _kill_members(leaves[0])
        for leaf in leaves:
            for _ in range(100):
                try:
                    os.rmdir(leaf)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


def _kill_members(leaf: str) -> None:
    """SIGKILL every process listed in the leaf until none is. Each one through a pidfd opened before the list that
    still names it was read: a pid reused meanwhile by a process outside the leaf gets nothing."""
    for _ in range(100):
        listed = _members(leaf)
        if not listed:
            return
        handles = []
        for pid in listed:
            try:
                handles.append((pid, os.pidfd_open(pid)))
            except OSError:
                continue  # gone already
        still = set(_members(leaf))
        for pid, handle in handles:
            try:
                if pid in still:
                    signal.pidfd_send_signal(handle, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(handle)
        time.sleep(0.01)


def _members(leaf: str) -> list[int]:
    try:
        return [int(pid) for pid in Path(leaf, "cgroup.procs").read_text().split()]
    except OSError:  # no such leaf
        return []


def _write_control(directory: str, name: str, value: int | str, optional: bool = False) -> None:
    """Write a cgroup control file; never create one (a missing file is a missing feature, or a wrong directory)."""
    try:
        fd = os.open(os.path.join(directory, name), os.O_WRONLY)
    except FileNotFoundError:
        if optional:
            return
        raise
    try:
        os.write(fd, str(value).encode())
    finally:
        os.close(fd)


def find_cgroup() -> tuple[Cgroup | None, str | None]:
    """The cgroup the calls' leaves go under, and why there is none when $RL_SANDBOX_CGROUP names one that cannot be
    used (a refusal: the user asked for the bound). Without the variable: cgroup v1 with writable memory and pids
    controllers (a root trainer), else none."""
    named = os.environ.get(CGROUP_VARIABLE)
    if named:
        try:
            controllers = Path(named, "cgroup.controllers").read_text().split()
            missing = {"memory", "pids"} - set(controllers)
            if missing:
                return None, (f"${CGROUP_VARIABLE}={named}: the controllers {sorted(missing)} are not available "
                              "there (cgroup.controllers); delegate them to this directory")
            enabled = Path(named, "cgroup.subtree_control").read_text().split()
            if not {"memory", "pids"} <= set(enabled):
                _write_control(named, "cgroup.subtree_control", "+memory +pids")
            _probe(named)
        except OSError as error:
            return None, (f"${CGROUP_VARIABLE}={named} is not a cgroup v2 directory this user can create leaves in "
                          f"with the memory and pids controllers: {error}")
        return Cgroup(2, [named]), None
    try:
        own = {controller: path for line in Path("/proc/self/cgroup").read_text().splitlines()
               for _, controllers, path in [line.split(":", 2)] for controller in controllers.split(",")}
        parents = [f"/sys/fs/cgroup/{name}{own[name]}".rstrip("/") for name in ("memory", "pids")]
        for parent in parents:
            _probe(parent)
    except (OSError, KeyError, ValueError):
        return None, None
    try:
        parents.append(f"/sys/fs/cgroup/cpuacct{own['cpuacct']}".rstrip("/"))
        _probe(parents[-1])
    except (OSError, KeyError):
        parents = parents[:2]  # no cgroup counter of the CPU time: the init sums it
    return Cgroup(1, parents), None


def _probe(parent: str) -> None:
    """Raises OSError unless this process can create leaves under `parent`."""
    probe = os.path.join(parent, f"rl-sandbox-probe-{os.getpid()}")
    os.mkdir(probe)
    os.rmdir(probe)


@dataclass
class _Monitor:
    """A started confinement.py waiting for its one call."""
    process: subprocess.Popen
    report: int  # the read end of its report pipe
    report_there: int  # the write end's number in the monitor
    leaves: list[str]
    workdir: str | None  # unisolated calls only: a fresh host directory


@dataclass
class Sandbox:
    """Limits and isolation of one kind of sandboxed call; `run(code)` is one call (safe from several threads)."""
    cpu_seconds: int = 5  # CPU time of all the call's processes together (and of each)
    wall_seconds: float = 10.0  # wall clock of the whole call
    memory_bytes: int = 512 * MIB  # all the call's processes together with a cgroup, else each one (address space)
    max_processes: int = 16  # processes and threads the code may run at once, itself included
    max_open_files: int = 64
    max_output_bytes: int = 16 * KIB  # stdout + stderr; past it the run is killed (status "output_cut")
    max_file_bytes: int = 1 * MIB  # size of any one file it writes
    max_disk_bytes: int = 16 * MIB  # size of its working directory (a tmpfs when isolated)
    read_only_paths: tuple[str, ...] = ()  # host paths the code may read, besides the system's and the interpreter's
    isolated: bool = True  # namespaces on; check(allow_unisolated=True) turns it off where they are unavailable
    seccomp: bool = True  # the system-call filter; check turns it off only where it cannot load and the user agreed
    unprivileged_uid: int = 65534  # who runs the code when the trainer runs as root
    simulate_no_namespaces: bool = False  # for tests: unshare fails as on a platform without user namespaces
    _cgroup: Cgroup | None = field(default=None, init=False, repr=False, compare=False)
    _cgroup_problem: str | None = field(default=None, init=False, repr=False, compare=False)
    _found_cgroup: bool = field(default=False, init=False, repr=False, compare=False)
    _problem: str | None = field(default=None, init=False, repr=False, compare=False)
    _probed: bool = field(default=False, init=False, repr=False, compare=False)
    _idle: list = field(default_factory=list, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)
    _count: int = field(default=0, init=False, repr=False, compare=False)

    def cgroup(self) -> Cgroup | None:
        if not self._found_cgroup:
            self._cgroup, self._cgroup_problem = find_cgroup()
            self._found_cgroup = True
        return self._cgroup

    def isolation_problem(self) -> str | None:
        """None when the namespaces and the filter work here, else why not. Probed once by running an empty program."""
        if not self._probed:
            probe = replace(self, wall_seconds=max(self.wall_seconds, 10.0), isolated=True, seccomp=True)
            result = probe.run("pass")
            probe.close()
            self._problem = None if result.status == "ok" else (result.output.strip() or result.note)
            self._probed = True
        return self._problem

    def check(self, allow_unisolated: bool) -> str | None:
        """Called before training starts: None when the sandbox can run (isolated, or unisolated by the user's
        choice), else the refusal to show."""
        self.cgroup()
        if self._cgroup_problem:
            return self._cgroup_problem
        problem = self.isolation_problem()
        if problem is None:
            self.isolated = self.seccomp = True
            return None
        if not allow_unisolated:
            return (f"cannot isolate model-written code on this machine ({problem}); it needs unprivileged user "
                    "namespaces (or a root trainer) and seccomp. Pass --allow-unisolated-tools to run it with resource "
                    "limits, a fresh directory and a process-group kill only (it would see the network and every file "
                    "the trainer's user can read)")
        self.close()
        self.isolated = False
        self.seccomp = replace(self, isolated=False, seccomp=True).run("pass").status == "ok"
        return None

    def describe(self) -> str:
        """What a call gets here, for the log and the manifest."""
        cgroup = self.cgroup()
        memory = (f"{self.memory_bytes / MIB:g} MiB and {self.max_processes} processes in total per call (cgroup "
                  f"v{cgroup.version}: {cgroup.parents[0]})" if cgroup else
                  f"{self.memory_bytes / MIB:g} MiB per process, {self.max_processes} processes (no cgroup: "
                  f"{self.max_processes * self.memory_bytes / MIB:g} MiB at most; set ${CGROUP_VARIABLE} to a "
                  "delegated cgroup v2 directory for a total bound)")
        isolation = ("namespaces, allow-listed root" if self.isolated else "UNISOLATED (--allow-unisolated-tools)") + \
            (", seccomp filter" if self.seccomp else ", no seccomp filter")
        cpu = "the cgroup's count" if cgroup and cgroup.counts_cpu else \
            "summed over the processes; not counted: children the kernel reaps"
        return (f"{isolation}; memory {memory}; CPU {self.cpu_seconds} s in total ({cpu}), wall clock "
                f"{self.wall_seconds:g} s")

    def run(self, code: str) -> SandboxResult:
        """Run `code` as a Python program; never raises because of what the code does."""
        started = time.monotonic()
        deadline = started + self.wall_seconds + GRACE_S
        monitor = self._take()
        self._prestart()  # the next call's monitor starts while this one runs
        try:
            request = {"config": self._config(monitor), "code": code}
            monitor.process.stdin.write((json.dumps(request) + "\n").encode())
            monitor.process.stdin.flush()
            output, ending = self._collect(monitor.process, deadline)
        except BrokenPipeError:
            output, ending = b"", "died"
        finally:
            if ending == "output_cut":
                _close(monitor.process.stdin)  # tells the monitor to stop the call now
            try:  # the end of the output may come a moment before the init's exit reaches the monitor
                monitor.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _kill_group(monitor.process.pid)
                monitor.process.wait()
            _close(monitor.process.stdin)
            monitor.process.stdout.close()
            report = _read_report(monitor.report)
            os.close(monitor.report)
            cgroup = self.cgroup()
            oom = bool(cgroup and monitor.leaves and cgroup.oom_killed(monitor.leaves))
            Cgroup.remove(monitor.leaves)
            if monitor.workdir:
                _remove(monitor.workdir)
        result = self._result(output, ending, report, oom)
        result.seconds = time.monotonic() - started
        return result

    def close(self) -> None:
        """Stop the pre-started monitors (they exit on end of input)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for monitor in idle:
            monitor.process.stdin.close()
            monitor.process.wait()
            monitor.process.stdout.close()
            os.close(monitor.report)
            Cgroup.remove(monitor.leaves)
            if monitor.workdir:
                _remove(monitor.workdir)

    def _config(self, monitor: _Monitor) -> dict:
        return {"cpu_seconds": self.cpu_seconds, "wall_seconds": self.wall_seconds,
                "memory_bytes": self.memory_bytes, "max_processes": self.max_processes,
                "max_open_files": self.max_open_files, "max_file_bytes": self.max_file_bytes,
                "max_disk_bytes": self.max_disk_bytes, "max_inodes": WORKDIR_INODES,
                "read_only_paths": [os.path.realpath(path) for path in self.read_only_paths],
                "isolated": self.isolated, "seccomp": self.seccomp, "unprivileged_uid": self.unprivileged_uid,
                "simulate_no_namespaces": self.simulate_no_namespaces, "workdir": monitor.workdir,
                "report_fd": monitor.report_there,
                "cpu_usage_file": self.cgroup().cpu_usage_file(monitor.leaves) if monitor.leaves else None}

    def _take(self) -> _Monitor:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._start_monitor()

    def _prestart(self) -> None:
        monitor = self._start_monitor()
        with self._lock:
            self._idle.append(monitor)

    def _start_monitor(self) -> _Monitor:
        with self._lock:
            self._count += 1
            if self._count == 1:
                atexit.register(self.close)
            name = f"rl-sandbox-{os.getpid()}-{id(self):x}-{self._count}"
        workdir = None if self.isolated else tempfile.mkdtemp(prefix="sandbox-")
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir or "/work", "TMPDIR": workdir or "/work",
               "LANG": "C.UTF-8"}
        report_read, report_write = os.pipe()
        # A stop signal to the trainer's process group (torchrun's SIGTERM to its workers) also reaches a child that is
        # forked but not yet in its own session, and killed it before its call: a sandbox error, the episode's reward
        # then set by when the signal came. Blocked in this thread across the spawn, it stays pending in the child
        # until its main() ignores the stop signals, which discards it; the trainer's handler gets it once the mask
        # is back.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            # No preexec_fn (unsafe in the multi-threaded trainer): the monitor sets its own limits and namespaces.
            process = subprocess.Popen([_interpreter(), "-I", "-S", CONFINEMENT], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=workdir or "/", env=env,
                                       pass_fds=(report_write,), start_new_session=True)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            os.close(report_write)
        cgroup = self.cgroup()
        leaves: list[str] = []
        if cgroup is not None:  # before the monitor reads its call: every process of the call starts inside
            leaves = cgroup.make_leaf(name, self.memory_bytes, self.max_processes + 3)
            Cgroup.join(leaves, process.pid)
        return _Monitor(process, report_read, report_write, leaves, workdir)  # pass_fds keeps the number

    def _collect(self, process: subprocess.Popen, deadline: float) -> tuple[bytes, str | None]:
        """Read the merged output until every process of the call is gone (end of file), the deadline passes
        ("died": the monitor did not end the call) or the bound is passed ("output_cut"): never more than
        max_output_bytes + one read in memory."""
        fd = process.stdout.fileno()
        os.set_blocking(fd, False)
        chunks: list[bytes] = []
        size = 0
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return b"".join(chunks), "died"
                if not selector.select(left):
                    continue
                while size <= self.max_output_bytes:  # what is in the pipe now
                    try:
                        data = os.read(fd, 64 * KIB)
                    except BlockingIOError:
                        break
                    if not data:
                        return b"".join(chunks), None
                    chunks.append(data)
                    size += len(data)
                if size > self.max_output_bytes:
                    return b"".join(chunks)[:self.max_output_bytes], "output_cut"

    def _result(self, raw: bytes, ending: str | None, report: dict | None, oom: bool) -> SandboxResult:
        output = raw.decode("utf-8", errors="replace")
        memory_note = f"[memory limit {self.memory_bytes / MIB:g} MiB]"
        if ending == "output_cut":
            return SandboxResult(output, "output_cut", None, f"[output cut at {self.max_output_bytes} bytes]")
        if oom:
            return SandboxResult(output, "memory", None, memory_note)
        if report is None:
            return SandboxResult(output, "sandbox_error", None, "[sandbox error: no well-formed report]")
        if "setup_error" in report:
            return SandboxResult(str(report["setup_error"]), "sandbox_error", None, "[sandbox error]")
        kind = report.get("ending")
        cpu_note = f"[timeout: CPU limit of {self.cpu_seconds} s]"
        if kind == "timeout":
            return SandboxResult(output, "timeout", None, f"[timeout: killed after {self.wall_seconds:g} s wall clock]")
        if kind == "cpu":
            return SandboxResult(output, "timeout", None, cpu_note)
        if kind != "exit":
            return SandboxResult(output, "killed", None, "[killed before the code finished]")
        code, cpu = report["exit_code"], report["cpu_seconds"]
        if code == 0:
            return SandboxResult(output, "ok", 0)
        if code == MEMORY_EXIT:
            return SandboxResult(output, "memory", 1, memory_note)
        if code == -signal.SIGXCPU or (code == -signal.SIGKILL and cpu >= self.cpu_seconds):
            return SandboxResult(output, "timeout", code, cpu_note)
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return SandboxResult(output, "killed", code, f"[killed by {name}]")
        return SandboxResult(output, "error", code, f"[exit code {code}]")


def _interpreter() -> str:
    """The base interpreter (not a venv's wrapper, which lies outside the allow-listed root)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _close(stream) -> None:
    try:
        stream.close()
    except BrokenPipeError:
        pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_report(fd: int) -> dict | None:
    """The monitor's report: exactly one line of a JSON object, else None (the monitor died, or something else wrote
    there)."""
    os.set_blocking(fd, False)
    data = b""
    while len(data) <= REPORT_LIMIT:
        try:
            chunk = os.read(fd, REPORT_LIMIT + 1)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    if len(data) > REPORT_LIMIT or data.count(b"\n") != 1 or not data.endswith(b"\n"):
        return None
    try:
        report = json.loads(data)
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


def _remove(path: str) -> None:
    """Remove an unisolated call's directory even where the code took its permissions away."""
    def retry(function, failed_path, _info) -> None:
        try:
            os.chmod(os.path.dirname(failed_path), stat.S_IRWXU)
            function(failed_path)
        except OSError:
            pass

    shutil.rmtree(path, onerror=retry)


SANDBOX = Sandbox()


def python(code: str) -> str:
    """Run a Python program (standard library only, no network, limited time and memory) and return what it prints.

    Args:
        code: the complete program; print what you want to see, e.g. "print(sum(range(10)))"
    """
    return SANDBOX.run(code).text


python.sandbox = SANDBOX  # tasks/tools.py's check_tools finds and checks it before training
