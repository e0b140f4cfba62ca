"""tasks/sandbox.py against the code a model writes by accident or on purpose: each hostile program must end within
its limit, the reply must say what happened, nothing may outlive the call, and the next call must work. Small limits
(CPU 1 s, wall clock 2-3 s) keep the file fast; the tests that need namespaces skip where they are unavailable, and
a negative control shows each check would catch a leak."""

import os
import socket
import stat
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tasks.sandbox import REPO, STATUSES, Sandbox, SandboxResult, python

PROBLEM = Sandbox().isolation_problem()
needs_namespaces = pytest.mark.skipif(PROBLEM is not None, reason=f"no namespaces here: {PROBLEM}")


def small(**overrides) -> Sandbox:
    return Sandbox(**{"cpu_seconds": 1, "wall_seconds": 3.0, "max_processes": 8, "memory_bytes": 256 * 2**20,
                      **overrides})


def timed(sandbox: Sandbox, code: str) -> tuple[SandboxResult, float]:
    started = time.monotonic()
    result = sandbox.run(code)
    elapsed = time.monotonic() - started
    print(f"{result.status:>12} {elapsed:6.2f} s  {code.splitlines()[-1][:60]!r}")
    assert result.status in STATUSES
    return result, elapsed


def still_works(sandbox: Sandbox) -> None:
    result = sandbox.run("print(2+3)")
    assert (result.status, result.output) == ("ok", "5\n")


