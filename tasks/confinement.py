"""The sandbox's far side: started by tasks/sandbox.py as `python -I -S tasks/confinement.py` (standard library only,
light imports: a pre-started one waits on its standard input for one call). Three processes per call:

- the monitor (this program): reads the call's configuration and code as one line from standard input (never argv),
  joins a fresh session keyring, opens the call's cgroup CPU counter if it has one, enters the namespaces, forks the
  init, enforces the wall clock, and writes the call's one-line report to fd 3. It is outside the code's PID
  namespace, so the code cannot name it; fd 3 exists nowhere else. It stops the call early when its standard input is
  closed or written to;
- the init, PID 1 of the new PID namespace: builds the allow-listed root and mounts its /proc, makes itself
  non-dumpable (its /proc/1/fd is closed to the code), reaps every process, bounds the CPU time of all of them (the
  cgroup's counter, else its own sum) and tells the monitor how the code ended over a pipe the code never holds;
  nothing it writes reaches the code's output. It dies with the monitor (a parent-death signal), and its exit kills
  every process left in the namespace;
- the code's process: its own session and process group (kill(0, ...) reaches neither the monitor nor the init), the
  stop signals ignored (a scheduler's SIGUSR1 to the job must not change a call's result), no capabilities,
  no_new_privs, the seccomp filter, then the code.

Status lines from the init: `exit <wait status> <cpu seconds>` or `cpu <cpu seconds>` (the total CPU bound hit)."""

import ctypes
import json
import os
import resource
import select
import signal
import sys
import time

MEMORY_EXIT = 213  # the code's exit status for an uncaught MemoryError (user code exiting with it reads the same)
REPORT_FD = 3
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
CPU_POLL_S = 0.02  # how often the init sums the CPU time of the namespace's processes

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWCGROUP = 0x10000000, 0x20000000, 0x40000000, 0x02000000
NAMESPACES = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x1000, 0x4000, 0x40000
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 0x1
SYS_PIVOT_ROOT, SYS_KEYCTL = {"x86_64": 155, "aarch64": 41}, {"x86_64": 250, "aarch64": 219}
KEYCTL_JOIN_SESSION_KEYRING = 1
DEVICES = ("null", "zero", "full", "random", "urandom")
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")  # read-only, or their symlinks
ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime")

# The seccomp filter: EPERM for these (the parts of the kernel production sandboxes switch off, and what would undo
# the bounds: SysV and POSIX message queues and memfd hold memory no rlimit counts; a /dev/shm of 1 MiB serves
# multiprocessing's semaphores and shared_memory; modify_ldt is x86's old segment table, which nothing here uses).
DENIED_SYSCALLS = (
    "io_uring_setup", "io_uring_enter", "io_uring_register", "perf_event_open", "userfaultfd", "bpf",
    "add_key", "request_key", "keyctl", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "process_madvise", "shmget", "shmat", "shmctl", "shmdt", "semget", "semop", "semtimedop", "semctl", "msgget",
    "msgsnd", "msgrcv", "msgctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify",
    "mq_getsetattr", "memfd_create", "memfd_secret", "mount", "umount2", "pivot_root", "move_mount", "open_tree",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "unshare", "setns", "chroot", "name_to_handle_at",
    "open_by_handle_at", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "acct",
    "swapon", "swapoff", "reboot", "syslog", "quotactl", "lookup_dcookie", "vhangup", "iopl", "ioperm",
    "fanotify_init", "personality", "modify_ldt")
# System calls newer than the list above get ENOSYS, as from a kernel without them: every number past rseq (the last
# one before Linux 5.1 gave all architectures the same numbers from 424 on) up to SYSCALL_NUMBERS_END, except these,
# read through up to Linux 6.18 (424 and up: the same number on every architecture). A system call added later stays
# refused until someone reads what it does; a deny list alone let open_tree_attr (467, Linux 6.15) through.
REVIEWED_NEW_SYSCALLS = {424: "pidfd_send_signal", 434: "pidfd_open", 436: "close_range", 437: "openat2",
                         439: "faccessat2", 441: "epoll_pwait2", 449: "futex_waitv", 452: "fchmodat2",
                         453: "map_shadow_stack", 454: "futex_wake", 455: "futex_wait", 456: "futex_requeue",
                         462: "mseal", 463: "setxattrat", 464: "getxattrat", 465: "listxattrat", 466: "removexattrat"}
