"""distill_llm.py: the loss against hand-computed values (padding and an environment's tokens masked), the teacher as
the student itself (and as the student with its output layer padded) giving zero reward and zero gradient, bad
teachers refused before any engine, and 2-rank runs that give the same bits twice and after a resume, colocated and
split one step off."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ROOT, check, only_run_dir, read_metrics, run_script

from distill_llm import distillation_loss, distillation_rewards, task_advantages

TEACHER = ROOT / "assets" / "tiny-adder-teacher"
SHORT = ["--task", "tests/small_addition_task.py:SmallAdditionTask", "--prompts-per-step", "16", "--num-generations",
         "4", "--micro-batch-size", "16", "--num-eval-prompts", "32", "--eval-every", "2", "--total-steps", "4",
         "--save-every", "2", "--keep-last", "0", "--seed", "1"]


def final_hash(run_dir: Path) -> str:
    return json.loads((run_dir / "final.json").read_text())["parameter_sha256"]


def padded_copy(source: Path, directory: Path, rows: int) -> Path:
    """`source` with its (tied) embedding and output layer padded to `rows` rows, the tokenizer unchanged: as a larger
    model of a family pads its layer (Qwen2.5-7B: 152,064 rows, Qwen2.5-1.5B: 151,936, one tokenizer). The new rows
    are drawn from the old ones' mean and covariance (transformers' resize), seeded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source)
    torch.manual_seed(0)
    model.resize_token_embeddings(rows)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(source).save_pretrained(directory)
    shutil.copy(source / "generation_config.json", directory)
    return directory


def test_the_loss_on_two_completions_by_hand():
    """Row 0: three model tokens; row 1: a model token, an environment's token (mask 0) and a model token, then
    padding. r_t = -(s_t - t_t); loss = -sum w r s / N over the 5 model tokens (N = 5 here, a whole batch)."""
    student = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.25, 0.0, -3.0, 0.0]], requires_grad=True)
    teacher = torch.tensor([[-0.5, -2.5, -0.5, 0.0], [-1.25, 0.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
    weight = torch.tensor([[1.0, 2.0, 1.0, 1.0], [0.5, 1.0, 1.0, 1.0]])
    rewards = distillation_rewards(student, teacher, mask)
    assert rewards.tolist() == [[0.5, -0.5, 0.0, 0.0], [-1.0, 0.0, 2.0, 0.0]]
    loss = distillation_loss(student, rewards, weight, mask, num_tokens=5)
    by_hand = -(1.0 * 0.5 * -1.0 + 2.0 * -0.5 * -2.0 + 0.5 * -1.0 * -0.25 + 1.0 * 2.0 * -3.0) / 5
    assert loss.item() == pytest.approx(by_hand, abs=1e-7)
    loss.backward()
    assert student.grad.flatten().tolist() == pytest.approx([-0.1, 0.2, 0.0, 0.0, 0.1, 0.0, -0.4, 0.0], abs=1e-7)
    assert task_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]])).tolist() == [[0.5, -0.5, -0.5, 0.5]]


def test_the_teacher_as_the_student_gives_zero_reward_and_zero_gradient(tmp_path: Path):
    """The negative control: the student's own weights as the teacher. Both log-probabilities come from the same
    computation on the same weights, so the reward is exactly 0 on every token (not only up to rounding on this
    CPU), and so are the loss and the gradient."""
    check(run_script("distill_llm.py", ["--teacher-model", "assets/tiny-adder", "--total-steps", "2",
                                        "--num-eval-prompts", "8", "--run-root", str(tmp_path)]))
    for metrics in read_metrics(only_run_dir(tmp_path))[1:]:
        assert metrics["train/reverse_kl"] == 0.0 and metrics["train/loss"] == 0.0
        assert metrics["train/grad_norm"] == 0.0


def test_a_teacher_padded_beyond_the_students_ids_grades_over_the_students_rows(tmp_path: Path):
    """The student's weights with its output layer padded from 15 to 24 rows: accepted as a teacher, and graded over
    the student's 15 rows its log-probabilities are the student's bit for bit; over all 24 they are not (the padded
    rows take probability). A student with more rows than its teacher is refused: some of its ids would go ungraded."""
    from transformers import AutoModelForCausalLM

    from common.llm.batching import make_batch, token_logprobs
    from common.llm.scoring import check_teacher

    student_path = ROOT / "assets" / "tiny-adder"
    padded = padded_copy(student_path, tmp_path / "padded", 24)
    check_teacher(str(student_path), str(padded))
    student = AutoModelForCausalLM.from_pretrained(student_path).eval()
    teacher = AutoModelForCausalLM.from_pretrained(padded).eval()
    assert teacher.get_output_embeddings().weight.shape[0] == 24
    batch = make_batch([[4, 5, 13, 6, 7, 14], [8, 9, 13]], [[5, 6, 1], [9, 1]], 0, torch.device("cpu"))
    with torch.no_grad():
        mine = token_logprobs(student, batch, 0.7)
        graded = token_logprobs(teacher, batch, 0.7, vocabulary=15)
        over_all_rows = token_logprobs(teacher, batch, 0.7)
    assert torch.equal(graded, mine) and (mine != 0).sum() == 5
    assert ((over_all_rows - mine).abs() * batch.mask).max() > 1e-3
    with pytest.raises(SystemExit) as exit_info:
        check_teacher(str(padded), str(student_path))
    assert exit_info.value.code == 2


