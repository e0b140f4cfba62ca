"""Run model-written Python in a separate, limited, isolated process: the `python` tool a task may declare.

Each call starts `python -I -S tasks/sandbox.py --child` (the base interpreter, standard library only) with a
minimal environment, in a new session, from a fresh temporary directory; that child, before any user code:
- sets rlimits: CPU seconds, address space, processes (threads included), open files, file size, no core dumps;
- isolates itself with unshare(2) (through ctypes: Python 3.11 has no os.unshare): new user, mount, network, PID,
  IPC and UTS namespaces. No network: only a loopback that is down. The file system is read-only, `hidden_paths`
  (the repository, homes, /tmp, /run, /mnt, /sys, ... plus what the run adds: its run directory, checkpoints) are
  covered by empty tmpfs, /dev holds only null, zero, full, random and urandom, /proc is the new PID namespace's;
  the working directory is a small tmpfs that vanishes with the run. A trainer running as root runs the code as
  `unprivileged_uid` (nobody) and sets the mounts up before entering the user namespace, so they are locked there;
  otherwise the code runs as the trainer's user inside the namespace. Either way it holds no capabilities, cannot
  gain any on exec (no_new_privs), and cannot create nested user namespaces;
- runs the code in a grandchild, under an init (PID 1 of the namespace) whose end kills every process left, which
  makes fork bombs, background processes and setsid escapes end with the call.
The parent enforces the wall clock and the output bound (read incrementally; past it the run is killed): it kills
the process group, whose death takes the PID namespace with it.

Not isolated: there is no seccomp filter, so the code may make any system call the kernel allows an unprivileged
user namespace (the kernel is the boundary); the rest of the file system is readable; memory is limited per
process, not in total (no cgroup: max_processes x memory_bytes at most); CPU and disk bandwidth are shared with the
trainer. A run near its CPU or wall-clock limit is not reproducible: the same code may
finish or be killed. Without namespaces (`check(allow_unisolated=True)`, the run's `--allow-unisolated-tools`) only
the rlimits, the fresh directory and the process-group kill remain: the code sees the network and every file its
user may read, and a process that leaves the group (setsid) outlives the call."""

from __future__ import annotations

import ctypes
import json
import os
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

KIB, MIB = 1024, 1024 * 1024
STATUSES = ("ok", "error", "timeout", "memory", "output_cut", "killed", "sandbox_error")
REPO = str(Path(__file__).resolve().parents[1])
# The repository (the trainer's code, its runs, often its checkpoints), homes (tokens, keys, caches), shared
# temporary and runtime directories (other processes' sockets: a tmux or D-Bus socket is a way out), mounted data
# disks and sysfs. The interpreter's own installation stays visible even when it lies under one of them.
DEFAULT_HIDDEN_PATHS = tuple(dict.fromkeys([REPO, os.path.expanduser("~"), "/root", "/home", "/tmp", "/var/tmp",
                                            "/run", "/mnt", "/media", "/srv", "/sys"]))
MEMORY_EXIT = 213  # the child's exit code for an uncaught MemoryError (user code exiting with it reads the same)
CODE_FILE = ".sandbox_code.py"  # written by the parent into the fresh directory; the child reads and removes it
WORKDIR_INODES = 4096  # files in the working directory (each costs kernel memory that size= does not count)


@dataclass
class SandboxResult:
    output: str  # stdout and stderr interleaved, at most max_output_bytes (UTF-8, invalid bytes replaced)
    status: str  # one of STATUSES
    exit_code: int | None  # the code's exit status, -N for signal N, None when the parent killed it
    note: str = ""  # what happened when status is not "ok", e.g. "[timeout: killed after 10 s wall clock]"
    seconds: float = 0.0  # wall clock of the call

    @property
    def text(self) -> str:
        """The output followed by the note: what the model reads."""
        if not self.note:
            return self.output
        return f"{self.output}{'' if not self.output or self.output.endswith(chr(10)) else chr(10)}{self.note}"