SYSCALL_NUMBERS_END = 600  # room for about 90 new system calls past 6.18's 469 (512-547 are x86-64's x32 numbers)
ALLOWED_SOCKET_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6 (with no network those are inert)
SOCKET_FAMILIES_END = 64  # past AF_MAX: one rule for everything at or above it
SCMP_ACT_ALLOW, SCMP_ACT_ERRNO = 0x7FFF0000, 0x00050000
SCMP_CMP_NE, SCMP_CMP_EQ, SCMP_CMP_GE, SCMP_CMP_MASKED_EQ = 1, 4, 5, 7
INT_BITS = 0xFFFFFFFF  # an int argument is compared in its low 32 bits: the kernel ignores the rest
EPERM, ENOSYS = 1, 38
SOL_SOCKET, SOCKET_BUFFER_OPTIONS = 1, (7, 8, 32, 33)  # SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE


class SetupError(Exception):
    """A step of the isolation failed: reported as status sandbox_error."""


class _ArgCompare(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


LIBC = ctypes.CDLL(None, use_errno=True)


def _call(what: str, result: int) -> int:
    if result == -1:
        errno = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(errno)} (errno {errno})")
    return result


def _encode(text: str | None) -> bytes | None:
    return None if text is None else os.fsencode(text)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _call(f"mount {fstype or source} on {target}",
          LIBC.mount(_encode(source), _encode(target), _encode(fstype), ctypes.c_ulong(flags), _encode(data)))


def _prctl(what: str, option: int, value: int) -> None:
    _call(what, LIBC.prctl(option, ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)))


def _limit(kind: int, soft: int, hard: int | None = None) -> None:
    """Lower a limit; never above the hard limit the trainer already has (raising it would fail)."""
    hard = soft if hard is None else hard
    ceiling = resource.getrlimit(kind)[1]
    if ceiling != resource.RLIM_INFINITY:
        soft, hard = min(soft, ceiling), min(hard, ceiling)
    resource.setrlimit(kind, (soft, hard))


def set_limits(config: dict, processes: int | None) -> None:
    _limit(resource.RLIMIT_CPU, config["cpu_seconds"], config["cpu_seconds"] + 1)  # per process; the init bounds
    _limit(resource.RLIMIT_AS, config["memory_bytes"])  # the total
    _limit(resource.RLIMIT_NOFILE, config["max_open_files"])
    _limit(resource.RLIMIT_FSIZE, config["max_file_bytes"])
    _limit(resource.RLIMIT_CORE, 0)
    if processes is not None:
        _limit(resource.RLIMIT_NPROC, processes)


# ---- the allow-listed root ----

def _bind(source: str, held: int | str, root: str) -> None:
    """`source` at the same path under `root`, read-only later (with the whole root). `held` is an O_PATH descriptor of
    it opened before the new root covered anything, or the target of a symlink, which stays a symlink."""
    target = root + source
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if isinstance(held, str):
        os.symlink(held, target)
        return
    if os.path.isdir(f"/proc/self/fd/{held}"):
        os.makedirs(target, exist_ok=True)
    else:
        open(target, "w").close()
    _mount(f"/proc/self/fd/{held}", target, None, MS_BIND | MS_REC)
    os.close(held)


def _allowed_paths(config: dict) -> list[str]:
    """What the code may read: the system's programs and libraries, the interpreter's installation, and what the
    task added. Sorted and without paths inside another one (a bind brings what is below it)."""
    interpreter = os.path.realpath(sys.executable)
    paths = {*SYSTEM_DIRS, *ETC_FILES, sys.base_prefix, sys.base_exec_prefix, os.path.dirname(interpreter),
             *config["read_only_paths"]}
    paths = sorted(path if os.path.islink(path) else os.path.realpath(path)
                   for path in paths if os.path.lexists(path))
    kept: list[str] = []
    for path in paths:
        if not any(path == done or path.startswith(done.rstrip("/") + "/") for done in kept):
            kept.append(path)
    return kept


