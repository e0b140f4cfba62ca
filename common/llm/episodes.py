"""The turn loop of multi-turn tasks, token in, token out: every rollout (GRPO, PPO, online DPO; colocated or on the
rollout ranks; training and evaluation) goes through `run_episodes`. A single-turn task (no environment) is one
engine call.

An episode is one flat list of token ids after the prompt. Each turn, the episodes still running go to the engine
together, each as `prompt_token_ids` = its prompt + its episode so far, with what is left of its budget
(`--max-completion-length` counts every turn's model and environment tokens) and its own seed for that turn (derived
from its sample seed and the turn alone, so no episode depends on its batch-mates). The ids the engine sampled are
appended unchanged, never decoded and encoded again (a text's re-encoding need not give the ids that were sampled,
and the loss must see those). The turn's text goes to the environment; its reply is appended as token ids with loss
mask 0 and logprob 0.0: with a chat template, the template's tokens for a tool message, computed as a difference on a
fixed base conversation (the episode itself is never re-templated); without one, the reply's plain encoding.

Before the first turn each environment is reset with its start seed; a task whose environment writes the prompt
(`Task.environment_prompts`, TRL's contract) gets each episode's prompt encoded after its reset, kept with the sample
(`Sample.prompt_ids`) for the loss. An episode ends when the environment says so (or has no reply), when the model's
turn runs out of budget, when the reply would leave no room for another model token (the reply is rolled back: the
episode ends truncated, by "budget"), or after `--max-turns` model turns; then every environment's `finish()` adds
its last reward. An environment that raises or returns the wrong types stops every rank with a message (one
collective per call, on every rank, whatever the turn counts)."""

import functools
import hashlib
import json
import math
import os
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch
import torch.distributed as dist
from tokenizers import Tokenizer

from common.distributed import all_ranks_ok, fail, local_world_size
from common.llm.run import Episode, LLMRun, Sample
from common.llm.scoring import decode_completion
from common.tracking import get_logger
from tasks import Environment, Example, TaskError, characters_kept
from tasks.tools import environment_of

TEMPLATE_BASE = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]  # the fixed base
REPLY_MARK = "TOOLREPLYMARK"  # where a reply holding an added token's text goes in the rendered template


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of an episode's `turn`: its sample seed at turn 0 (a single-turn sample's own), then a
    63-bit hash of (sample seed, turn)."""
    if turn == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}/turn/{turn}".encode()).digest()[:8], "little") & (2**63 - 1)


def start_seed(*coordinates: object) -> int:
    """An episode's start-state seed (tasks/base.py, Environment) from its coordinates: (--seed, step, prompt) in
    training, ("test", test index) in evaluation. 32 bits: what numpy's legacy seeding and most environments take."""
    digest = hashlib.sha256("/".join(map(str, (*coordinates, "start"))).encode()).digest()
    return int.from_bytes(digest[:4], "little")


def start_episode(environment: Environment, example: Example, max_turns: int, seed: int) -> str | None:
    """What the environment knows before its first step (tasks/base.py, Environment): the turn limit, empty events,
    no verdict yet, its start seed; then its own `reset`, whose text (if any) extends the prompt."""
    environment.max_turns, environment.turn, environment.seed = max_turns, 0, seed
    environment.events, environment.correct = Counter(), None
    opening = environment.reset(example)
    if opening is not None and not isinstance(opening, str):
        raise TypeError(f"reset must return text or None, got {type(opening).__name__}")
    return opening


def check_finish(value: object) -> float:
    """An environment's `finish()` result as a number, or TypeError saying what is wrong (or what it raised)."""
    if isinstance(value, Exception):
        raise value
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TypeError(f"finish must return a finite number (a last reward), got {value!r}")
    return float(value)


def episode_prompt(run: LLMRun, example: Example, opening: str | None) -> list[int] | None:
    """The episode's own prompt ids when its environment's reset wrote text (`Task.environment_prompts`): the user
    message extended by it, formatted and encoded as the task's prompts are. None when reset wrote nothing; ValueError
    when the task did not ask for it, or the prompt is empty or longer than --max-prompt-length."""
    task, tokenizer = run.task, run.tokenizer
    if opening is None:
        if task.environment_prompts and not example.prompt:
            raise ValueError("the row has no prompt and the environment's reset returned no text: the model would "
                             "start from nothing")
        return None
    if not task.environment_prompts:
        raise ValueError("reset returned text, which extends the prompt only for a task that sets "
                         "environment_prompts = True")
    text = task.format_prompt(tokenizer, replace(example, prompt=example.prompt + opening))
    ids = tokenizer(text, add_special_tokens=not run.templated).input_ids
    if not ids or len(ids) > run.prompt_limit:
        raise ValueError(f"the prompt the environment's reset wrote is {len(ids)} tokens, outside 1 to "
                         f"{run.prompt_limit} (--max-prompt-length, or what the model's context leaves after "
                         f"--max-completion-length): {text[:200]!r}")
    return ids


