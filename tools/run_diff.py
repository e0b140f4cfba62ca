"""run_diff: where two run directories part ways.

    python tools/run_diff.py RUN_A RUN_B              # metrics, final weights, manifests, the last common checkpoint
    python tools/run_diff.py RUN_A RUN_B --step 200   # the checkpoints of step 200
    python tools/run_diff.py RUN_A RUN_B --no-checkpoints

It reports the first record of metrics.jsonl (its step and the first metric, in sorted-name order) where the runs
differ, whether final.json's parameter hashes agree, the arguments, software and settings of manifest.json that
differ, and for two checkpoints of the same step the first tensor by name that differs, with its largest absolute
difference and how many elements differ. Tensors are read one at a time from the checkpoints' safetensors exports
(a 7B model never sits in memory whole); DQN's checkpoints hold their networks in trainer_state.pt. Wall-clock files
(perf.jsonl, timings.jsonl) and wall-clock metrics are ignored: they differ between any two runs.

Exit status: 0 the training is identical (metrics, final weights and checkpoints; manifests may differ, e.g. in the
software or the launch, and are then listed), 1 the runs differ, 2 bad input (a path that is not a run directory).
"""

import argparse
import contextlib
import json
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.tracking import WALL_CLOCK_PREFIXES  # noqa: E402

# Manifest entries that differ between any two runs, even identical ones: when and how each was started, and where
# it writes. Prefixes of the flattened names ("launch." covers launch.run_id, launch.master, ...).
BOOKKEEPING = ("started", "command", "launch.", "args.run_root", "resumed")
CHUNK_ELEMENTS = 1 << 24  # tensors are compared in pieces of this many elements: bounded memory for the difference
SAME_SIZE_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class BadInput(ValueError):
    """A path that is not a run directory, or a checkpoint step the runs do not both have."""


def run_directory(path: str | Path) -> Path:
    """`path` if it is a run directory (manifest.json and metrics.jsonl inside), else BadInput."""
    directory = Path(path)
    missing = [name for name in ("manifest.json", "metrics.jsonl") if not (directory / name).is_file()]
    if not directory.is_dir() or missing:
        reason = "does not exist" if not directory.exists() else f"has no {' or '.join(missing) or 'files'}"
        raise BadInput(f"{path} is not a run directory (it {reason})")
    return directory


def read_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's records, wall-clock metrics left out (runs written before they moved to perf.jsonl)."""
    records = []
    for number, line in enumerate((run_dir / "metrics.jsonl").read_text().splitlines(), 1):
        try:
            record = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            message = f"{run_dir / 'metrics.jsonl'}: line {number} is not JSON (a run killed mid-write?)"
            raise BadInput(message) from None
        if record is not None:
            records.append({key: value for key, value in record.items() if not key.startswith(WALL_CLOCK_PREFIXES)})
    return records


def same_value(a: object, b: object) -> bool:
    """Equal as logged; NaN equals NaN (a run that logs NaN twice logged the same thing)."""
    both_nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return both_nan or (a == b and type(a) is type(b))


@dataclass
class MetricDifference:
    """The first record where two metrics.jsonl files differ: its position, its step in each run, the metric and the
    two values (None: absent on that side; metric None: one run has no record there at all)."""
    record: int
    step: int | None
    step_b: int | None
    metric: str | None
    value_a: object
    value_b: object
    differing_records: int
    records: int  # in the longer file

    def __str__(self) -> str:
        if self.metric is None:  # the shorter run's step is None
            longer, step = ("A", self.step) if self.step_b is None else ("B", self.step_b)
            return f"step {step}: only run {longer} has this record and after ({self.differing_records} records)"
        where = (f"step {self.step}" if same_value(self.step, self.step_b)
                 else f"record {self.record + 1} (step {self.step} in A, {self.step_b} in B)")
        values = f"A {self.value_a!r}, B {self.value_b!r}"
        if isinstance(self.value_a, (int, float)) and isinstance(self.value_b, (int, float)):
            values += f" (|A - B| = {abs(self.value_a - self.value_b):.3g})"
        return f"{where}, {self.metric}: {values}; {self.differing_records} of {self.records} records differ"


def first_metric_difference(records_a: list[dict], records_b: list[dict]) -> MetricDifference | None:
    """Record by record (DQN logs several records at one step), key by key in sorted order; None when equal."""
    def records_differ(a: dict, b: dict) -> bool:
        return a.keys() != b.keys() or not all(same_value(a[key], b[key]) for key in a)

    differing = sum(records_differ(a, b) for a, b in zip(records_a, records_b))
    differing += abs(len(records_a) - len(records_b))
    records = max(len(records_a), len(records_b))
    for index, (a, b) in enumerate(zip(records_a, records_b)):
        if not records_differ(a, b):
            continue
        for key in sorted((a.keys() | b.keys()) - {"step"}) + ["step"]:  # the step last: it says where, not what
            if key not in a or key not in b or not same_value(a[key], b[key]):
                return MetricDifference(index, a.get("step"), b.get("step"), key, a.get(key), b.get(key), differing,
                                        records)
    if len(records_a) == len(records_b):
        return None
    index = min(len(records_a), len(records_b))
    step_a = records_a[index].get("step") if len(records_a) > index else None
    step_b = records_b[index].get("step") if len(records_b) > index else None
    return MetricDifference(index, step_a, step_b, None, None, None, differing, records)