def build_root(config: dict, uid: int, gid: int) -> None:
    """In the init (PID 1 of the new PID namespace, in a fresh mount namespace): a tmpfs root holding read-only binds of
    the allow list, a minimal /etc and /dev and this namespace's /proc (mounted while the host's is still visible,
    which the kernel requires of a proc mount in a user namespace), then pivot_root into it and drop the old root
    entirely. /work (the code's directory, max_disk_bytes) and /dev/shm (1 MiB) are the only writable places."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates back to the host
    held = {path: os.readlink(path) if os.path.islink(path) else os.open(path, os.O_PATH)
            for path in _allowed_paths(config)}  # before the tmpfs below covers any of them
    root = "/tmp"  # any directory serves as the mount point: the tmpfs over it becomes "/"
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=1024,mode=755")
    for path, handle in held.items():
        _bind(path, handle, root)
    os.makedirs(f"{root}/etc", exist_ok=True)
    with open(f"{root}/etc/passwd", "w") as passwd:
        passwd.write(f"sandbox:x:{uid}:{gid}:sandbox:/work:/bin/sh\n")
    with open(f"{root}/etc/group", "w") as group:
        group.write(f"sandbox:x:{gid}:\n")
    for name in ("proc", "work", "dev/shm"):
        os.makedirs(f"{root}/{name}")
    _mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in DEVICES:
        if os.path.exists(f"/dev/{name}"):
            open(f"{root}/dev/{name}", "w").close()
            _mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    machine = os.uname().machine
    if machine not in SYS_PIVOT_ROOT:
        raise SetupError(f"pivot_root: no system call number known for {machine}")
    os.chdir(root)
    _call("pivot_root", LIBC.syscall(SYS_PIVOT_ROOT[machine], b".", b"."))  # the old root now lies under the new
    _call("umount2 of the old root", LIBC.umount2(b".", MNT_DETACH))
    os.chdir("/")
    _read_only("/", True, recursive=True)
    _read_only("/proc", False, recursive=False)  # until the init has written its id maps and limits there
    _mount("tmpfs", "/work", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={config['max_disk_bytes']},nr_inodes={config['max_inodes']},mode=700,uid={uid},gid={gid}")
    _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=1m,nr_inodes=64,mode=1777")
    os.chdir("/work")


def _read_only(path: str, on: bool, recursive: bool) -> None:
    attributes = _MountAttr(MOUNT_ATTR_RDONLY if on else 0, 0 if on else MOUNT_ATTR_RDONLY, 0, 0)
    _call(f"mount_setattr {path}", LIBC.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(),
                                                AT_RECURSIVE if recursive else 0, ctypes.byref(attributes),
                                                ctypes.sizeof(attributes)))


def _write_id_maps(uid: int, gid: int) -> None:
    """Map the one user to itself: no other id exists in the namespace, so the code cannot change its ids."""
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        try:
            with open(f"/proc/self/{name}", "w") as file:
                file.write(text)
        except OSError as error:
            raise SetupError(f"writing /proc/self/{name}: {error.strerror}") from error


def enter_namespaces(config: dict) -> None:
    """The monitor: new namespaces (its next child is PID 1 of the new PID namespace). A root trainer's stay owned by
    the host's user namespace until the init has built the root: its user namespace comes last, so the mounts are
    locked in it (they cannot be undone from inside).

    The process limit is set in the call's own user namespace, after it exists: RLIMIT_NPROC counts the processes of
    one user in one user namespace, and a new user namespace takes its creator's RLIMIT_NPROC as the bound of that
    user's processes in the parent namespace (kernel/user_namespace.c, enforced_nproc_rlimit). Lowered before the
    unshare, it would bound every call's processes of the same user together."""
    if config["simulate_no_namespaces"]:
        raise SetupError("unshare(CLONE_NEWUSER): Operation not permitted (errno 1) [simulated]")
    if os.geteuid() == 0:
        _call("unshare(CLONE_NEWNS|CLONE_NEWPID|...)", LIBC.unshare(NAMESPACES & ~CLONE_NEWUSER))
    else:
        uid, gid = os.geteuid(), os.getegid()
        _call("unshare(CLONE_NEWUSER|...)", LIBC.unshare(NAMESPACES))
        _write_id_maps(uid, gid)
        _limit(resource.RLIMIT_NPROC, config["max_processes"] + 2)  # this process, the init and the code's


