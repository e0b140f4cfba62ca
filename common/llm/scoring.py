"""Scores, one number per completion: the task's verifiable reward (`task_scores`, on the decoded text; a multi-turn
task's episodes carry theirs: `sample_scores`, `sample_correct`) or a reward model's (`RewardModel`), the check of a
reward or value model's scalar head before it loads, and the check that a distillation teacher grades the student's
tokens (`check_teacher`)."""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from common.distributed import all_ranks_ok, fail
from common.llm.batching import _pack
from common.llm.models import load_model
from common.llm.run import LLMArgs, LLMRun, Sample
from tasks import Example


def decode_completion(tokenizer: object, ids: list[int], eos_ids: list[int]) -> str:
    """The completion's text for a reward: the final EOS (any of the model's) dropped, special tokens skipped."""
    return tokenizer.decode(ids[:-1] if ids and ids[-1] in eos_ids else ids, skip_special_tokens=True)


def task_scores(score: Callable[[str, Example], Any], examples: list[Example], texts: list[str]) -> list[Any]:
    """`score(text, example)` of every completion: the task's `score` (reward, correct), `correct` or `eval_metrics`.
    One that raises on any rank stops every rank with a message naming the prompt and completion, instead of leaving
    the others waiting in the next collective."""
    scores, error = [], None
    for example, text in zip(examples, texts):
        try:
            scores.append(score(text, example))
        except Exception as exception:
            error = (f"the task's {getattr(score, '__name__', 'reward')} function failed on prompt "
                     f"{example.prompt!r} with completion {text!r}: {exception!r}")
            break
    if not all_ranks_ok(error is None):
        fail(error or "a task's reward or correct function failed on another rank")
    return scores


def sample_scores(run: LLMRun, examples: list[Example], samples: list[Sample], texts: list[str]
                  ) -> list[tuple[float, bool]]:
    """(reward, correct) of every sample: the episode's, or the task's `score` of a single-turn completion (a
    collective)."""
    if run.multi_turn:
        return [(sample.episode.reward, sample.episode.correct) for sample in samples]
    return task_scores(run.task.score, examples, texts)


def sample_correct(run: LLMRun, examples: list[Example], samples: list[Sample], texts: list[str]) -> list[bool]:
    """Whether each sample is correct: its episode's verdict, or the task's `correct` of a single-turn completion (a
    collective)."""
    if run.multi_turn:
        return [sample.episode.correct for sample in samples]
    return task_scores(run.task.correct, examples, texts)


class RewardModel:
    """A one-label AutoModelForSequenceClassification scoring prompt + completion text with its own tokenizer (and its
    own chat template when it has one), sharded with FSDP2 like the policy. Calling it is a collective: every rank
    scores as many completions (the scripts give each rank the same number)."""

    def __init__(self, path: str, args: LLMArgs, device: torch.device) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = load_model(path, args, device, trainable=False, model_class=AutoModelForSequenceClassification)
        self.pad_id = next((i for i in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id) if i is not None), 0)
        # HF pools the last token that is not config.pad_token_id. Rows are left-padded, so the last column is always
        # the text's last token; -1 matches no token, so a text ending in the pad id (often EOS) is read there too.
        self.model.config.pad_token_id = -1
        self.device, self.micro_batch_size = device, args.micro_batch_size

    def texts(self, examples: list[Example], completions: list[str]) -> list[str]:
        if getattr(self.tokenizer, "chat_template", None):
            return [self.tokenizer.apply_chat_template([{"role": "user", "content": example.prompt},
                                                        {"role": "assistant", "content": completion}], tokenize=False)
                    for example, completion in zip(examples, completions)]
        return [example.prompt + completion for example, completion in zip(examples, completions)]

    @torch.no_grad()
    def __call__(self, examples: list[Example], completions: list[str]) -> torch.Tensor:
        chat = bool(getattr(self.tokenizer, "chat_template", None))
        ids = self.tokenizer(self.texts(examples, completions), add_special_tokens=not chat).input_ids
        scores = []
        for start in range(0, len(ids), self.micro_batch_size):
            rows = ids[start:start + self.micro_batch_size]
            width = max(map(len, rows))
            mask = _pack([[1] * len(row) for row in rows], width, 0, torch.long, left=True).to(self.device)
            logits = self.model(input_ids=_pack(rows, width, self.pad_id, torch.long, left=True).to(self.device),
                                attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                                use_cache=False).logits
            scores.append(logits[:, 0].float().cpu())
        return torch.cat(scores) if scores else torch.zeros(0)