def final_differences(run_a: Path, run_b: Path) -> list[str]:
    """final.json's fingerprints (parameter_sha256, DQN's target_sha256), and how many of its other entries differ."""
    finals = []
    for run in (run_a, run_b):
        path = run / "final.json"
        finals.append(json.loads(path.read_text()) if path.is_file() else None)
    if finals[0] is None or finals[1] is None:
        return [] if finals[0] is finals[1] else [f"final.json only in run {'A' if finals[0] else 'B'} (unfinished?)"]
    keys = sorted(key for key in finals[0].keys() | finals[1].keys() if not key.startswith(WALL_CLOCK_PREFIXES))
    differing = [key for key in keys if not same_value(finals[0].get(key), finals[1].get(key))]
    lines = [f"{key}: {str(finals[0].get(key))[:16]}... vs {str(finals[1].get(key))[:16]}..."
             for key in differing if key.endswith("sha256")]
    others = [key for key in differing if not key.endswith("sha256")]  # the last step's metrics: shown above
    if others:
        lines.append(f"{len(others)} other entries differ ({', '.join(others[:3])}{' ...' if len(others) > 3 else ''})")
    return lines


def flatten(tree: object, prefix: str = "") -> dict[str, object]:
    """Nested dicts (and lists of dicts, such as the manifest's nodes) as dotted names; other lists stay whole."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list) and tree and all(isinstance(item, dict) for item in tree):
        items = ((str(index), item) for index, item in enumerate(tree))
    else:
        return {prefix[:-1]: tree}
    flat: dict[str, object] = {}
    for key, value in items:
        flat.update(flatten(value, f"{prefix}{key}."))
    return flat


def short(value: object, limit: int = 100) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def manifest_differences(run_a: Path, run_b: Path) -> list[str]:
    """Every argument, version, lock, device and determinism setting that differs; what differs between any two
    runs (BOOKKEEPING; the agents' command lines) is left out; so are resumes, which resume_note describes."""
    manifests = [json.loads((run / "manifest.json").read_text()) for run in (run_a, run_b)]
    flat = [{key: value for key, value in flatten(manifest).items()
             if not key.startswith(BOOKKEEPING) and not key.endswith("agent_command")} for manifest in manifests]
    lines = [f"{key}: {short(flat[0].get(key, '(absent)'))} vs {short(flat[1].get(key, '(absent)'))}"
             for key in sorted(flat[0].keys() | flat[1].keys())
             if key not in flat[0] or key not in flat[1] or not same_value(flat[0][key], flat[1][key])]
    return lines


def resume_note(run_a: Path, run_b: Path) -> str | None:
    """Which run was resumed, from which steps: not a difference (a resumed run is meant to equal the uninterrupted
    one), but what to know when reading the others."""
    resumed = [[entry.get("from_step") for entry in json.loads((run / "manifest.json").read_text()).get("resumed", [])]
               for run in (run_a, run_b)]
    return f"note: resumed from steps {resumed[0]} (A) and {resumed[1]} (B)" if resumed[0] != resumed[1] else None


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The complete checkpoints' steps (a finished save is renamed to step_N; .step_N.tmp is an unfinished one)."""
    return sorted(int(path.name[len("step_"):]) for path in (run_dir / "checkpoints").glob("step_*") if path.is_dir())


@contextlib.contextmanager
def checkpoint_tensors(directory: Path) -> Iterator[dict[str, Callable[[], torch.Tensor]]]:
    """Name -> a function that reads that one tensor: from the transformers export (model.safetensors, or the shards
    its index names, opened lazily, memory-mapped), or from DQN's trainer_state.pt (small: its networks and Adam)."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = {name: directory / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    elif (directory / "model.safetensors").is_file():
        files = None
    elif not (directory / "trainer_state.pt").is_file():
        yield {}
        return
    else:
        state = torch.load(directory / "trainer_state.pt", map_location="cpu", weights_only=True)
        tensors = {name: value for name, value in flatten({key: state[key] for key in
                                                           ("q_network", "target_network", "optimizer")
                                                           if key in state}).items()
                   if isinstance(value, torch.Tensor)}
        yield {name: (lambda tensor=tensor: tensor) for name, tensor in tensors.items()}
        return
    with contextlib.ExitStack() as stack:
        handles: dict[Path, object] = {}

        def handle(path: Path) -> object:
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
            return handles[path]

        if files is None:
            files = dict.fromkeys(handle(directory / "model.safetensors").keys(), directory / "model.safetensors")
        yield {name: (lambda name=name, path=path: handle(path).get_tensor(name)) for name, path in files.items()}


def bits_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width, flat: equal exactly when the bits are equal."""
    return tensor.reshape(-1).view(SAME_SIZE_INTEGER[tensor.element_size()])


def tensor_difference(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None when bit-identical (NaNs with equal bits are equal, -0.0 and 0.0 are not: what a hash sees); else how
    many elements differ and by how much at most, computed piece by piece."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype} {list(a.shape)} vs {b.dtype} {list(b.shape)}"
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    differing, largest = 0, 0.0
    for start in range(0, flat_a.numel(), CHUNK_ELEMENTS):
        piece_a, piece_b = flat_a[start:start + CHUNK_ELEMENTS], flat_b[start:start + CHUNK_ELEMENTS]
        changed = bits_of(piece_a) != bits_of(piece_b)
        count = int(changed.sum())
        if count:
            differing += count
            gap = float((piece_a[changed].double() - piece_b[changed].double()).abs().max())
            largest = gap if math.isnan(gap) or math.isnan(largest) else max(largest, gap)
    if not differing:
        return None
    return f"{differing:,} of {a.numel():,} elements differ, max |A - B| = {largest:.3g} ({a.dtype} {list(a.shape)})"


def checkpoint_differences(directory_a: Path, directory_b: Path) -> list[str]:
    """The first tensor (sorted names) that differs and by how much, then how many differ; tensors one at a time."""
    with checkpoint_tensors(directory_a) as tensors_a, checkpoint_tensors(directory_b) as tensors_b:
        only = {"A": tensors_a.keys() - tensors_b.keys(), "B": tensors_b.keys() - tensors_a.keys()}
        lines = [f"tensors only in run {side}: {', '.join(sorted(names)[:5])}{' ...' if len(names) > 5 else ''}"
                 for side, names in only.items() if names]
        common = sorted(tensors_a.keys() & tensors_b.keys())
        differing = []
        for name in common:
            tensor_a, tensor_b = tensors_a[name](), tensors_b[name]()
            if differing:  # the first one is described; the rest only counted
                if tensor_a.shape != tensor_b.shape or tensor_a.dtype != tensor_b.dtype or not torch.equal(
                        bits_of(tensor_a), bits_of(tensor_b)):
                    differing.append(name)
                continue
            described = tensor_difference(tensor_a, tensor_b)
            if described:
                differing.append(name)
                lines.append(f"first differing tensor {name}: {described}")
    if differing:
        lines.append(f"{len(differing)} of {len(common)} tensors differ")
    return lines


def diff_runs(run_a: Path, run_b: Path, step: int | None = None, checkpoints: bool = True
              ) -> list[tuple[str, list[str]]]:
    """(section, its differences) for metrics, final.json, manifest and one pair of checkpoints; empty lists mean
    equal. `step`: the checkpoints' step (default the last step both runs have a checkpoint of)."""
    metric = first_metric_difference(read_records(run_a), read_records(run_b))
    sections = [("metrics.jsonl", [str(metric)] if metric else []), ("final.json", final_differences(run_a, run_b)),
                ("manifest.json", manifest_differences(run_a, run_b))]
    if checkpoints:
        common = sorted(set(checkpoint_steps(run_a)) & set(checkpoint_steps(run_b)))
        if step is not None and step not in common:
            raise BadInput(f"no checkpoint of step {step} in both runs (both have: {common or 'none'})")
        if common:
            chosen = step if step is not None else common[-1]
            name = f"step_{chosen:08d}"
            sections.append((f"checkpoint {name}",
                             checkpoint_differences(run_a / "checkpoints" / name, run_b / "checkpoints" / name)))
    return sections


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a", help="a run directory (runs/NAME__SEED__TIME)")
    parser.add_argument("run_b", help="another run directory")
    parser.add_argument("--step", type=int, help="compare the checkpoints of this step (default: the last common one)")
    parser.add_argument("--no-checkpoints", action="store_true", help="skip the checkpoints' tensors")
    options = parser.parse_args(argv)
    try:
        run_a, run_b = run_directory(options.run_a), run_directory(options.run_b)
        sections = diff_runs(run_a, run_b, options.step, not options.no_checkpoints)
    except (BadInput, json.JSONDecodeError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"run A: {run_a}\nrun B: {run_b}")
    for section, lines in sections:
        print(f"{section}: {'differs' if lines else 'same'}")
        for line in lines:
            print(f"  {line}")
    trained_alike = not any(lines for section, lines in sections if section != "manifest.json")
    manifests_differ = bool(dict(sections)["manifest.json"])
    note = resume_note(run_a, run_b)
    if note:
        print(note)
    if not trained_alike and not manifests_differ:
        print("note: the manifests record no difference, so the cause is something they do not record: environment "
              "variables such as ATEN_CPU_CAPABILITY or OMP_NUM_THREADS, the CPU model, library builds")
    if not trained_alike:
        print("the runs differ")
    elif manifests_differ:
        print("training identical: the same metrics, final weights and checkpoints (wall-clock files and metrics "
              "ignored); only the manifests differ, as listed")
    else:
        print("identical (wall-clock files and metrics ignored)")
    return int(not trained_alike)


if __name__ == "__main__":
    sys.exit(main())