def check_reply_encodes(tokenizer: object, text: str) -> str | None:
    """Why a reply's text cannot reach the model (fewer than half of its characters survive the tokenizer, as for
    `check_task_fits`' prompts: a character-level model's vocabulary has no letters), or None."""
    if text.strip() and characters_kept(tokenizer, text) < len(text) / 2:
        kept = tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids, skip_special_tokens=True)
        return f"the reply {text!r} encodes to {kept!r} with this tokenizer: its characters are unknown to it"
    return None


def probe_environment(environment: Environment, tokenizer: object, example: Example, max_turns: int) -> str | None:
    """Before any model loads: a fresh `environment`, reset on `example` (its text, if any, must encode), stepped
    once with its `probe_text` (skipped when that is None: its step has side effects), then finished, must return the
    right types, with a reply the tokenizer can encode. Returns why not, or None."""
    try:
        opening = start_episode(environment, example, max_turns, start_seed("probe"))
    except Exception as error:
        return (f"the task's environment failed in reset on prompt {example.prompt!r} (a probe before any model "
                f"loads): {error!r}")
    if opening is not None and (problem := check_reply_encodes(tokenizer, opening)):
        return f"the task's environment's reset writes a prompt the model cannot read: {problem}"
    reply = None
    if environment.probe_text is not None:
        try:
            reply, _, _ = checked_outcome(environment.step(environment.probe_text))
        except Exception as error:
            return (f"the task's environment failed at turn 1 of prompt {example.prompt!r} with model text "
                    f"{environment.probe_text!r} (a probe before any model loads; Environment.probe_text = None "
                    f"skips the step): {error!r}")
    try:
        check_finish(environment.finish())
    except Exception as error:
        return f"the task's environment failed in finish after the probe (before any model loads): {error!r}"
    return check_reply_encodes(tokenizer, reply) if reply is not None else None


@functools.lru_cache(maxsize=4)
def all_special_copy(tokenizer: object) -> Tokenizer:
    """A copy of a fast tokenizer's backend whose added tokens are all special, set to encode their text as text:
    `split_special_tokens` splits only the special ones, and a fast tokenizer matches its non-special added tokens
    (Qwen2.5's <tool_call>) whatever it is told. Built once per tokenizer, when a reply first needs it."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    for token in state["added_tokens"]:
        token["special"] = True
    copy = Tokenizer.from_str(json.dumps(state))
    copy.encode_special_tokens = True
    copy.no_truncation()  # as the tokenizer's own call without truncation or padding
    copy.no_padding()
    return copy


def reply_encoder(tokenizer: object, templated: bool, eos_ids: list[int]) -> Callable[[str], list[int]]:
    """The function from a reply's text to the token ids appended for it. With a chat template: the template of the
    fixed base plus a tool message (and the next assistant turn's opening), minus the base's tokens up to and including
    the assistant's end-of-turn id (what the model sampled): the rest, e.g. Qwen2.5's newline after <|im_end|>, is
    the template's, not the model's, so it opens the reply. The reply's own text never gives an added token (special
    or not: a tool must not forge a tool call). Raises TaskError when the template cannot do this."""
    non_special = {index for index, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
                   if not token.special}

    def literal(text: str) -> list[int]:
        """The reply's own text: "<|im_end|>" or "<tool_call>" printed by a tool is characters, not the token."""
        ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids
        if non_special.isdisjoint(ids) or not hasattr(tokenizer, "backend_tokenizer"):  # a Python tokenizer splits all
            return ids
        return all_special_copy(tokenizer).encode(text, add_special_tokens=False).ids

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    if not templated:
        return literal
    try:
        base = encode(tokenizer.apply_chat_template(TEMPLATE_BASE, tokenize=False))
    except Exception as error:
        raise TaskError(f"the tokenizer's chat template cannot write an assistant turn: {error!r}") from error
    ends = [i for i, token in enumerate(base) if token in eos_ids]
    if not ends:
        raise TaskError("the chat template does not end the assistant's turn with one of the model's EOS ids "
                        f"{eos_ids}: a sampled turn would not end where the template's does")
    cut = ends[-1] + 1

    def reply_ids(text: str) -> list[int]:
        own = literal(text)
        holds_added = own != encode(text)  # an added token's text in it (as the tokenizer matches them)
        try:
            rendered = tokenizer.apply_chat_template(
                TEMPLATE_BASE + [{"role": "tool", "content": REPLY_MARK if holds_added else text}], tokenize=False,
                add_generation_prompt=True)
        except Exception as error:
            raise TaskError(f"the chat template cannot write a tool message: {error!r}") from error
        if holds_added:  # the template's tokens around the reply's, each encoded on its own
            before, _, after = rendered.partition(REPLY_MARK)
            full = encode(before) + own + encode(after)
        else:
            full = encode(rendered)
        if full[:len(base)] != base:
            raise TaskError("the chat template's tokens for a tool message change the tokens before it: the reply "
                            "cannot be appended as a token difference")
        return full[cut:]

    return reply_ids