@dataclass
class Sandbox:
    """Limits and isolation of one kind of sandboxed call; `run(code)` is one call."""
    cpu_seconds: int = 5  # CPU time of the code's process (SIGXCPU, then SIGKILL a second later)
    wall_seconds: float = 10.0  # wall clock of the whole call, enforced by the parent
    memory_bytes: int = 512 * MIB  # address space of each process (not of all together: there is no cgroup)
    max_processes: int = 16  # processes and threads the code may run at once, itself included
    max_open_files: int = 64
    max_output_bytes: int = 16 * KIB  # stdout + stderr; past it the run is killed (status "output_cut")
    max_file_bytes: int = 1 * MIB  # size of any one file it writes
    max_disk_bytes: int = 16 * MIB  # size of its working directory (a tmpfs when isolated)
    hidden_paths: tuple[str, ...] = DEFAULT_HIDDEN_PATHS  # unreadable from the sandbox: add the run directory
    isolated: bool = True  # namespaces on; check(allow_unisolated=True) turns it off where they are unavailable
    unprivileged_uid: int = 65534  # who runs the code when the trainer runs as root
    simulate_no_namespaces: bool = False  # for tests: unshare fails as on a platform without user namespaces
    _problem: str | None = field(default=None, init=False, repr=False, compare=False)
    _probed: bool = field(default=False, init=False, repr=False, compare=False)

    def hide(self, *paths: str | os.PathLike) -> None:
        """Make more paths unreadable from the sandbox (the run directory, checkpoints)."""
        self.hidden_paths = tuple(dict.fromkeys([*self.hidden_paths, *(os.fspath(path) for path in paths)]))

    def isolation_problem(self) -> str | None:
        """None when the namespaces work here, else why not. Probed once by running an empty program."""
        if not self._probed:
            probe = Sandbox(wall_seconds=max(self.wall_seconds, 10.0), hidden_paths=self.hidden_paths,
                            unprivileged_uid=self.unprivileged_uid, simulate_no_namespaces=self.simulate_no_namespaces)
            result = probe.run("pass")
            self._problem = None if result.status == "ok" else (result.output.strip() or result.note)
            self._probed = True
        return self._problem

    def check(self, allow_unisolated: bool) -> str | None:
        """Called before training starts: None when the sandbox can run (isolated, or unisolated by the user's
        choice), else the refusal to show."""
        problem = self.isolation_problem()
        if problem is None:
            self.isolated = True
            return None
        if not allow_unisolated:
            return (f"cannot isolate model-written code on this machine ({problem}); pass --allow-unisolated-tools "
                    "to run it with resource limits, a fresh directory and a process-group kill only (it would see "
                    "the network and every file the trainer's user can read)")
        self.isolated = False
        return None

    def run(self, code: str) -> SandboxResult:
        """Run `code` as a Python program; never raises because of what the code does."""
        started = time.monotonic()
        workdir = tempfile.mkdtemp(prefix="sandbox-")
        status_read, status_write = os.pipe()
        try:
            Path(workdir, CODE_FILE).write_text(code, encoding="utf-8", errors="surrogatepass")
            config = {"cpu_seconds": self.cpu_seconds, "memory_bytes": self.memory_bytes,
                      "max_processes": self.max_processes, "max_open_files": self.max_open_files,
                      "max_file_bytes": self.max_file_bytes, "max_disk_bytes": self.max_disk_bytes,
                      "hidden_paths": sorted({os.path.realpath(path) for path in self.hidden_paths}),
                      "isolated": self.isolated, "unprivileged_uid": self.unprivileged_uid,
                      "simulate_no_namespaces": self.simulate_no_namespaces, "workdir": workdir,
                      "status_fd": status_write}
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
            # No preexec_fn (unsafe in the multi-threaded trainer): the child sets its own limits and namespaces.
            process = subprocess.Popen([_interpreter(), "-I", "-S", __file__, "--child", json.dumps(config)],
                                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       cwd=workdir, env=env, pass_fds=(status_write,), start_new_session=True)
        except BaseException:
            os.close(status_read)
            os.close(status_write)
            _remove(workdir)
            raise
        os.close(status_write)
        try:
            output, ending = self._collect(process, started + self.wall_seconds)
        finally:
            _kill_group(process.pid)  # before reaping: while the leader is unreaped its group id cannot be reused
            process.wait()
            process.stdout.close()
            report = _read_report(status_read)
            os.close(status_read)
            _remove(workdir)
        result = self._result(output, ending, report)
        result.seconds = time.monotonic() - started
        return result

    def _collect(self, process: subprocess.Popen, deadline: float) -> tuple[bytes, str | None]:
        """Read the merged output until the child exits, the deadline passes ("timeout") or the bound is passed
        ("output_cut"): never more than max_output_bytes + one read in memory."""
        fd = process.stdout.fileno()
        os.set_blocking(fd, False)
        chunks: list[bytes] = []
        size, eof = 0, False
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return b"".join(chunks), "timeout"
                exited = _exited(process.pid)
                if eof and not exited:
                    time.sleep(min(left, 0.005))
                    continue
                if exited or selector.select(min(left, 0.05)):
                    while size <= self.max_output_bytes:  # what is in the pipe now
                        try:
                            data = os.read(fd, 64 * KIB)
                        except BlockingIOError:
                            break
                        if not data:
                            eof = True
                            break
                        chunks.append(data)
                        size += len(data)
                    if size > self.max_output_bytes:
                        return b"".join(chunks)[:self.max_output_bytes], "output_cut"
                if exited:  # leftovers still holding the pipe (unisolated) are killed with the group
                    return b"".join(chunks), None

    def _result(self, raw: bytes, ending: str | None, report: dict) -> SandboxResult:
        output = raw.decode("utf-8", errors="replace")
        if ending == "timeout":
            return SandboxResult(output, "timeout", None, f"[timeout: killed after {self.wall_seconds:g} s wall clock]")
        if ending == "output_cut":
            return SandboxResult(output, "output_cut", None, f"[output cut at {self.max_output_bytes} bytes]")
        if "setup_error" in report:
            return SandboxResult(report["setup_error"], "sandbox_error", None, "[sandbox error]")
        if "exit_code" not in report:  # the supervisor itself died: something outside killed it
            return SandboxResult(output, "killed", None, "[killed before the code finished]")
        code, cpu = report["exit_code"], report["cpu_seconds"]
        if code == 0:
            return SandboxResult(output, "ok", 0)
        if code == MEMORY_EXIT:
            return SandboxResult(output, "memory", 1, f"[memory limit {self.memory_bytes / MIB:g} MiB]")
        if code == -signal.SIGXCPU or (code == -signal.SIGKILL and cpu >= self.cpu_seconds):
            return SandboxResult(output, "timeout", code, f"[timeout: CPU limit of {self.cpu_seconds} s]")
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return SandboxResult(output, "killed", code, f"[killed by {name}]")
        return SandboxResult(output, "error", code, f"[exit code {code}]")