def confine_init(config: dict) -> None:
    """The init: the root, then (a root trainer) the unprivileged user in a user namespace of its own; no nested user
    namespaces; non-dumpable; no capabilities."""
    as_root = os.geteuid() == 0
    uid = config["unprivileged_uid"] if as_root else os.geteuid()
    gid = uid if as_root else os.getegid()
    build_root(config, uid, gid)
    if as_root:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        _prctl("prctl(PR_SET_DUMPABLE)", PR_SET_DUMPABLE, 1)  # the uid change cleared it; /proc/self needs it
        _call("unshare(CLONE_NEWUSER|CLONE_NEWNS)", LIBC.unshare(CLONE_NEWUSER | CLONE_NEWNS))
        _write_id_maps(uid, uid)
        _limit(resource.RLIMIT_NPROC, config["max_processes"] + 1)  # this process and the code's (enter_namespaces)
    with open("/proc/sys/user/max_user_namespaces", "w") as limit:  # this user namespace's own limit
        limit.write("0")
    _read_only("/proc", True, recursive=False)
    _prctl("prctl(PR_SET_DUMPABLE)", PR_SET_DUMPABLE, 0)  # /proc/1/* is closed to the code
    drop_capabilities()


def drop_capabilities() -> None:
    """No capabilities, now or after exec (the code's uid is not 0 in its namespace, and no_new_privs)."""
    for capability in range(64):
        if LIBC.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(capability), ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0)) == -1:
            break  # EINVAL past the last capability; EPERM where there is none to drop
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3, all zero
    _call("capset", LIBC.capset(ctypes.byref(header), data))
    _prctl("prctl(PR_SET_NO_NEW_PRIVS)", PR_SET_NO_NEW_PRIVS, 1)


