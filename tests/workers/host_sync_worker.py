"""Run a training script's __main__ in this process (argv: script, output JSON, the script's arguments) and record
what, on a GPU, would make the host wait for the device inside a micro-batch loop: the calls made between one
backward and the next backward of the same optimizer step (the forward of the next micro-batch, the diagnostics of
the last). Recorded: reads of a tensor's values on the host (item, tolist, bool/int/float of a tensor, nonzero,
numpy, cpu), tensors made from host data (torch.tensor, as_tensor), indexing with a Python list (a host tensor,
copied to the device before the kernel), and `.to(a device)` in this repository's code (transformers' own no-op
`.to(x.device)` of its rotary buffer is left out: a same-device `to` costs nothing). For tests/test_gpu_path.py."""

import collections
import json
import runpy
import sys
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

ROOT = str(Path(__file__).resolve().parents[2])
HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.nonzero, torch.nonzero,
              torch.Tensor.cpu, torch.tensor, torch.as_tensor}


def _caller() -> str:
    frame = next((f for f in reversed(traceback.extract_stack()[:-3]) if "torch/" not in f.filename), None)
    return f"{Path(frame.filename).name}:{frame.lineno}" if frame else "?"


def _from_this_repository() -> bool:
    frame = next((f for f in reversed(traceback.extract_stack()[:-3]) if "torch/" not in f.filename), None)
    return frame is not None and frame.filename.startswith(ROOT) and "/.venv/" not in frame.filename


class HostSyncWatch(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.in_loop, self.since_backward, self.found, self.backwards = False, [], collections.Counter(), 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.in_loop:
            index = args[1] if func is torch.Tensor.__getitem__ else None
            if func in HOST_READS:
                self.since_backward.append(f"{func.__name__} at {_caller()}")
            elif index is not None and any(isinstance(i, list) for i in (index if isinstance(index, tuple) else
                                                                         (index,))):
                self.since_backward.append(f"index with a list at {_caller()}")
            elif func is torch.Tensor.to and any(isinstance(a, torch.device | str) for a in (*args[1:],
                                                                                          *kwargs.values())):
                if _from_this_repository():
                    self.since_backward.append(f"to(device) at {_caller()}")
        return func(*args, **kwargs)

    def backward_called(self) -> None:  # what happened since the previous backward of this step was in the loop
        self.found.update(self.since_backward)
        self.since_backward, self.in_loop = [], True
        self.backwards += 1

    def step_ended(self) -> None:  # after the last backward: the clip and the optimizer step may read values
        self.since_backward, self.in_loop = [], False


def watch(script: str, output: str, script_args: list[str]) -> None:
    monitor = HostSyncWatch()
    backward, clip = torch.Tensor.backward, torch.nn.utils.clip_grad_norm_

    def watched_backward(self, *args, **kwargs):
        monitor.backward_called()
        return backward(self, *args, **kwargs)

    def watched_clip(*args, **kwargs):
        monitor.step_ended()
        return clip(*args, **kwargs)

    torch.Tensor.backward, torch.nn.utils.clip_grad_norm_ = watched_backward, watched_clip
    sys.argv = [script, *script_args]
    with monitor:
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as done:
            if done.code:
                raise
    Path(output).write_text(json.dumps({"found": dict(monitor.found), "backwards": monitor.backwards}))


if __name__ == "__main__":
    watch(sys.argv[1], sys.argv[2], sys.argv[3:])