def processes_with(marker: str) -> list[str]:
    """Command lines on this machine that contain `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found.append(cmdline)
    return found


@pytest.fixture
def shared_dir():
    """A directory in /tmp any user can read and write (unlike pytest's tmp_path, which is private): a check that
    the sandbox cannot read or write it means something."""
    path = tempfile.mkdtemp(prefix="sandbox-test-")
    os.chmod(path, 0o777)
    yield path
    for child in Path(path).iterdir():
        child.unlink()
    os.rmdir(path)


@needs_namespaces
def test_normal_call_and_tool():
    result, elapsed = timed(small(), "print(2+3)")
    assert (result.status, result.output, result.exit_code, result.text) == ("ok", "5\n", 0, "5\n")
    assert elapsed < 2
    assert python("print(2+3)") == "5\n"
    assert python.sandbox.isolated
    assert python("import sys; print('out'); sys.exit(3)") == "out\n[exit code 3]"
    assert python("1/0").endswith("ZeroDivisionError: division by zero\n[exit code 1]")
    assert "SyntaxError" in python("def f(:")
    for weird in ["\0", "\ud800", "import os; os.close(1); os.close(2)", "raise SystemExit('bye')", ""]:
        assert isinstance(python(weird), str)


def test_tool_schema():
    from transformers.utils import get_json_schema

    schema = get_json_schema(python)["function"]
    assert schema["name"] == "python" and schema["parameters"]["required"] == ["code"]
    assert schema["parameters"]["properties"]["code"]["type"] == "string"


@needs_namespaces
def test_infinite_loop_hits_cpu_limit():
    sandbox = small(wall_seconds=5.0)  # far enough that the CPU limit fires first even on a busy machine
    result, elapsed = timed(sandbox, "while True: pass")
    assert result.status == "timeout" and "CPU limit of 1 s" in result.text and elapsed < 4.5
    # Ignoring SIGXCPU only buys the second before the hard limit's SIGKILL.
    result, elapsed = timed(sandbox, "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass")
    assert result.status == "timeout" and "CPU limit" in result.text and elapsed < 4.5
    still_works(sandbox)


@needs_namespaces
def test_sleep_hits_wall_clock():
    sandbox = small(wall_seconds=2.0)
    result, elapsed = timed(sandbox, "import time; time.sleep(100)")
    assert result.status == "timeout" and result.text == "[timeout: killed after 2 s wall clock]"
    assert 2.0 <= elapsed < 3.5
    still_works(sandbox)


@needs_namespaces
def test_fork_bomb_is_bounded_and_leaves_nothing(tmp_path):
    marker = str(tmp_path / uuid.uuid4().hex)  # in the child's command line (its hidden paths): finds leftovers
    sandbox = small(hidden_paths=(marker,))
    result, elapsed = timed(sandbox, "import os\nwhile True: os.fork()")
    assert elapsed < 3.5
    assert result.status in ("error", "timeout") and "Resource temporarily unavailable" in result.output
    assert processes_with(marker) == []
    still_works(sandbox)


@needs_namespaces
def test_memory_bombs():
    sandbox = small()
    result, elapsed = timed(sandbox, "x = bytearray(10**10)")
    assert result.status == "memory" and "MemoryError" in result.output and "[memory limit 256 MiB]" in result.text
    assert elapsed < 2
    result, elapsed = timed(sandbox, "x = []\nwhile True: x.append(' ' * 10**6)")
    assert result.status in ("memory", "killed") and elapsed < 3.5
    assert "[memory limit 256 MiB]" in result.text or "[killed by" in result.text
    still_works(sandbox)


@needs_namespaces
def test_huge_output_is_cut_fast():
    sandbox = small()
    for code in ["print('x' * 100_000_000)", "while True: print('y' * 1000)"]:
        result, elapsed = timed(sandbox, code)
        assert result.status == "output_cut" and elapsed < 2.5
        assert len(result.output) == sandbox.max_output_bytes
        assert result.text.endswith(f"[output cut at {sandbox.max_output_bytes} bytes]")
    still_works(sandbox)


@needs_namespaces
def test_setsid_and_background_escapes_die_with_the_call():
    sandbox = small()
    tag = f"{time.time_ns() % 10**6 + 10**6}"  # a unique sleep length: finds the escapees on this machine
    code = (f"import os, subprocess, time\n"
            f"subprocess.Popen(['sleep', '{tag}.1'])\n"
            f"if os.fork() == 0:\n"
            f"    os.setsid()\n"
            f"    if os.fork() == 0:\n"
            f"        os.execv('/bin/sleep', ['sleep', '{tag}.2'])\n"
            f"    os._exit(0)\n"
            f"time.sleep(0.2)\n"
            f"print('parent done')")
    result, elapsed = timed(sandbox, code)
    assert (result.status, result.output) == ("ok", "parent done\n") and elapsed < 2
    time.sleep(0.1)  # the kernel's kill of the namespace is asynchronous
    assert processes_with(f"sleep {tag}") == []
    still_works(sandbox)


@needs_namespaces
def test_hidden_paths_cannot_be_read(shared_dir):
    secret = Path(shared_dir, "secret.txt")
    secret.write_text("the run's secret")
    secret.chmod(0o644)
    reader = f"print(open({str(secret)!r}).read())"
    visible = timed(small(hidden_paths=()), reader)[0]
    assert visible.output == "the run's secret\n"  # negative control: readable when not hidden
    for hidden in [(shared_dir,), (str(secret),)]:  # a hidden directory, a hidden file
        result = timed(small(hidden_paths=hidden), reader)[0]
        assert "the run's secret" not in result.text
    result = timed(small(), f"print(open({os.path.join(REPO, 'README.md')!r}).read())")[0]
    assert result.status == "error" and "FileNotFoundError" in result.output  # the repository is hidden by default
    result = timed(small(), "import os\nprint(os.listdir('/tmp'), sorted(int(p) for p in os.listdir('/proc')"
                            " if p.isdigit()))")[0]
    assert shared_dir not in result.output and result.output.endswith(" [1, 2]\n")  # /tmp hidden; /proc shows only
    # the sandbox's init and the code


@needs_namespaces
def test_cannot_write_outside_its_directory(shared_dir):
    target = Path(shared_dir, "written.txt")
    in_repo = Path(REPO, f"sandbox-probe-{uuid.uuid4().hex}.txt")
    writer = "open({!r}, 'w').write('x')\nprint('wrote')"
    unisolated = small(isolated=False)
    assert timed(unisolated, writer.format(str(target)))[0].output == "wrote\n"  # negative control
    target.unlink()
    for sandbox in [small(hidden_paths=(shared_dir,)), small(hidden_paths=())]:  # hidden; visible but read-only
        result = timed(sandbox, writer.format(str(target)))[0]
        assert result.status == "error" and "Read-only file system" in result.output and not target.exists()
    result = timed(small(), writer.format(str(in_repo)))[0]
    assert result.status == "error" and not in_repo.exists()
    # Its own directory is writable, within max_file_bytes and max_disk_bytes.
    result = timed(small(), "open('a', 'w').write('x' * 1000)\nopen('b', 'w').write('x' * 2**21)")[0]
    assert result.status == "error" and "File too large" in result.output
    fill = "for i in range(3):\n    open(str(i), 'w').write('x' * (2**20 - 1))"
    result = timed(small(max_disk_bytes=2 * 2**20), fill)[0]
    assert result.status == "error" and "No space left on device" in result.output


@needs_namespaces
def test_no_network():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        connect = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
        assert timed(small(isolated=False), connect)[0].output == "connected\n"  # negative control
        listener.accept()[0].close()
        result, elapsed = timed(small(), connect)
        assert result.status == "error" and "Network is unreachable" in result.output and elapsed < 2
        with pytest.raises(TimeoutError):
            listener.accept()
    for code in ["import socket\nsocket.create_connection(('192.0.2.1', 80), timeout=1)",  # TEST-NET-1
                 "import socket\nsocket.getaddrinfo('example.com', 443)"]:
        result, elapsed = timed(small(), code)
        assert result.status == "error" and ("unreachable" in result.output or "gaierror" in result.output)
        assert elapsed < 2


@needs_namespaces
def test_no_capabilities_to_undo_the_isolation():
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print([line.split()[1] for line in open('/proc/self/status') if line.startswith(('CapEff', 'CapBnd'))])\n"
            "print(libc.umount2(b'/tmp', 2), libc.mount(None, b'/', None, 32 | 4096, None),"
            " libc.unshare(0x10000000), libc.unshare(0x40000000))")
    result = timed(small(), code)[0]
    assert result.output == "['0000000000000000', '0000000000000000']\n-1 -1 -1 -1\n"


def test_refusal_without_namespaces():
    sandbox = small(simulate_no_namespaces=True)
    assert "Operation not permitted" in sandbox.isolation_problem()
    message = sandbox.check(allow_unisolated=False)
    assert "--allow-unisolated-tools" in message and "Operation not permitted" in message
    assert sandbox.isolated
    result = timed(sandbox, "print(2+3)")[0]
    assert result.status == "sandbox_error" and "5" not in result.output  # fails closed, never unisolated silently
    assert sandbox.check(allow_unisolated=True) is None and not sandbox.isolated
    still_works(sandbox)
    result, elapsed = timed(sandbox, "while True: pass")
    assert result.status == "timeout" and elapsed < 3.5
    assert timed(sandbox, "x = bytearray(10**10)")[0].status == "memory"
    assert timed(sandbox, "print('x' * 100_000_000)")[0].status == "output_cut"
    result = timed(sandbox, "import os\nprint(os.listdir('.'), os.environ['HOME'] == os.getcwd())")[0]
    assert result.output == "[] True\n"  # a fresh directory, a minimal environment
    assert stat.S_ISDIR(os.stat(REPO).st_mode)


@needs_namespaces
def test_check_passes_here():
    sandbox = Sandbox()
    assert sandbox.check(allow_unisolated=False) is None and sandbox.isolated