def install_seccomp() -> None:
    """The filter, through the system's libseccomp: EPERM for DENIED_SYSCALLS, clone with a namespace flag, sockets
    outside ALLOWED_SOCKET_FAMILIES, and for what would undo a bound:
    - socket buffers past the system's default size (SO_SNDBUF and the like): unix sockets hold their queued data in
      kernel memory that no rlimit counts, up to net.core.wmem_max per socket (4 MiB, doubled, on our machines; the
      sysctl is the host's, not a network namespace's own);
    - another process's limits and scheduling (prlimit64, setpriority, sched_set*; the caller names itself as pid 0):
      the init, of the same user, would be the target, and setpriority's PRIO_USER every process of that user.
    ENOSYS for clone3 (the C library falls back to clone, whose flags a filter can read) and for the system calls
    newer than this filter (REVIEWED_NEW_SYSCALLS). Another architecture's system calls (x32, i386) kill the process
    (libseccomp's default for them)."""
    try:
        seccomp = ctypes.CDLL("libseccomp.so.2")
    except OSError as error:
        raise SetupError(f"seccomp: libseccomp.so.2 cannot be loaded ({error})") from error
    seccomp.seccomp_init.restype = ctypes.c_void_p
    seccomp.seccomp_init.argtypes = [ctypes.c_uint32]
    seccomp.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                               ctypes.POINTER(_ArgCompare)]
    seccomp.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    seccomp.seccomp_load.argtypes = [ctypes.c_void_p]
    seccomp.seccomp_release.argtypes = [ctypes.c_void_p]
    context = seccomp.seccomp_init(SCMP_ACT_ALLOW)
    if not context:
        raise SetupError("seccomp: seccomp_init failed")

    ruled: set[int] = set()

    def deny(name: str | int, errno: int = EPERM, *comparisons: tuple[int, int, int, int]) -> None:
        number = name if isinstance(name, int) else seccomp.seccomp_syscall_resolve_name(name.encode())
        if number < 0:
            return  # not a system call of this architecture
        array = (_ArgCompare * max(1, len(comparisons)))(*comparisons)
        result = seccomp.seccomp_rule_add_array(context, SCMP_ACT_ERRNO | errno, number, len(comparisons), array)
        if result < 0:
            raise SetupError(f"seccomp: a rule for {name} failed ({os.strerror(-result)})")
        ruled.add(number)

    try:
        for name in DENIED_SYSCALLS:
            deny(name)
        deny("clone3", ENOSYS)
        deny("prlimit64", EPERM, (0, SCMP_CMP_NE, 0, 0), (2, SCMP_CMP_NE, 0, 0))  # reading another's limits is fine
        for name in ("sched_setscheduler", "sched_setparam", "sched_setattr"):
            deny(name, EPERM, (0, SCMP_CMP_NE, 0, 0))
        deny("setpriority", EPERM, (0, SCMP_CMP_NE, 0, 0))  # PRIO_PROCESS only,
        deny("setpriority", EPERM, (1, SCMP_CMP_NE, 0, 0))  # of the caller itself (os.nice)
        for option in SOCKET_BUFFER_OPTIONS:
            deny("setsockopt", EPERM, (1, SCMP_CMP_MASKED_EQ, INT_BITS, SOL_SOCKET),
                 (2, SCMP_CMP_MASKED_EQ, INT_BITS, option))
        for flag in (CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET,
                     CLONE_NEWCGROUP):
            deny("clone", EPERM, (0, SCMP_CMP_MASKED_EQ, flag, flag))
        for name in ("socket", "socketpair"):
            for family in range(SOCKET_FAMILIES_END):
                if family not in ALLOWED_SOCKET_FAMILIES:
                    deny(name, EPERM, (0, SCMP_CMP_EQ, family, 0))
            deny(name, EPERM, (0, SCMP_CMP_GE, SOCKET_FAMILIES_END, 0))
        last_old = seccomp.seccomp_syscall_resolve_name(b"rseq")
        if last_old < 0:
            raise SetupError("seccomp: this libseccomp does not know rseq")
        for number in range(last_old + 1, SYSCALL_NUMBERS_END):
            if number not in ruled and number not in REVIEWED_NEW_SYSCALLS:
                deny(number, ENOSYS)
        result = seccomp.seccomp_load(context)
        if result < 0:
            raise SetupError(f"seccomp: loading the filter failed ({os.strerror(-result)})")
    finally:
        seccomp.seccomp_release(context)


# ---- the three processes ----

def _report(message: dict) -> None:
    os.write(REPORT_FD, (json.dumps(message) + "\n").encode())


def _read_line(fd: int) -> bytes:
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        data += chunk
    return bytes(data)


def main() -> None:
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_IGN)  # discards one the trainer's process group got while this was forked
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # the spawn blocked them (sandbox.py's _start_monitor)
    line = _read_line(0)
    if not line:
        os._exit(0)  # a pre-started monitor the trainer never used
    request = json.loads(line)
    config, code = request["config"], request["code"]
    if config["report_fd"] != REPORT_FD:
        os.dup2(config["report_fd"], REPORT_FD)
        os.close(config["report_fd"])
    started = time.monotonic()
    usage = None
    try:
        _join_fresh_keyring()
        if config["cpu_usage_file"]:  # while the host's cgroup file system is still in reach
            usage = os.open(config["cpu_usage_file"], os.O_RDONLY)
        set_limits(config, processes=None)  # the process limit waits for the call's user namespace
        if config["isolated"]:
            enter_namespaces(config)
        else:
            _unisolated_user(config)
    except (SetupError, OSError, ValueError) as error:
        _report({"setup_error": str(error)})
        os._exit(2)
    status_read, status_write = os.pipe()
    alive = os.pidfd_open(os.getpid())  # readable once this process is gone: the init looks after its last uid change
    init = os.fork()
    if init == 0:
        os.close(status_read)
        os.close(REPORT_FD)
        _init(config, code, status_write, alive, usage)
    os.close(alive)
    if usage is not None:
        os.close(usage)
    os.close(status_write)
    os.close(1)  # the output pipe's ends are only the code's now: its EOF means every process of the call is gone
    os.close(2)
    ending = _watch(init, started + config["wall_seconds"], group=not config["isolated"])
    _, wait_status, _ = os.wait4(init, 0)
    status = _read_line(status_read).decode(errors="replace").split()
    if ending is not None:
        _report({"ending": ending})
    elif len(status) == 3 and status[0] == "exit":
        _report({"ending": "exit", "exit_code": os.waitstatus_to_exitcode(int(status[1])),
                 "cpu_seconds": float(status[2])})
    elif len(status) == 2 and status[0] == "cpu":
        _report({"ending": "cpu", "cpu_seconds": float(status[1])})
    elif len(status) == 2 and status[0] == "setup_error":
        _report({"setup_error": bytes.fromhex(status[1]).decode(errors="replace")})
    else:  # the init died without a word: killed from outside, or the memory bound
        _report({"ending": "killed", "init_status": os.waitstatus_to_exitcode(wait_status)})
    os._exit(0)