def check_scalar_head(path: str, flag: str, must_be_classifier: bool) -> None:
    """A reward model (`must_be_classifier`) must be a one-label AutoModelForSequenceClassification; a value model
    may also be a plain causal LM (it gets a fresh head). A stored `score` head must be [1, hidden size]. Reads only
    the config and the head's stored shape, on every rank, before any model is loaded."""
    from safetensors import safe_open
    from transformers import AutoConfig
    from transformers.utils import cached_file

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as error:
        fail(f"cannot load {flag} {path!r}: {error}")
    architectures = config.architectures or []
    if must_be_classifier and not any(name.endswith("ForSequenceClassification") for name in architectures):
        fail(f"{flag} {path!r} is not a sequence classifier (architectures: {architectures}); a reward model must "
             "load with AutoModelForSequenceClassification and have one label")
    scalar_heads = ("ForSequenceClassification", "ForTokenClassification")
    if (must_be_classifier or any(name.endswith(scalar_heads) for name in architectures)) and config.num_labels != 1:
        fail(f"{flag} {path!r} has {config.num_labels} labels; it must have exactly one (a scalar score)")
    hidden_size = config.get_text_config().hidden_size
    index = cached_file(path, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False)
    weights_file = json.loads(Path(index).read_text())["weight_map"].get("score.weight") if index else \
        "model.safetensors"
    weights = cached_file(path, weights_file, _raise_exceptions_for_missing_entries=False) if weights_file else None
    if weights:
        with safe_open(weights, "pt") as stored:
            shape = stored.get_slice("score.weight").get_shape() if "score.weight" in stored.keys() else None
        if shape is not None and list(shape) != [1, hidden_size]:
            fail(f"{flag} {path!r}: its score head is {list(shape)}, but its hidden size is {hidden_size} "
                 f"(expected [1, {hidden_size}])")


def check_teacher(student: str, teacher: str) -> None:
    """A teacher grades the student's token ids, so it must be a causal LM with the student's tokenizer: the same
    vocabulary (every token string to the same id), the same special tokens, and an output layer with a row for
    every id the student can sample. A family's sizes often pad that layer differently with one tokenizer
    (Qwen2.5-7B has 152,064 rows, Qwen2.5-1.5B 151,936): a larger teacher layer is graded over the student's rows
    (distill_llm.py). Reads only configs and tokenizers, on every rank, before any model is loaded; a difference is
    named."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(teacher)
        teacher_tokenizer = AutoTokenizer.from_pretrained(teacher)
    except (OSError, ValueError) as error:
        fail(f"cannot load --teacher-model {teacher!r}: {error}")
    architectures = config.architectures or []
    if not any(name.endswith("ForCausalLM") for name in architectures):
        fail(f"--teacher-model {teacher!r} is not a causal LM (architectures: {architectures}); a teacher must load "
             "with AutoModelForCausalLM, to give each of the student's tokens a log-probability")
    student_config, student_tokenizer = AutoConfig.from_pretrained(student), AutoTokenizer.from_pretrained(student)
    student_vocabulary, teacher_vocabulary = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if student_vocabulary != teacher_vocabulary:
        differ = sorted(token for token in student_vocabulary.keys() | teacher_vocabulary.keys()
                        if student_vocabulary.get(token) != teacher_vocabulary.get(token))
        fail(f"--teacher-model {teacher!r} has another tokenizer than the student {student!r}: "
             f"{len(teacher_vocabulary)} against {len(student_vocabulary)} tokens, {len(differ)} with another id or "
             f"missing, e.g. {differ[:5]}; the teacher must grade the student's own token ids")
    specials = {name: (getattr(student_tokenizer, name), getattr(teacher_tokenizer, name))
                for name in ("bos_token", "eos_token", "pad_token")}
    if any(mine != theirs for mine, theirs in specials.values()):
        fail(f"--teacher-model {teacher!r} has other special tokens than the student {student!r}: "
             f"{ {name: pair for name, pair in specials.items() if pair[0] != pair[1]} } (student, teacher)")
    sizes = student_config.get_text_config().vocab_size, config.get_text_config().vocab_size
    if sizes[1] < sizes[0]:
        fail(f"--teacher-model {teacher!r} has an output layer over {sizes[1]} ids, the student {student!r} over "
             f"{sizes[0]}: the teacher must grade every id the student can sample (a teacher with more rows is "
             "graded over the student's)")
