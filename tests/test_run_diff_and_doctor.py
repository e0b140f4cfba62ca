"""tools/run_diff.py and tools/doctor.py. run_diff's reading and reporting on run directories written by hand; both
tools on real runs made to differ on purpose (another seed; the same arguments with another set of CPU kernels);
doctor's verdicts when every promise holds and when one breaks."""

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, SMALL_GRPO, check, only_run_dir, read_metrics, run_script, script_env
from safetensors.torch import save_file

from tools import doctor, run_diff

MANIFEST = {"exp_name": "grpo_llm", "args": {"seed": 1, "learning_rate": 3e-4, "run_root": "runs/a"},
            "command": "torchrun grpo_llm.py --run-root runs/a", "started": "2026-12-01T10:00:00+0000",
            "launch": {"run_id": "one", "master": "localhost:1"}, "world_size": 2,
            "nodes": [{"hostname": "vm", "agent_command": "torchrun ... runs/a", "ranks": [0, 1]}],
            "versions": {"torch": "2.13.0+cpu", "vllm": "0.32.0"},
            "lock": {"file": "requirements-cpu.lock.txt", "differs": []},
            "determinism": {"deterministic": True, "NCCL_ALGO": "Ring", "kernel_overrides": []}}
RECORDS = [{"step": 0, "eval/accuracy": 0.5},
           {"step": 1, "train/loss": 0.25, "train/score": 0.5, "mismatch/kl": float("nan")},
           {"step": 2, "train/loss": 0.125, "train/score": 0.75, "eval/accuracy": 0.625}]