def _interpreter() -> str:
    """The base interpreter (not a venv's wrapper, which may live in the hidden repository)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it (WNOWAIT)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_report(fd: int) -> dict:
    """The child's last status line (setup_error, or exit_code and cpu_seconds), {} when it wrote none."""
    os.set_blocking(fd, False)
    data = b""
    while len(data) < 64 * KIB:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    lines = data.decode(errors="replace").strip().splitlines()
    try:
        return json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        return {}


def _remove(path: str) -> None:
    """Remove the call's directory even where the code took its permissions away (unisolated runs)."""
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


# ---- the child: everything below runs in the sandboxed process, before and around the user's code ----

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 0x1
DEVICES = ("null", "zero", "full", "random", "urandom")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class _SetupError(Exception):
    """A step of the isolation failed: reported as status sandbox_error (and as isolation_problem's answer)."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _call(what: str, result: int) -> None:
    if result == -1:
        errno = ctypes.get_errno()
        raise _SetupError(f"{what}: {os.strerror(errno)} (errno {errno})")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def encode(text: str | None) -> bytes | None:
        return None if text is None else os.fsencode(text)

    _call(f"mount {fstype or source} on {target}", _libc().mount(encode(source), encode(target), encode(fstype),
                                                                  ctypes.c_ulong(flags), encode(data)))


def _set_mount_attributes(path: str, attr_set: int, attr_clr: int, recursive: bool) -> None:
    attributes = _MountAttr(attr_set, attr_clr, 0, 0)
    _call(f"mount_setattr {path}", _libc().syscall(SYS_MOUNT_SETATTR, AT_FDCWD, os.fsencode(path),
                                                    AT_RECURSIVE if recursive else 0, ctypes.byref(attributes),
                                                    ctypes.sizeof(attributes)))


def _prctl(what: str, option: int, value: int) -> None:
    _call(what, _libc().prctl(option, ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)))


def _limit(kind: int, soft: int, hard: int | None = None) -> None:
    """Lower a limit; never above the hard limit the trainer already has (raising it would fail)."""
    ceiling = resource.getrlimit(kind)[1]
    if ceiling != resource.RLIM_INFINITY:
        soft, hard = min(soft, ceiling), min(soft if hard is None else hard, ceiling)
    resource.setrlimit(kind, (soft, soft if hard is None else hard))


def _set_limits(config: dict, processes: int | None) -> None:
    _limit(resource.RLIMIT_CPU, config["cpu_seconds"], config["cpu_seconds"] + 1)  # SIGXCPU, then SIGKILL if
    # the code ignores it
    _limit(resource.RLIMIT_AS, config["memory_bytes"])
    _limit(resource.RLIMIT_NOFILE, config["max_open_files"])
    _limit(resource.RLIMIT_FSIZE, config["max_file_bytes"])
    _limit(resource.RLIMIT_CORE, 0)
    if processes is not None:
        _limit(resource.RLIMIT_NPROC, processes)


def _tasks_of_user(uid: int) -> int | None:
    """Processes and threads of `uid` now (None without /proc): RLIMIT_NPROC counts them all where there is no
    user namespace."""
    if not os.path.isdir("/proc/self"):
        return None
    count = 0
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return count


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _drop_to(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    _prctl("prctl(PR_SET_DUMPABLE)", PR_SET_DUMPABLE, 1)  # a uid change clears it, and /proc/self needs it


def _set_up_mounts(config: dict, uid: int, kept: dict[str, int], dev: int, proc_writable: bool) -> None:
    """In a fresh mount namespace: hide, expose the interpreter again, replace /dev, make all read-only, mount the
    working directory. `kept` are O_PATH descriptors of the interpreter's directories, `dev` of the old /dev."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates back to the host
    hidden: list[str] = []
    for path in config["hidden_paths"]:  # sorted: a parent comes before what it already hides
        if path == "/" or not os.path.lexists(path) or any(_under(path, done) for done in hidden):
            continue
        if os.path.isdir(path):
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,nr_inodes=256,mode=755")
        else:
            _mount(f"/proc/self/fd/{dev}/null", path, None, MS_BIND)
        hidden.append(path)
    exposed: list[str] = []
    for path, fd in sorted(kept.items()):  # a directory inside one already exposed comes with it
        if any(_under(path, done) for done in hidden) and not any(_under(path, done) for done in exposed):
            os.makedirs(path, exist_ok=True)  # inside the covering tmpfs
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
            exposed.append(path)
    workdir = config["workdir"]
    os.makedirs(workdir, exist_ok=True)  # the mount point, inside the tmpfs covering /tmp
    _mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=755")
    for name in DEVICES:
        if os.path.exists(f"/proc/self/fd/{dev}/{name}"):
            Path("/dev", name).touch()
            _mount(f"/proc/self/fd/{dev}/{name}", f"/dev/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"/dev/{name}")
    os.mkdir("/dev/shm")
    _set_mount_attributes("/", MOUNT_ATTR_RDONLY, 0, recursive=True)
    if proc_writable:  # the uid map is still to be written there; the code sees a fresh proc mounted over it
        _set_mount_attributes("/proc", 0, MOUNT_ATTR_RDONLY, recursive=False)
    writable = f"size={config['max_disk_bytes']},nr_inodes={WORKDIR_INODES},mode=700,uid={uid},gid={uid}"
    _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, writable)
    _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"size={MIB},nr_inodes=64,mode=1777")