def test_the_teacher_as_the_student_padded_gives_zero_reward(tmp_path: Path):
    """The negative control of a padded teacher, end to end: the student's weights with 9 more output rows give
    exactly 0 reward and gradient, as the unpadded copy does."""
    padded = padded_copy(ROOT / "assets" / "tiny-adder", tmp_path / "padded", 24)
    check(run_script("distill_llm.py", ["--teacher-model", str(padded), "--total-steps", "2", "--num-eval-prompts",
                                        "8", "--run-root", str(tmp_path / "runs")]))
    steps = read_metrics(only_run_dir(tmp_path / "runs"))[1:]
    assert len(steps) == 2
    for metrics in steps:
        assert metrics["train/reverse_kl"] == 0.0 and metrics["train/loss"] == 0.0
        assert metrics["train/grad_norm"] == 0.0


@pytest.mark.parametrize("teacher, message", [
    ("assets/no-such-teacher", "cannot load --teacher-model 'assets/no-such-teacher'"),
    ("assets/tiny-calculator", "has another tokenizer than the student"),
    ("classifier", "is not a causal LM"),
])
def test_a_bad_teacher_is_refused(teacher: str, message: str, tmp_path: Path, capsys):
    import distill_llm

    if teacher == "classifier":  # the student's files, declared a sequence classifier
        teacher = str(tmp_path / "classifier")
        shutil.copytree(ROOT / "assets" / "tiny-adder", teacher)
        config = json.loads(Path(teacher, "config.json").read_text())
        config["architectures"] = ["LlamaForSequenceClassification"]
        Path(teacher, "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as exit_info:
        distill_llm.check_args(distill_llm.Args(teacher_model=teacher), 1)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_bad_teacher_stops_every_rank_before_any_engine(tmp_path: Path):
    result = run_script("distill_llm.py", ["--teacher-model", "assets/tiny-countdown", "--run-root",
                                           str(tmp_path / "runs")], nproc=2, timeout=120)
    assert result.returncode != 0 and "has another tokenizer than the student" in result.stderr, result.stderr[-2000:]
    assert "Initializing" not in result.stdout + result.stderr and not (tmp_path / "runs").exists()


def test_distillation_resumes_to_the_same_bits(tmp_path: Path):
    """Colocated on 2 ranks, resumed from step 2: steps 3 and 4 computed again in fresh processes (student and teacher
    loaded anew) give the same bytes and final weights; the teacher is better than the student, so the reward is not
    zero and the weights move. (Two fresh runs to the same bytes: GRPO's test_reproducibility, with the same head.)"""
    check(run_script("distill_llm.py", [*SHORT, "--run-root", str(tmp_path / "first")], nproc=2))
    first = only_run_dir(tmp_path / "first")
    steps = [m for m in read_metrics(first) if m["step"]]
    assert all(m["train/reverse_kl"] != 0 and m["train/grad_norm"] > 0 for m in steps)
    reference, reference_hash = (first / "metrics.jsonl").read_bytes(), final_hash(first)
    check(run_script("distill_llm.py", [*SHORT, "--resume", str(first / "checkpoints" / "step_00000002")], nproc=2))
    assert (first / "metrics.jsonl").read_bytes() == reference and final_hash(first) == reference_hash


def test_distillation_split_one_step_off_resumes_exactly(tmp_path: Path):
    split = [*SHORT, "--rollout-ranks", "1", "--max-staleness", "1"]
    check(run_script("distill_llm.py", [*split, "--run-root", str(tmp_path / "split")], nproc=2))
    run_dir = only_run_dir(tmp_path / "split")
    reference, reference_hash = (run_dir / "metrics.jsonl").read_bytes(), final_hash(run_dir)
    assert any(m.get("mismatch/tis_weight_mean", 1.0) != 1.0 for m in read_metrics(run_dir))  # one step off
    check(run_script("distill_llm.py", [*split, "--resume", str(run_dir / "checkpoints" / "step_00000002")], nproc=2))
    assert (run_dir / "metrics.jsonl").read_bytes() == reference and final_hash(run_dir) == reference_hash