def write_run(directory: Path, records: list[dict] = RECORDS, manifest: dict = MANIFEST,
              checkpoints: dict[int, dict[str, torch.Tensor]] | None = None, sha: str = "ab" * 32,
              shards: int = 1) -> Path:
    """A run directory as RunTracker and the checkpoint code lay it out (metrics, manifest, final.json, exports)."""
    directory.mkdir(parents=True)
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2))
    (directory / "final.json").write_text(json.dumps({"step": 2, "parameter_sha256": sha, "perf/step_s": 0.5}))
    for step, tensors in (checkpoints or {}).items():
        export = directory / "checkpoints" / f"step_{step:08d}"
        export.mkdir(parents=True)
        if shards == 1:
            save_file(tensors, str(export / "model.safetensors"))
            continue
        names, weight_map = sorted(tensors), {}
        for index in range(shards):  # save_pretrained's sharded layout: files named by an index
            file = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
            part = names[index::shards]
            save_file({name: tensors[name] for name in part}, str(export / file))
            weight_map.update(dict.fromkeys(part, file))
        (export / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


def weights(**changes: torch.Tensor) -> dict[str, torch.Tensor]:
    base = {"model.embed.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
            "model.head.weight": torch.ones(2, 4, dtype=torch.bfloat16), "model.norm.weight": torch.zeros(4)}
    return {**base, **changes}


def diff(run_a: Path, run_b: Path, *flags: str, capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    status = run_diff.main([str(run_a), str(run_b), *flags])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


# ---------------------------------------------------------------------------------------------------------------------
# run_diff on run directories written by hand
# ---------------------------------------------------------------------------------------------------------------------
def test_runs_that_differ_only_in_bookkeeping_and_wall_clock_are_identical(tmp_path: Path, capsys):
    """NaN equals NaN; the start time, run root, rendezvous and wall-clock metrics differ between any two runs."""
    other = {**MANIFEST, "started": "2026-12-02T11:00:00+0000", "args": {**MANIFEST["args"], "run_root": "runs/b"},
             "command": "torchrun grpo_llm.py --run-root runs/b", "launch": {"run_id": "two", "master": "host:2"},
             "nodes": [{**MANIFEST["nodes"][0], "agent_command": "torchrun ... runs/b"}]}
    timed = [{**record, "perf/step_s": 0.1 * index} for index, record in enumerate(RECORDS)]
    run_a = write_run(tmp_path / "a", checkpoints={2: weights()})
    run_b = write_run(tmp_path / "b", timed, other, checkpoints={2: weights()}, shards=2)
    status, out, _ = diff(run_a, run_b, capsys=capsys)
    assert status == 0, out
    assert "checkpoint step_00000002: same" in out and out.rstrip().endswith("identical (wall-clock files and "
                                                                              "metrics ignored)")


def test_the_first_differing_record_and_metric_are_named(tmp_path: Path):
    changed = [RECORDS[0], {**RECORDS[1], "train/score": 0.4375, "train/loss": 0.3}, {**RECORDS[2], "train/loss": 1.0}]
    difference = run_diff.first_metric_difference(RECORDS, changed)
    assert (difference.step, difference.metric, difference.value_a, difference.value_b) == (1, "train/loss", 0.25, 0.3)
    assert difference.differing_records == 2
    assert str(difference) == "step 1, train/loss: A 0.25, B 0.3 (|A - B| = 0.05); 2 of 3 records differ"
    missing_key = [RECORDS[0], {k: v for k, v in RECORDS[1].items() if k != "mismatch/kl"}, RECORDS[2]]
    assert run_diff.first_metric_difference(RECORDS, missing_key).metric == "mismatch/kl"
    shorter = run_diff.first_metric_difference(RECORDS, RECORDS[:2])  # one run stopped early
    assert (shorter.step, shorter.metric, shorter.differing_records) == (2, None, 1)
    assert str(shorter) == "step 2: only run A has this record and after (1 records)"
    shifted = [RECORDS[0], {**RECORDS[1], "step": 3}, RECORDS[2]]  # DQN: a game ended at another step
    assert str(run_diff.first_metric_difference(RECORDS, shifted)) == \
        "record 2 (step 1 in A, 3 in B), step: A 1, B 3 (|A - B| = 2); 1 of 3 records differ"
    assert run_diff.first_metric_difference(RECORDS, json.loads(json.dumps(RECORDS))) is None  # NaN read back


def test_manifest_and_final_differences(tmp_path: Path, capsys):
    other = {**MANIFEST, "args": {**MANIFEST["args"], "seed": 2}, "versions": {"torch": "2.11.0", "vllm": "0.32.0"},
             "lock": {"file": "requirements-cpu.lock.txt", "differs": ["torch==2.13.0+cpu (installed: 2.11.0)"]},
             "determinism": {"deterministic": True, "kernel_overrides": ["aten::mm"]},
             "resumed": [{"from_step": 2, "started": "later"}]}
    run_a = write_run(tmp_path / "a")
    run_b = write_run(tmp_path / "b", manifest=other, sha="cd" * 32)
    status, out, _ = diff(run_a, run_b, capsys=capsys)
    assert status == 1
    assert "metrics.jsonl: same" in out
    assert "parameter_sha256: abababababababab... vs cdcdcdcdcdcdcdcd..." in out
    for line in ("args.seed: 1 vs 2", 'versions.torch: "2.13.0+cpu" vs "2.11.0"',
                 'lock.differs: [] vs ["torch==2.13.0+cpu (installed: 2.11.0)"]',
                 'determinism.NCCL_ALGO: "Ring" vs "(absent)"', 'determinism.kernel_overrides: [] vs ["aten::mm"]'):
        assert f"  {line}\n" in out, line
    assert "note: resumed from steps [] (A) and [2] (B)\n" in out
    assert "started" not in out and "run_root" not in out  # bookkeeping


def test_runs_that_differ_only_in_their_manifests_trained_identically(tmp_path: Path, capsys):
    """Another torch version and launch, the same metrics, final weights and checkpoint: the training is identical
    (exit 0), and the manifest lines say what else differs."""
    other = {**MANIFEST, "versions": {"torch": "2.11.0", "vllm": "0.32.0"}, "world_size": 2}
    run_a = write_run(tmp_path / "a", checkpoints={2: weights()})
    run_b = write_run(tmp_path / "b", manifest=other, checkpoints={2: weights()})
    status, out, _ = diff(run_a, run_b, capsys=capsys)
    assert status == 0, out
    assert "metrics.jsonl: same\nfinal.json: same\nmanifest.json: differs\n" in out
    assert '  versions.torch: "2.13.0+cpu" vs "2.11.0"\n' in out and "checkpoint step_00000002: same" in out
    assert out.rstrip().endswith("only the manifests differ, as listed") and "the runs differ" not in out


def test_the_first_differing_tensor_its_largest_difference_and_count(tmp_path: Path, capsys):
    """Sorted names: model.embed differs in 3 elements (the largest by 0.5; -0.0 against 0.0 is a difference of bits
    and counts, as in a parameter hash), model.head (bfloat16) too; model.norm is equal."""
    embed = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    embed[0, 0], embed[1, 2], embed[2, 3] = -0.0, 6.5, 11.25
    run_a = write_run(tmp_path / "a", checkpoints={2: weights(), 4: weights()})
    run_b = write_run(tmp_path / "b", checkpoints={
        2: weights(), 4: weights(**{"model.embed.weight": embed, "model.head.weight": torch.zeros(2, 4,
                                                                                                  dtype=torch.bfloat16)}),
        6: weights()}, shards=2)
    status, out, _ = diff(run_a, run_b, capsys=capsys)
    assert status == 1
    assert ("checkpoint step_00000004: differs\n  first differing tensor model.embed.weight: 3 of 12 elements differ, "
            "max |A - B| = 0.5 (torch.float32 [3, 4])\n  2 of 3 tensors differ\n") in out
    status, out, _ = diff(run_a, run_b, "--step", "2", capsys=capsys)
    assert status == 0 and "checkpoint step_00000002: same" in out
    head_only = run_diff.tensor_difference(torch.ones(2, 4, dtype=torch.bfloat16), torch.zeros(2, 4,
                                                                                               dtype=torch.bfloat16))
    assert head_only == "8 of 8 elements differ, max |A - B| = 1 (torch.bfloat16 [2, 4])"
    assert run_diff.tensor_difference(torch.zeros(3), torch.zeros(2)).startswith("torch.float32 [3] vs")


def test_bad_input_is_one_clear_line_and_exit_2(tmp_path: Path, capsys):
    run_a = write_run(tmp_path / "a", checkpoints={2: weights()})
    (tmp_path / "empty").mkdir()
    for other, message in ((tmp_path / "missing", "does not exist"),
                           (tmp_path / "empty", "has no manifest.json or metrics.jsonl")):
        status, out, err = diff(run_a, other, capsys=capsys)
        assert status == 2 and out == ""
        assert err == f"error: {other} is not a run directory (it {message})\n"
    status, _, err = diff(run_a, run_a, "--step", "3", capsys=capsys)
    assert status == 2 and err == "error: no checkpoint of step 3 in both runs (both have: [2])\n"


# ---------------------------------------------------------------------------------------------------------------------
# doctor's parts that need no run
# ---------------------------------------------------------------------------------------------------------------------
def test_batch_invariant_overrides_by_compute_capability():
    ampere, ampere_env = doctor.batch_invariant_overrides((8, 0))
    assert {"aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "aten::mean.dim", "aten::softmax"} <= set(ampere)
    assert doctor.batch_invariant_overrides((8, 6))[0] == ampere  # the whole 8.x family (A10, L4, RTX 30/40)
    for hopper_or_blackwell in ((9, 0), (10, 0)):
        kernels, env = doctor.batch_invariant_overrides(hopper_or_blackwell)
        assert "aten::mm" not in kernels and "aten::linear" not in kernels
        assert {"aten::mean.dim", "aten::_log_softmax", "aten::softmax", "aten::_softmax", "aten::bmm"} <= set(kernels)
        assert env == {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}
    assert ampere_env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert doctor.batch_invariant_overrides(None) == ([], {})


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_the_override_lists_match_the_installed_vllm():
    """doctor's lists are what vLLM's enable_batch_invariant_mode registers: a vLLM that overrides more shows here."""
    source = Path(importlib.util.find_spec("vllm").submodule_search_locations[0], "model_executor", "determinism",
                  "batch_invariant.py").read_text()
    body = source[source.index("def enable_batch_invariant_mode"):source.index("def override_envs_for_invariance")]
    registered = set(re.findall(r'\.impl\(\s*"(aten::[\w.]+)"', body))
    assert registered == {*doctor.AMPERE_OVERRIDES, *doctor.EVERY_GPU_OVERRIDES}


def test_memory_verdict_and_bad_arguments(tmp_path: Path, capsys):
    assert doctor.memory_verdict([("a", 110.0, 100.0), ("b", 95.0, 100.0)]) == (True, "a +10.0%; b -5.0%")
    assert doctor.memory_verdict([("a", 110.0, 100.0), ("b", 80.0, 100.0)])[0] is False
    assert doctor.main(["--scripts", "grpo,sac"]) == 2
    assert "--scripts takes a comma-separated list of grpo, dpo, ppo, dqn" in capsys.readouterr().err
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "file").write_text("")
    assert doctor.main(["--scripts", "dqn", "--out", str(tmp_path / "used")]) == 2
    assert "is not an empty directory" in capsys.readouterr().err


def test_the_gpu_memory_probe_runs_its_step_here(tmp_path: Path):
    """The GPU check's code without a GPU: memory_estimate's functions as doctor calls them (another engineer may
    change them), its model built on this device and its step run; only the allocator counter needs CUDA."""
    probe = tmp_path / "probe.json"
    check(subprocess.run([sys.executable, "tools/doctor.py", "--memory-probe", str(probe)], cwd=ROOT,
                         env=script_env(), capture_output=True, text=True, timeout=600))
    result = json.loads(probe.read_text())
    assert result["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert (result["measured"] is None) == (not torch.cuda.is_available())
    config = json.loads((ROOT / "assets" / "tiny-adder" / "config.json").read_text())
    blocks = config["num_hidden_layers"] * (4 * config["hidden_size"] ** 2 + 3 * config["hidden_size"]
                                            * config["intermediate_size"])
    assert result["estimate"] > 16 * blocks  # at least weights, gradients and Adam's two moments, in float32


# ---------------------------------------------------------------------------------------------------------------------
# Real runs: doctor on DQN, another seed, another set of CPU kernels
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def doctor_dqn(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    """`doctor --scripts dqn` in one process per run (the cheapest real configuration); its memory check is
    tests/test_gpu_mechanisms.py's (doctor.memory_check there: the same command and verdict)."""
    out = tmp_path_factory.mktemp("doctor") / "runs"
    result = subprocess.run([sys.executable, "tools/doctor.py", "--scripts", "dqn", "--nproc", "1", "--no-memory",
                             "--out", str(out)], cwd=ROOT, env=script_env(), capture_output=True, text=True,
                            timeout=600)
    return result, out


def test_doctor_passes_on_dqn(doctor_dqn: tuple[subprocess.CompletedProcess, Path]):
    result, out = doctor_dqn
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    verdicts = result.stdout[result.stdout.index("== verdicts\n"):].splitlines()
    assert verdicts[1:3] == ["same bits twice: yes (dqn)", "resume exact: yes (dqn)"]
    assert verdicts[3] == "estimate within 15%: not measured (skipped: --no-memory)"
    for section in ("== software", "lock: requirements-", "== device", "cpu: ", "NCCL: ", "cuBLAS: ", "TF32: ",
                    "Triton: ", "dqn: same bits twice yes, resume exact yes"):
        assert section in result.stdout, section
    first, resumed = only_run_dir(out / "dqn" / "first"), only_run_dir(out / "dqn" / "resumed")
    assert json.loads((resumed / "manifest.json").read_text())["resumed"][0]["from_step"] == 400
    assert (first / "metrics.jsonl").read_bytes() == (resumed / "metrics.jsonl").read_bytes()


def test_another_seed_fails_doctors_promise_and_run_diff_names_where(doctor_dqn, tmp_path: Path, capsys):
    """Seed 2 against doctor's seed-1 run: the failing verdict names the first differing step and metric, and
    run_diff also finds the seed in the manifests and the first differing tensor of the last checkpoint."""
    _, out = doctor_dqn
    first = only_run_dir(out / "dqn" / "first")
    check(run_script("dqn_atari.py", [*doctor.SCRIPTS["dqn"].args, "--seed", "2", "--run-root", str(tmp_path)],
                     launcher="warm"))
    other = only_run_dir(tmp_path)
    why = doctor.compare_runs(first, other)
    lines, failed = doctor.verdicts({"dqn": (why, None)}, (True, "CPU step +1.0%"))
    assert failed and lines[:2] == ["same bits twice: NO (dqn)", f"  dqn: {why}"]
    records_a, records_b = read_metrics(first), read_metrics(other)
    difference = run_diff.first_metric_difference(records_a, records_b)
    assert why == str(difference) and why.startswith(("step ", "record ")) and f", {difference.metric}: A " in why
    index = difference.record
    assert records_a[:index] == records_b[:index] and records_a[index] != records_b[index]  # all agree before it
    assert (difference.step, difference.step_b) == (records_a[index]["step"], records_b[index]["step"])
    assert records_a[index].get(difference.metric) != records_b[index].get(difference.metric)
    assert all(records_a[index].get(key) == records_b[index].get(key)  # the first of the differing names
               for key in sorted(records_a[index].keys() | records_b[index].keys()) if key < difference.metric)
    status, report, _ = diff(first, other, capsys=capsys)
    assert status == 1
    assert f"  {why}\n" in report and "  args.seed: 1 vs 2\n" in report
    assert re.search(r"checkpoint step_00000800: differs\n  first differing tensor \S+: [\d,]+ of [\d,]+ elements "
                     r"differ, max \|A - B\| = \S+ \(torch.float32 \[", report)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT", reason="no vectorised CPU kernels here")
def test_run_diff_on_the_same_arguments_with_other_cpu_kernels(grpo_reference_run: Path, tmp_path: Path, capsys):
    """ATEN_CPU_CAPABILITY=default (torch's scalar kernels instead of AVX2/AVX-512) changes the bits of the same GRPO
    run; the manifests record the kernels each node's CPU ran (nodes[].cpu), and run_diff names the difference."""
    env = {**script_env(), "ATEN_CPU_CAPABILITY": "default"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run([*launcher, "grpo_llm.py", *SMALL_GRPO, "--seed", "1", "--run-root", str(tmp_path)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    check(result)
    other = only_run_dir(tmp_path)
    status, report, _ = diff(grpo_reference_run, other, capsys=capsys)
    assert status == 1
    difference = run_diff.first_metric_difference(read_metrics(grpo_reference_run), read_metrics(other))
    assert difference is not None and difference.metric is not None
    assert f"metrics.jsonl: differs\n  {difference}\n" in report
    assert "manifest.json: differs" in report and "note: the manifests record no difference" not in report
    assert re.search(r'nodes\.0\.cpu\.kernel_capability: "AVX\w*" vs "DEFAULT"', report), report
    assert re.search(r"checkpoint step_00000004: differs\n  first differing tensor model\.\S+: ", report)
    copy = tmp_path / "copy"
    shutil.copytree(grpo_reference_run, copy)
    assert run_diff.main([str(grpo_reference_run), str(copy)]) == 0  # itself, elsewhere: identical
    assert "identical" in capsys.readouterr().out



def test_the_doctor_names_a_driver_too_old_for_the_cuda_build():
    from tools.doctor import driver_problem

    problem = driver_problem("570.133.20", "13.0")
    assert "older than R580" in problem and "update the driver" in problem
    assert driver_problem("580.65.06", "13.0") is None and driver_problem("590.48", "13.0") is None
    assert driver_problem("570.133.20", "12.8") is None  # CUDA 12 runs on R525 and newer
    assert driver_problem(None, "13.0") is None and driver_problem("470.1", None) is None  # no driver, CPU torch