def _join_fresh_keyring() -> None:
    """A new anonymous session keyring: the trainer's keys (Kerberos caches, stored tokens) are not the code's, and
    nothing one call leaves there reaches the next (the filter denies the keyring calls as well)."""
    machine = os.uname().machine
    if machine not in SYS_KEYCTL:
        raise SetupError(f"keyctl: no system call number known for {machine}")
    _call("keyctl(KEYCTL_JOIN_SESSION_KEYRING)", LIBC.syscall(SYS_KEYCTL[machine], KEYCTL_JOIN_SESSION_KEYRING, None))


def _watch(init: int, deadline: float, group: bool) -> str | None:
    """Wait for the init to exit: None; at the deadline or when the trainer writes to (or closes) standard input, kill
    it (and with it the namespace) and say why: "timeout" or "stopped"."""
    pidfd = os.pidfd_open(init)
    try:
        while True:
            left = deadline - time.monotonic()
            ready = select.select([pidfd, 0], [], [], max(0.0, left))[0] if left > 0 else []
            if pidfd in ready:
                return None
            if not ready or 0 in ready:
                try:
                    (os.killpg if group else os.kill)(init, signal.SIGKILL)
                except ProcessLookupError:  # unisolated, before the init made its group: the init alone
                    os.kill(init, signal.SIGKILL)
                return "stopped" if ready else "timeout"
    finally:
        os.close(pidfd)


def _unisolated_user(config: dict) -> None:
    """Without namespaces: a root trainer still runs the code as the unprivileged user where it can reach the
    interpreter; the process limit counts every process of that user."""
    uid = os.geteuid()
    if uid == 0 and _reachable_by_others(os.path.dirname(os.__file__)):
        uid = config["unprivileged_uid"]
        os.chown(config["workdir"], uid, uid)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    os.chdir(config["workdir"])
    set_limits(config, processes=_tasks_of_user(uid) + config["max_processes"] + 2)


def _reachable_by_others(path: str) -> bool:
    while True:
        if not os.stat(path).st_mode & 0o001:
            return False
        if path == os.path.dirname(path):
            return True
        path = os.path.dirname(path)


def _tasks_of_user(uid: int) -> int:
    """Processes and threads of `uid` now: RLIMIT_NPROC counts them all where there is no user namespace."""
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


