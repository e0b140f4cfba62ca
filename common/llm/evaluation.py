"""Held-out evaluation: greedy accuracy and the task's own metrics, and with --eval-samples k the mean@k and unbiased
pass@j of k sampled completions per prompt; single-turn completions and multi-turn episodes alike."""

import math

from common.distributed import all_ranks_ok, fail, reduce_stats
from common.llm.engines import sample_seed
from common.llm.episodes import run_episodes, start_seed
from common.llm.run import LLMRun
from common.llm.scoring import decode_completion, sample_correct, task_scores
from tasks import Example


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
    whole (common/llm/episodes.py), and what they count correct is what is averaged."""
    task, test_ids, args = run.task, run.test_ids, run.args
    count = len(test_ids) if num_eval_prompts == 0 else min(num_eval_prompts, len(test_ids))
    indices = list(range(run.rank, count, run.world_size))
    examples = [run.test[i] for i in indices]
    starts = [start_seed("test", i) for i in indices]  # the held-out start states: the same for every --seed
    samples = run_episodes(engine, run, [test_ids[i] for i in indices], examples, [0] * len(indices), max_tokens, 0.0,
                           starts)
    texts = [decode_completion(run.tokenizer, s.completion_ids, run.eos_ids) for s in samples]
    sums = {"accuracy": float(sum(sample_correct(run, examples, samples, texts)))}
    sums.update(task_metric_sums(task, run.test[0], examples, texts))
    if run.multi_turn:  # the same names on every rank
        sums["turns"] = float(sum(s.episode.turns for s in samples))
        if "tool_calls" in run.event_names:
            sums["tool_call_rate"] = float(sum(s.episode.events["tool_calls"] > 0 for s in samples))
    k = args.eval_samples
    if k:
        prompts = [test_ids[i] for i in indices for _ in range(k)]
        seeds = [sample_seed(args.seed, -1, i, j) for i in indices for j in range(k)]  # step -1: evaluation
        repeated = [run.test[i] for i in indices for _ in range(k)]
        sampled = run_episodes(engine, run, prompts, repeated, seeds, max_tokens, args.eval_temperature,
                               [start for start in starts for _ in range(k)])
        texts = [decode_completion(run.tokenizer, s.completion_ids, run.eos_ids) for s in sampled]
        right = sample_correct(run, repeated, sampled, texts)
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
