"""Run a command on a small file system made for it, and fill that file system at a chosen moment: for the full-disk
tests. Run inside a new user and mount namespace (`unshare --user --map-root-user --mount`), where an unprivileged
process may mount a tmpfs that no other process sees:

    python tests/workers/small_disk.py MOUNT SIZE_MIB TRIGGER LEAVE_KIB COPY_TO -- COMMAND...

mounts a tmpfs of SIZE_MIB at MOUNT, starts COMMAND, waits until a path matching the glob TRIGGER (relative to MOUNT)
exists, then fills the file system until at most LEAVE_KIB are free, waits for COMMAND, copies what MOUNT holds (the
filler left out) to COPY_TO, which outlives the namespace, and exits with COMMAND's status."""

import shutil
import subprocess
import sys
import time
from pathlib import Path


def fill(mount: Path, leave: int) -> None:
    with open(mount / "filler", "wb") as filler:
        try:
            while (free := shutil.disk_usage(mount).free) > leave:
                filler.write(b"\0" * min(free - leave, 1 << 20))
                filler.flush()
        except OSError:  # the last page did not fit: full
            pass


if __name__ == "__main__":
    mount, size_mib, trigger, leave_kib, copy_to = sys.argv[1:6]
    command = sys.argv[sys.argv.index("--") + 1:]
    mount = Path(mount)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(mount)], check=True)
    process = subprocess.Popen(command)
    while not list(mount.glob(trigger)) and process.poll() is None:
        time.sleep(0.05)
    if process.poll() is None:
        fill(mount, int(leave_kib) * 1024)
    status = process.wait()
    shutil.copytree(mount, copy_to, ignore=lambda directory, names: ["filler"] if Path(directory) == mount else [])
    sys.exit(status)