def _init(config: dict, code: str, status_write: int, monitor: int, usage: int | None) -> None:
    """PID 1 of the new namespace (or, unisolated, the code's parent): start the code, reap everything, bound the
    total CPU, tell the monitor how the code ended. It dies with the monitor: the parent-death signal is armed after
    the last change of its user ids (which clears it: kernel/cred.c, commit_creds), and a monitor already gone by then
    shows on its pidfd. `usage` is the call's cgroup CPU counter, or None."""
    isolated = config["isolated"]
    try:
        if isolated:
            confine_init(config)
            _prctl("prctl(PR_SET_PDEATHSIG)", PR_SET_PDEATHSIG, signal.SIGKILL)  # the monitor is single-threaded
            if select.select([monitor], [], [], 0)[0]:
                os._exit(2)
        else:
            os.setsid()  # the code's process group is this one: the monitor's kill reaches every process in it
            _prctl("prctl(PR_SET_NO_NEW_PRIVS)", PR_SET_NO_NEW_PRIVS, 1)
        os.close(monitor)
        if config["seccomp"]:
            install_seccomp()  # here, so that the init is filtered too; the code inherits it
        before = _cgroup_cpu(usage) - _own_cpu() if usage is not None else 0.0  # the monitor's and this setup's
        child = os.fork()
    except (SetupError, OSError) as error:
        os.write(status_write, f"setup_error {str(error).encode().hex()}\n".encode())
        os._exit(2)
    if child == 0:
        os.closerange(3, 1 << 20)  # the status pipe first: the code never holds a way to the report
        _code_process(code, isolated)
    null = os.open("/dev/null", os.O_WRONLY)  # nothing of this process reaches the code's output, not even a crash
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)
    cpu_limit = config["cpu_seconds"]
    while True:
        try:
            pid, wait_status = os.waitpid(-1 if isolated else child, os.WNOHANG)
        except ChildProcessError:
            pid, wait_status = 0, 0
        if pid == child:
            os.write(status_write, f"exit {wait_status} {_cpu_total(isolated, None, usage, before):.3f}\n".encode())
            break
        if pid:
            continue  # an orphan reaped: look again at once
        total = _cpu_total(isolated, child, usage, before)
        if total > cpu_limit:
            os.write(status_write, f"cpu {total:.3f}\n".encode())
            break
        time.sleep(CPU_POLL_S)
    if not isolated:
        os.killpg(0, signal.SIGKILL)  # what the code left running in this group (this process too)
    os._exit(0)  # as PID 1, its exit kills what the code left running


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cgroup_cpu(usage: int) -> float:
    """CPU seconds of every process the call's cgroup leaf has held, alive, reaped or reaped by the kernel: v1's
    cpuacct.usage (nanoseconds) or v2's cpu.stat (its first line, usage_usec)."""
    words = os.pread(usage, 4096, 0).split()
    return int(words[1]) / 1e6 if words[0] == b"usage_usec" else int(words[0]) / 1e9


def _cpu_total(isolated: bool, child: int | None, usage: int | None, before: float) -> float:
    """CPU seconds of every process of the call. With a cgroup: its counter, less what the monitor and this init
    used before the code started and what this init used since. Without: the children this init reaped, plus, for
    each one alive, its own and its reaped children's (each process's time is counted once: in its parent's total or
    alive). Not counted: the processes the kernel reaps (their parent ignores SIGCHLD or set SA_NOCLDWAIT), whose
    time is added to no parent's (kernel/exit.c: exit_notify releases them without wait_task_zombie's sum)."""
    if usage is not None:
        return _cgroup_cpu(usage) - _own_cpu() - before
    usage_of_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = usage_of_children.ru_utime + usage_of_children.ru_stime
    pids = [name for name in os.listdir("/proc") if name.isdigit() and name != "1"] if isolated else \
        ([str(child)] if child else [])
    ticks = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(value) for value in fields[11:15]) / ticks  # utime stime cutime cstime
    return total


def _code_process(code: str, isolated: bool) -> None:
    if isolated:
        os.setsid()  # its own process group: kill(0, ...) reaches none of the monitor's (unisolated: the init's group)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    _run_code(code)


def _run_code(code: str) -> None:
    """Run the code as __main__ would run; an uncaught MemoryError exits with MEMORY_EXIT."""
    import linecache
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
            import traceback
            traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        except MemoryError:
            os.write(2, b"MemoryError\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(MEMORY_EXIT)
    except BaseException as error:  # noqa: B036 (the traceback the user's program would print, then exit 1)
        import traceback
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        raise SystemExit(1) from None
    raise SystemExit(0)  # the interpreter's normal exit: atexit handlers, threads joined, buffers flushed


if __name__ == "__main__":
    main()