def _isolate(config: dict) -> int:
    """Enter the namespaces (this process; the next child is PID 1 of the new PID namespace). Returns the uid the
    code runs as."""
    if config["simulate_no_namespaces"]:
        raise _SetupError("unshare(CLONE_NEWUSER): Operation not permitted (errno 1) [simulated]")
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    prefixes = sorted({os.path.realpath(path) for path in (sys.base_prefix, sys.base_exec_prefix,
                                                           os.path.dirname(sys.executable))})
    root = os.geteuid() == 0
    if root:
        # As root: build the mounts in a root-owned mount namespace (so they are locked once a user namespace
        # copies it), then become the unprivileged user and take the remaining namespaces.
        _call("unshare(CLONE_NEWNS)", _libc().unshare(CLONE_NEWNS))
        uid = config["unprivileged_uid"]
        # A directory above the interpreter that the unprivileged user cannot enter (root's home) is covered too:
        # nothing in it was readable to that user, and the interpreter is exposed again inside the cover.
        closed = {ancestor for prefix in prefixes for ancestor in map(str, Path(prefix).parents)
                  if not os.stat(ancestor).st_mode & stat.S_IXOTH}
        config = {**config, "hidden_paths": sorted(set(config["hidden_paths"]) | closed)}
    else:
        uid, gid = os.geteuid(), os.getegid()
        _call("unshare(CLONE_NEWUSER|...)", _libc().unshare(flags))
        _write_id_maps(uid, gid)
    kept = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in prefixes}  # opened in the new namespace
    dev = os.open("/dev", os.O_PATH | os.O_DIRECTORY)
    _set_up_mounts(config, uid, kept, dev, proc_writable=root)
    for fd in (*kept.values(), dev):
        os.close(fd)
    os.chdir(config["workdir"])  # the new tmpfs, not the host directory under it
    if root:
        _drop_to(uid)
        _call("unshare(CLONE_NEWUSER|...)", _libc().unshare(flags))
        _write_id_maps(uid, uid)
    return uid


