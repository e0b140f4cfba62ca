"""HSDP (--fsdp-shard-size) and the bucketed weight sync, on 4 gloo ranks: tests/workers/sharding_worker.py loads the
embedded model flat (shard size 4) and as HSDP (2 x 2), and these tests read its summary."""

import json

import pytest
from conftest import check, run_script


@pytest.fixture(scope="module")
def summary(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """One worker run under torchrun with 4 ranks: every rank's findings."""
    directory = tmp_path_factory.mktemp("sharding")
    result = run_script("tests/workers/sharding_worker.py", [str(directory / "summary.json"), str(directory)], nproc=4,
                        timeout=300)
    check(result)
    return json.loads((directory / "summary.json").read_text())


def test_hsdp_gives_the_flat_loss_and_gradient(summary):
    for rank in summary:
        assert rank["flat"]["mesh_shape"] == [4] and rank["hsdp"]["mesh_shape"] == [2, 2]
        # the same gathered weights and batch: measured bitwise equal; the gradients' reduction order differs
        assert abs(rank["flat"]["loss"] - rank["hsdp"]["loss"]) <= 1e-6
        assert rank["flat"]["grad_norm"] == pytest.approx(rank["hsdp"]["grad_norm"], rel=1e-5)  # measured 1e-7
        assert rank["gradient_max_abs_diff"] <= 1e-5 * rank["gradient_max_abs"]  # measured 8e-8
    assert len({rank["flat"]["loss"] for rank in summary}) == 4  # each rank had its own batch


def test_hsdp_is_reproducible(summary):
    assert all(rank["hsdp_repeat_bitwise"] for rank in summary)


def test_hsdp_shards_over_half_the_ranks(summary):
    total = summary[0]["hsdp"]["total_numel"]
    flat = [rank["flat"]["local_numel"] for rank in summary]
    hsdp = [rank["hsdp"]["local_numel"] for rank in summary]
    assert sum(flat) == total
    assert hsdp[0] + hsdp[1] == total and hsdp[2:] == hsdp[:2]  # ranks 0, 1 shard; ranks 2, 3 replicate them
    assert all(abs(numel - total / 2) < 0.01 * total for numel in hsdp)  # dim 0 splits unevenly: 15 rows into 8 + 7


def test_default_shard_size_is_the_node_and_meshes_are_reused(summary):
    assert all(rank["default_is_flat"] and rank["hsdp_mesh_reused"] for rank in summary)


def test_stream_weights_equal_full_tensors(summary):
    for rank in summary:
        assert rank["uneven_shards_equal"]  # shards of 2, 2, 1 and 0 rows
        for layout in ("flat", "hsdp"):
            for case in rank[layout]["stream"].values():
                assert case["bitwise_equal"] and case["names_as_state"] and case["order_as_parameters"], case
    assert summary[0]["export_equal"] is True


def test_stream_weights_costs_one_all_gather_per_bucket(summary):
    for rank in summary:
        for layout in ("flat", "hsdp"):
            for case in rank[layout]["stream"].values():
                assert case["collectives"] == case["buckets"], case
                # every bucket but the last holds at least bucket_bytes: the count follows bytes, not tensors
                assert case["buckets"] <= case["total_bytes"] // case["bucket_bytes"] + 1, case
            cases = rank[layout]["stream"]
            assert cases["float32/262144"]["collectives"] >= 10 and cases["bfloat16/262144"]["collectives"] >= 5
            assert cases["float32/1099511627776"]["collectives"] == 1  # 50 tensors, one all-gather


def test_check_llm_args_wants_a_shard_size_that_divides_the_world(capsys, monkeypatch):
    import common.distributed
    from common.llm.checks import check_llm_args
    from common.llm.models import fsdp_shard_size
    from common.llm.run import LLMArgs

    monkeypatch.setattr(common.distributed, "LOCAL_WORLD_SIZE_AT_LAUNCH", 2)  # two nodes of two ranks: HSDP
    assert fsdp_shard_size(0, 4) == 2 and fsdp_shard_size(4, 4) == 4
    monkeypatch.setattr(common.distributed, "LOCAL_WORLD_SIZE_AT_LAUNCH", 1)  # one rank a node: all ranks shard
    assert fsdp_shard_size(0, 4) == 4 and fsdp_shard_size(2, 4) == 2
    check_llm_args(LLMArgs(fsdp_shard_size=2), world_size=4)
    for size in (3, 8, -1):
        with pytest.raises(SystemExit) as stopped:
            check_llm_args(LLMArgs(fsdp_shard_size=size), world_size=4)
        assert stopped.value.code == 2 and f"--fsdp-shard-size {size}" in capsys.readouterr().err