def environment_outcomes(workers: int, environments: list[Environment], texts: list[str] | None) -> list[object]:
    """Each environment's `step` of its text (`finish()` where `texts` is None), on up to `workers` threads at once
    (a sandboxed call waits on its processes, a remote one on its server, not on the interpreter), in the episodes'
    order whatever order they finish in. A call that raises gives its exception in its place."""
    def call(pair: tuple[Environment, str | None]) -> object:
        try:
            return pair[0].finish() if texts is None else pair[0].step(pair[1])
        except Exception as error:
            return error

    pairs = list(zip(environments, texts if texts is not None else [None] * len(environments)))
    if workers <= 1 or len(pairs) <= 1:
        return [call(pair) for pair in pairs]
    with ThreadPoolExecutor(min(workers, len(pairs))) as pool:
        return list(pool.map(call, pairs))


def checked_outcome(result: object) -> tuple[str | None, float, bool]:
    """An environment's `step` result as (reply, reward, done), or TypeError saying what is wrong (or what it
    raised)."""
    if isinstance(result, Exception):
        raise result
    if not (isinstance(result, tuple) and len(result) == 3):
        raise TypeError(f"step must return (reply text or None, reward, done), got {result!r}")
    reply, reward, done = result
    if reply is not None and not isinstance(reply, str):
        raise TypeError(f"step's reply must be text or None, got {type(reply).__name__}")
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise TypeError(f"step's reward must be a finite number, got {reward!r}")
    if not isinstance(done, bool):
        raise TypeError(f"step's done must be a bool, got {done!r}")
    return reply, float(reward), done


_warned_lost_reply = False


def warn_once_if_lost(tokenizer: object, text: str) -> None:
    """A warning, once per process, when an environment's reply does not survive the tokenizer (the model would read
    nothing, or little, of it)."""
    global _warned_lost_reply
    if not _warned_lost_reply and (problem := check_reply_encodes(tokenizer, text)):
        _warned_lost_reply = True
        get_logger(dist.get_rank() if dist.is_initialized() else 0).warning(
            f"{problem}; the model reads its tokens only (warned once)")