def _write_id_maps(uid: int, gid: int) -> None:
    """Map the one user to itself: no other id exists in the namespace, so the code cannot change its ids."""
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        try:
            with open(f"/proc/self/{name}", "w") as file:
                file.write(text)
        except OSError as error:
            raise _SetupError(f"writing /proc/self/{name}: {error.strerror}") from error


def _drop_capabilities() -> None:
    """No capabilities, now or after exec (the code's uid is not 0 in its namespace, and no_new_privs)."""
    libc = _libc()
    for capability in range(64):
        if libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(capability), ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0)) == -1:
            break  # EINVAL past the last capability; EPERM where there is none to drop
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3, all zero
    _call("capset", libc.capset(ctypes.byref(header), data))
    _prctl("prctl(PR_SET_NO_NEW_PRIVS)", PR_SET_NO_NEW_PRIVS, 1)


def _report(config: dict, message: dict) -> None:
    os.write(config["status_fd"], (json.dumps(message) + "\n").encode())


def _child_main() -> None:
    config = json.loads(sys.argv[2])
    code_path = os.path.join(config["workdir"], CODE_FILE)
    with open(code_path, encoding="utf-8", errors="surrogatepass") as file:
        code = file.read()
    os.unlink(code_path)
    try:
        _set_limits(config, processes=None)  # the process limit waits: outside a user namespace it counts the
        # trainer's threads
        if config["isolated"]:
            uid = _isolate(config)
            _set_limits(config, processes=config["max_processes"] + 2)  # this process and the init below
        else:
            uid = os.geteuid()
            if uid == 0 and _readable_by_others(os.path.dirname(os.__file__)):
                uid = config["unprivileged_uid"]
                os.chown(config["workdir"], uid, uid)
                _drop_to(uid)
            tasks = _tasks_of_user(uid)
            _set_limits(config, processes=None if tasks is None else tasks + config["max_processes"] + 1)
    except (_SetupError, OSError, ValueError) as error:
        _report(config, {"setup_error": str(error)})
        os._exit(2)
    if config["isolated"]:
        alive_read, alive_write = os.pipe()  # closes when this process dies: the init checks it once
        init = os.fork()
        if init:
            os.close(alive_read)
            try:  # hardening only: the code cannot see this process (outside its PID namespace and its /proc)
                _drop_capabilities()
            except _SetupError:
                pass
            os.waitpid(init, 0)
            os._exit(0)
        os.close(alive_write)
        _become_init(config, alive_read)
    _supervise(config, code, in_namespace=config["isolated"])


