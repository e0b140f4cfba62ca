"""Run a script whose log writes find the disk full after a given step: `python tests/workers/full_log.py STEP SCRIPT
ARGS...` (under torchrun too). A fault injected at the write, where a small file system cannot be filled at the right
moment: a line of a few hundred bytes still fits in the last page a file already holds."""

import errno
import json
import os
import runpy
import sys

import common.tracking

last_step, append_line = int(sys.argv[1]), common.tracking._append_line


def append_until_full(handle: object, line: str) -> None:
    if json.loads(line)["step"] > last_step:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    append_line(handle, line)


common.tracking._append_line = append_until_full
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