def run_episodes(engine: object, run: LLMRun, prompts: list[list[int]], examples: list[Example], seeds: list[int],
                 max_tokens: int, temperature: float, start_seeds: list[int] | None = None) -> list[Sample]:
    """One sample per prompt: an engine call for a single-turn task, else whole episodes (the module's docstring),
    each environment reset with its start seed (`start_seeds`; None: each episode's sample seed, cut to 32 bits). A
    collective on every rank for a multi-turn task. The task's `environment()` runs once per episode."""
    task, tokenizer, eos_ids = run.task, run.tokenizer, run.eos_ids
    if not run.multi_turn:  # decided alike on every rank, even one without prompts
        return engine.generate(prompts, seeds, max_tokens, temperature, eos_ids)
    environments, event_names = [environment_of(task) for _ in examples], run.event_names
    reply_ids = reply_encoder(tokenizer, run.templated, eos_ids)
    workers = run.args.env_workers or max(1, (os.cpu_count() or 1) // local_world_size())
    count, problem = len(prompts), None
    start_seeds = start_seeds if start_seeds is not None else [seed & (2**32 - 1) for seed in seeds]
    prompts, own_prompts = list(prompts), [None] * count
    ids: list[list[int]] = [[] for _ in range(count)]
    logprobs: list[list[float]] = [[] for _ in range(count)]
    masks: list[list[int]] = [[] for _ in range(count)]
    routes: list[torch.Tensor | None] = [None] * count  # the last turn's: its engine pass over the whole episode
    rewards, turns, ends, cut = [0.0] * count, [0] * count, ["turns"] * count, [False] * count
    for i, (environment, example) in enumerate(zip(environments, examples)):
        try:
            opening = start_episode(environment, example, run.args.max_turns, start_seeds[i])
            own_prompts[i] = episode_prompt(run, example, opening)
        except Exception as error:
            problem = problem or f"the task's environment failed in reset on prompt {example.prompt!r}: {error!r}"
            break
        if own_prompts[i] is not None:
            prompts[i] = own_prompts[i]
    running = [] if problem else list(range(count))
    group = getattr(engine, "tp_group", None)  # a tensor-parallel group generates together: each engine call is
    for turn in range(run.args.max_turns):  # its collective, so it goes on while any member has episodes running
        if group is None and not running:
            break
        if group is not None:
            members = [None] * dist.get_world_size(group)
            dist.all_gather_object(members, bool(running), group=group)
            if not any(members):
                break
        sampled = engine.generate([prompts[i] + ids[i] for i in running], [turn_seed(seeds[i], turn) for i in running],
                                  [max_tokens - len(ids[i]) for i in running], temperature, eos_ids)
        for i, sample in zip(running, sampled):
            ids[i] += sample.completion_ids
            logprobs[i] += sample.logprobs
            masks[i] += [1] * len(sample.completion_ids)
            routes[i] = sample.routes
            turns[i] += 1
            cut[i] = sample.truncated  # the model's turn hit the budget before its EOS
            environments[i].turn = turn
        texts = [decode_completion(tokenizer, sample.completion_ids, eos_ids) for sample in sampled]
        outcomes = environment_outcomes(workers, [environments[i] for i in running], texts)
        still = []
        for i, sample, text, outcome in zip(running, sampled, texts, outcomes):
            try:
                reply, reward, done = checked_outcome(outcome)
                reply_tokens = reply_ids(reply) if reply is not None and not done else []
                if reply is not None and not done:
                    warn_once_if_lost(tokenizer, reply)
            except Exception as error:  # a bug in the task's code: the run stops, with what it was given
                problem = (f"the task's environment failed at turn {turn + 1} of prompt {examples[i].prompt!r} "
                           f"with model text {text!r}: {error!r}")
                break
            rewards[i] += reward
            if sample.truncated or (not done and reply is not None and len(ids[i]) + len(reply_tokens) >= max_tokens):
                ends[i] = "budget"  # cut, or no room for the reply and another model token: the reply rolled back
            elif done or reply is None:
                ends[i] = "done"
            elif turn + 1 < run.args.max_turns:
                ids[i] += reply_tokens
                logprobs[i] += [0.0] * len(reply_tokens)
                masks[i] += [0] * len(reply_tokens)
                still.append(i)
        running = [] if problem else still
    if problem is None:  # every episode has ended: each environment's last reward, and what it took released
        for i, outcome in enumerate(environment_outcomes(workers, environments, None)):
            try:
                rewards[i] += check_finish(outcome)
            except Exception as error:
                problem = f"the task's environment failed in finish on prompt {examples[i].prompt!r}: {error!r}"
                break
    undeclared = {name for environment in environments for name in environment.events} - set(event_names)
    if undeclared and problem is None:
        problem = (f"the task's environment counted events {sorted(undeclared)} that its event_names "
                   f"{event_names} do not declare")
    if not all_ranks_ok(problem is None):
        fail(problem or "the task's environment failed on another rank; its message says why")
    samples = []
    for i, environment in enumerate(environments):
        correct = environment.correct if environment.correct is not None else rewards[i] >= 1
        episode = Episode(rewards[i], bool(correct), turns[i], masks[i].count(0), ends[i],
                          {name: environment.events[name] for name in event_names})
        samples.append(Sample(ids[i], logprobs[i], cut[i], masks[i], episode, routes=routes[i],
                              prompt_ids=own_prompts[i]))
    return samples


def episode_sums(samples: list[Sample], event_names: tuple[str, ...]) -> dict[str, float]:
    """This rank's sums of the episode statistics (to be reduced by name and divided by the episode count)."""
    episodes = [sample.episode for sample in samples]
    sums = {"episode/turns": sum(e.turns for e in episodes), "episode/env_tokens": sum(e.env_tokens for e in episodes),
            "episode/model_tokens": sum(sum(sample.model_mask()) for sample in samples),
            "episode/truncated_budget": sum(e.end == "budget" for e in episodes),
            "episode/truncated_turns": sum(e.end == "turns" for e in episodes)}
    sums.update({f"episode/{name}": sum(e.events.get(name, 0) for e in episodes) for name in event_names})
    if "tool_calls" in event_names:
        sums["episode/tool_call_rate"] = sum(e.events.get("tool_calls", 0) > 0 for e in episodes)
    return sums