def _readable_by_others(path: str) -> bool:
    """Whether an unprivileged user can reach `path` (every directory up to it searchable by others)."""
    while True:
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
        if path == os.path.dirname(path):
            return True
        path = os.path.dirname(path)


def _become_init(config: dict, alive_read: int) -> None:
    """PID 1 of the new namespace: killed with the process outside it (and then the kernel kills everything in
    the namespace); mounts its own /proc; forbids nested user namespaces; drops its capabilities."""
    try:
        _prctl("prctl(PR_SET_PDEATHSIG)", PR_SET_PDEATHSIG, signal.SIGKILL)
        if _readable(alive_read):
            os._exit(1)  # the parent died before the death signal was armed
        os.close(alive_read)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        except _SetupError:  # a container that masks parts of /proc refuses a new one: hide it instead
            _mount("tmpfs", "/proc", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4k,mode=555")
        else:
            with open("/proc/sys/user/max_user_namespaces", "w") as limit:  # this namespace's own limit
                limit.write("0")
        _drop_capabilities()
    except (_SetupError, OSError, ValueError) as error:
        _report(config, {"setup_error": str(error)})
        os._exit(2)


def _readable(fd: int) -> bool:
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        return bool(selector.select(0))


def _supervise(config: dict, code: str, in_namespace: bool) -> None:
    """Fork the code's process, reap every child until it exits (PID 1 adopts orphans), report its status."""
    child = os.fork()
    if child == 0:
        os.closerange(3, 1 << 16)  # the status pipe included: the code cannot forge a report
        if in_namespace:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        _run_code(code)
    while True:
        pid, status, usage = os.wait4(-1 if in_namespace else child, 0)
        if pid == child:
            break
    _report(config, {"exit_code": os.waitstatus_to_exitcode(status),
                     "cpu_seconds": usage.ru_utime + usage.ru_stime})
    os._exit(0)  # as PID 1, its exit kills what the code left running


def _run_code(code: str) -> None:
    """Run the code as __main__ would run; an uncaught MemoryError exits with MEMORY_EXIT."""
    import linecache
    import traceback
    import types

    module = types.ModuleType("__main__")
    sys.modules["__main__"] = module
    sys.argv = [""]
    linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")  # tracebacks show its lines
    sys.stdout.reconfigure(line_buffering=True)  # prints and a traceback keep their order in the merged pipe
    try:
        exec(compile(code, "<code>", "exec"), module.__dict__)
    except SystemExit:
        raise
    except MemoryError as error:
        module.__dict__.clear()  # free what the code held so that the message can be written
        try:
            traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        except MemoryError:
            os.write(2, b"MemoryError\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(MEMORY_EXIT)
    except BaseException as error:  # noqa: B036 (the traceback the user's program would print, then exit 1)
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        raise SystemExit(1) from None
    raise SystemExit(0)  # the interpreter's normal exit: atexit handlers, threads joined, buffers flushed


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _child_main()
