"""Scores, one number per completion: the task's verifiable reward or a reward model's; and held-out evaluation."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from common.batching import _pack
from common.distributed import all_ranks_ok, fail, reduce_stats
from common.models import load_model
from common.rollout import sample_seed
from common.tasks import Example

if TYPE_CHECKING:
    from common.llm_run import LLMArgs, LLMRun


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


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k from n samples of which c are correct (Chen et al. 2021, arXiv:2107.03374, eq. 1):
    1 - C(n - c, k) / C(n, k), the chance that k of the n drawn without replacement hold a correct one."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(engine: object, run: LLMRun, num_eval_prompts: int, max_tokens: int) -> dict[str, float]:
    """Held-out evaluation, the test prompts split round-robin over ranks. Greedy: eval/accuracy (pass@1, the share
    the task counts correct) and the task's own metrics (eval/<name>, e.g. a lenient accuracy). With --eval-samples
    k, also k completions per prompt sampled at --eval-temperature (seeds from the prompt's and the sample's index
    alone, the same at every evaluation): eval/mean@k (the mean share correct, as papers report AIME's avg@32) and
    eval/pass@j for j = 2, 4, ... up to k and k itself (the unbiased estimator). A multi-turn task's episodes run
    whole (common/episodes.py), and what they count correct is what is averaged."""
    from common.episodes import is_multi_turn, run_episodes  # (it scores with this module's functions)

    task, test_ids, args = run.task, run.test_ids, run.args
    count = len(test_ids) if num_eval_prompts == 0 else min(num_eval_prompts, len(test_ids))
    indices = list(range(run.rank, count, run.world_size))
    examples = [run.test[i] for i in indices]

    multi_turn = is_multi_turn(task)  # decided alike on every rank, even one without prompts

    def correct_of(samples: list, examples: list[Example], texts: list[str]) -> list[bool]:
        if multi_turn:
            return [sample.episode.correct for sample in samples]
        return task_scores(task.correct, examples, texts)

    samples = run_episodes(engine, run, [test_ids[i] for i in indices], examples, [0] * len(indices), max_tokens, 0.0)
    texts = [decode_completion(run.tokenizer, s.completion_ids, run.eos_ids) for s in samples]
    sums = {"accuracy": float(sum(correct_of(samples, examples, texts)))}
    sums.update(task_metric_sums(task, run.test[0], examples, texts))
    if multi_turn:  # the same names on every rank
        sums["turns"] = float(sum(s.episode.turns for s in samples))
        if "tool_calls" in task.environment().event_names:
            sums["tool_call_rate"] = float(sum(s.episode.events["tool_calls"] > 0 for s in samples))
    k = args.eval_samples
    if k:
        prompts = [test_ids[i] for i in indices for _ in range(k)]
        seeds = [sample_seed(args.seed, -1, i, j) for i in indices for j in range(k)]  # step -1: evaluation
        repeated = [run.test[i] for i in indices for _ in range(k)]
        sampled = run_episodes(engine, run, prompts, repeated, seeds, max_tokens, args.eval_temperature)
        texts = [decode_completion(run.tokenizer, s.completion_ids, run.eos_ids) for s in sampled]
        right = correct_of(sampled, repeated, texts)
        correct = [int(sum(right[p * k:(p + 1) * k])) for p in range(len(indices))]
        sums[f"mean@{k}"] = sum(correct) / k
        powers = {2**e for e in range(1, k.bit_length()) if 2**e < k}  # 2, 4, ... below k
        for j in sorted(powers | ({k} if k > 1 else set())):
            sums[f"pass@{j}"] = sum(pass_at_k(k, c, j) for c in correct)
    return {f"eval/{name}": value / count for name, value in reduce_stats(sums).items()}


def task_metric_sums(task: object, first_test: Example, examples: list[Example], texts: list[str]
                     ) -> dict[str, float]:
    """The sums of the task's `eval_metrics` over this rank's completions. Every rank sends the same names to the
    reduction (those of the first test example, even a rank without prompts); a completion that gives other names,
    a reserved name or a raise stops every rank with a message."""
    names = set(task.eval_metrics("", first_test))
    sums, problem = dict.fromkeys(sorted(names), 0.0), None
    reserved = {name for name in names if name == "accuracy" or name.startswith(("mean@", "pass@"))}
    if reserved:
        problem = f"the task's eval_metrics uses the reserved name(s) {sorted(reserved)}: name them otherwise"
    for example, text, values in zip(examples, texts, task_scores(task.eval_metrics, examples, texts)):
        if problem is None and set(values) != names:
            problem = (f"the task's eval_metrics gave {sorted(values)} for prompt {example.prompt!r} with completion "
                       f"{text!r}, but {sorted(names)} for an empty completion: it must always give the same names")
        for name in names & set(values):
            sums[name] += float(values[name])
    if not all_ranks_ok(problem is None):
        fail(problem or "the task's eval_metrics failed on another rank")
    return sums


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
