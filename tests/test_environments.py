"""Environments written for other trainers, trained unchanged (tasks/adapters.py and its three adapters): classes in
TRL's `environment_factory` contract, Gymnasium text environments, and OpenEnv servers, real ones (openenv-core's
HTTP/WebSocket app under uvicorn, each in a process of its own). The environments: tests/foreign_environments.py, one
multiplication problem in each contract. In process: the episodes, their seeds, the refusals, time limits,
reconnection, MCP tools, a launched server's cleanup. End to end under torchrun: GRPO on a TRL class (the same bits at
one and four environment threads, and after a resume) and against an OpenEnv server on two ranks, a Gymnasium
environment, and the refusals before any model loads."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, check, only_run_dir, read_metrics, run_script, script_env
from transformers import AutoTokenizer

from common.llm.episodes import probe_environment, run_episodes, start_episode, start_seed
from common.llm.run import Sample
from tasks import EnvOptions, TaskError, make_task
from tasks.tools import environment_of

HELPERS = "tests/foreign_environments.py"
CALCULATOR = ROOT / "assets" / "tiny-calculator"


@pytest.fixture(scope="module")
def tokenizer() -> object:
    return AutoTokenizer.from_pretrained(CALCULATOR)


def options(**settings: object) -> EnvOptions:
    return EnvOptions(**{"prompts_per_step": 2, "num_generations": 2, "num_eval_prompts": 4, "time_limit_s": 30.0,
                         **settings})


def play(task: object, seed: int, texts: list[str]) -> tuple[str | None, list[tuple], float, dict]:
    """One episode by hand, as the turn loop plays it: the reset's text, each step's result, finish, the events."""
    environment = environment_of(task)
    opening = start_episode(environment, task.train[0], 4, seed)
    results = []
    for turn, text in enumerate(texts):
        environment.turn = turn
        results.append(environment.step(text))
        if results[-1][2]:
            break
    return opening, results, environment.finish(), dict(environment.events)


def product(opening: str) -> str:
    a, b = opening.rstrip(":").split("*")
    return str(int(a) * int(b))


class TurnEngine:
    """Gives every episode the same text at each turn (`texts[k]` at turn k) and records the prompts it was given:
    an engine whose samples are known, for the turn loop and the adapters to be what is tested."""

    def __init__(self, tokenizer: object, texts: list[str]) -> None:
        self.tokenizer, self.texts, self.calls = tokenizer, texts, []

    def generate(self, prompts: list[list[int]], seeds: list[int], max_tokens: object, temperature: float,
                 eos_ids: list[int]) -> list[Sample]:
        self.calls.append(prompts)
        ids = self.tokenizer(self.texts[len(self.calls) - 1], add_special_tokens=False).input_ids + eos_ids[:1]
        return [Sample(ids, [-1.0] * len(ids), False) for _ in prompts]


def loop_run(task: object, tokenizer: object, workers: int = 1) -> SimpleNamespace:
    return SimpleNamespace(task=task, tokenizer=tokenizer, eos_ids=[tokenizer.eos_token_id], templated=False,
                           prompt_limit=40, multi_turn=True, event_names=environment_of(task).event_names,
                           args=SimpleNamespace(max_turns=3, env_workers=workers))


# ---------------------------------------------------------------- TRL's contract


def test_a_trl_class_plays_episodes_seeded_by_its_start(tokenizer):
    """The class unchanged (TinyCalls only says the tiny model's call syntax): its reset draws the problem from the
    start seed and writes the prompt, a call goes to its calculator, the answer to its submit, and get_reward scores
    the episode. One start seed, one problem: a group's samples compare answers to the same question."""
    task = make_task(f"{HELPERS}:TinyCalls", options())
    assert type(task).__name__ == "TinyCalls" and [s["function"]["name"] for s in task.tool_schemas[None]] == [
        "calculator", "submit"]
    assert probe_environment(environment_of(task), tokenizer, task.train[0], 4) is None
    opening, results, reward, events = play(task, 7, ["[12*34]", "nothing"])
    assert opening.endswith(":") and results == [("=408;", 0.0, False), (None, 0.0, True)]
    assert reward == 0.0 and events == {"tool_calls": 1, "answers": 1}
    right = play(task, 7, [product(opening)])
    assert right[0] == opening and right[2] == 1.0  # the same seed, the same problem; the right answer scores 1
    assert len({play(task, seed, ["0"])[0] for seed in range(8)}) > 1  # other seeds, other problems
    assert start_seed(1, 5, 3) == start_seed(1, 5, 3) != start_seed(1, 5, 4) and start_seed(1, 5, 3) < 2**32


def test_the_turn_loop_gives_a_group_one_prompt_and_adds_get_reward(tokenizer):
    """Through run_episodes: each episode's prompt is its reset's text (kept on the sample for the loss), the two
    samples of a start seed share it, and get_reward is added at the end, also to an episode cut by the turn limit."""
    task = make_task(f"{HELPERS}:TinyCalls", options())
    engine = TurnEngine(tokenizer, ["[2*3]", "[4*5]", "[6*7]"])
    samples = run_episodes(engine, loop_run(task, tokenizer), [[], [], []], task.train[:1] * 3, [1, 2, 3], 40, 1.0,
                           [11, 11, 12])
    prompts = [tokenizer.decode(sample.prompt_ids) for sample in samples]
    assert prompts[0] == prompts[1] != prompts[2] and engine.calls[0] == [s.prompt_ids for s in samples]
    for sample in samples:  # three calls, the turn limit: no answer, get_reward 0 (nothing submitted)
        assert sample.episode.turns == 3 and sample.episode.end == "turns" and sample.episode.reward == 0.0
        assert sample.episode.events["tool_calls"] == 3 and sample.episode.events["answers"] == 0
    prompt = tokenizer.decode(samples[2].prompt_ids)
    answered = run_episodes(TurnEngine(tokenizer, [product(prompt)]), loop_run(task, tokenizer, workers=3),
                            [[]] * 2, task.train[:1] * 2, [1, 2], 40, 1.0, [12, 12])
    assert [(s.episode.reward, s.episode.correct, s.episode.turns) for s in answered] == [(1.0, True, 1)] * 2


def test_trl_classes_that_break_the_contract_are_refused_naming_class_and_method(tmp_path: Path, tokenizer):
    module = tmp_path / "broken_envs.py"
    module.write_text(
        "class NoReset:\n    def step(self, text: str) -> str:\n        return text\n\n"
        "class NeedsArguments:\n    def __init__(self, level):\n        pass\n    def reset(self, **row):\n"
        "        return None\n\n"
        "class UntypedTool:\n    def reset(self, **row):\n        return '1*2:'\n    def guess(self, number):\n"
        "        '''Guess.\n\n        Args:\n            number: a number\n        '''\n        return ''\n\n"
        "class NumberReset:\n    def reset(self, **row):\n        return 5\n\n"
        "class TextReward:\n    def reset(self, **row):\n        return '1*2:'\n    def get_reward(self):\n"
        "        return '1'\n\n"
        "class Letters:\n    def reset(self, **row):\n        return 'what is six times seven?'\n\n"
        "class Echo:\n    def reset(self, prompt='', **row):\n        self.row = row\n        return ':'\n\n"
        "class Double(Echo):\n    pass\n\n"
        "class Bare:\n    def reset(self):\n        return '*'\n\n"
        "ROUTED = {'echo': Echo, 'double': Double}\n")
    with pytest.raises(TaskError, match="not a subclass of tasks.Task, nor an environment class in TRL's contract"):
        make_task(f"{module}:NoReset", options())
    with pytest.raises(TaskError, match=r"NeedsArguments\(\) failed: TypeError.*makes an environment with no "):
        make_task(f"{module}:NeedsArguments", options())
    with pytest.raises(TaskError, match="UntypedTool.guess is a tool .* missing a type hint"):
        make_task(f"{module}:UntypedTool", options())
    for name, message in (("NumberReset", "NumberReset.reset returned int: TRL's contract is text"),
                          ("TextReward", "TextReward.get_reward returned '1': a reward is a finite number"),
                          ("Letters", "reset writes a prompt the model cannot read")):
        task = make_task(f"{module}:{name}", options())
        assert message in probe_environment(environment_of(task), tokenizer, task.train[0], 4)
    with pytest.raises(TaskError, match=r"routes rows to \['double', 'echo'\] .* --env-dataset"):
        make_task(f"{module}:ROUTED", options())
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in (
        {"prompt": "1", "environment": "double", "level": 3}, {"prompt": "2", "environment": "echo"})))
    routed = make_task(f"{module}:ROUTED", options(dataset=str(rows)))
    first, second = environment_of(routed), environment_of(routed)
    start_episode(first, routed.train[0], 4, 5)
    start_episode(second, routed.train[1], 4, 5)
    assert type(first.instance).__name__ == "Double" and first.instance.row == {"level": 3}  # no `environment` field
    assert type(second.instance).__name__ == "Echo" and first.example.prompt == "1:"  # the row's prompt, extended
    bare = make_task(f"{module}:Bare", options(dataset=str(rows)))  # reset(self): the row's fields it does not name
    assert start_episode(environment_of(bare), bare.train[0], 4, 5) == "*"  # are not passed
    (tmp_path / "wrong.jsonl").write_text(json.dumps({"environment": "triple"}) + "\n")
    with pytest.raises(TaskError, match=r"has environment 'triple'; the environments are \['double', 'echo'\]"):
        make_task(f"{module}:ROUTED", options(dataset=str(tmp_path / "wrong.jsonl")))


def test_a_hung_tool_call_ends_its_episode_at_the_time_limit_and_is_abandoned():
    """The calculator never returns: the call ends at --env-time-limit-s, the episode ends (the instance cannot answer
    again), get_reward is not called on it, and nothing waits for the hung thread."""
    task = make_task(f"{HELPERS}:HangingCalls", options(time_limit_s=0.5))
    started = time.monotonic()
    try:
        opening, results, reward, events = play(task, 3, ["[1*2]", "2"])
        assert results == [(None, 0.0, True)] and reward == 0.0
        assert events == {"tool_calls": 1, "failed_timeout": 1} and time.monotonic() - started < 5
        hung = [t for t in threading.enumerate() if t.name == "environment HangingCalculator" and t.is_alive()]
        assert hung and all(t.daemon for t in hung)  # left running, and unable to hold the process at exit
    finally:
        task.classes[None].release.set()  # the abandoned thread may end now


# ---------------------------------------------------------------- Gymnasium

OLD_GYM = '''
class Countdown:
    """The older gym API: reset gives the observation alone, step a 4-tuple; rewards 0.25 a step, 0.5 at the end."""
    def reset(self, seed=None):
        self.left = 2
        return "2:"

    def step(self, action):
        self.left -= 1
        return str(self.left), 0.5 if self.left == 0 else 0.25, self.left == 0, {}


class Stuck(Countdown):
    def step(self, action):
        import time
        time.sleep(3)


class Pictures(Countdown):
    def reset(self, seed=None):
        return [0, 1]
'''


def test_gymnasium_text_environments_five_and_four_tuples_rewards_summed(tmp_path: Path, tokenizer):
    """A gymnasium.Env subclass (5-tuples, seeded through np_random) and an older gym class (4-tuples, named with
    gym:) through the turn loop: the observation is the prompt, then each step's reply; the rewards add up; a step
    past the time limit ends the episode; a non-text observation is refused naming the method."""
    task = make_task(f"{HELPERS}:MultiplyText", options())
    assert type(task).__name__ == "GymTextTask"
    assert probe_environment(environment_of(task), tokenizer, task.train[0], 4) is None
    opening, results, _, _ = play(task, 9, ["[10*10]", "1"])
    assert opening == play(task, 9, [])[0] and results == [("=100;", 0.0, False), (None, 0.0, True)]
    assert play(task, 9, [product(opening)])[1] == [(None, 1.0, True)]
    (tmp_path / "old_gym.py").write_text(OLD_GYM)
    old = make_task(f"gym:{tmp_path / 'old_gym.py'}:Countdown", options())
    samples = run_episodes(TurnEngine(tokenizer, ["1", "1", "1"]), loop_run(old, tokenizer), [[]], old.train[:1],
                           [1], 40, 1.0, [4])
    episode = samples[0].episode
    assert (episode.reward, episode.correct, episode.turns, episode.end) == (0.75, False, 2, "done")
    assert tokenizer.decode(samples[0].prompt_ids) == "2:"
    stuck = make_task(f"gym:{tmp_path / 'old_gym.py'}:Stuck", options(time_limit_s=0.5))
    assert play(stuck, 1, ["1"])[1:] == ([(None, 0.0, True)], 0.0, {"failed_timeout": 1})
    pictures = make_task(f"gym:{tmp_path / 'old_gym.py'}:Pictures", options())
    assert "Pictures.reset returned the observation [0, 1] (list)" in probe_environment(
        environment_of(pictures), tokenizer, pictures.train[0], 4)
    with pytest.raises(TaskError, match="gymnasium cannot make 'NoSuchText-v0'"):
        make_task("gym:NoSuchText-v0", options())


# ---------------------------------------------------------------- OpenEnv: real servers, each in its own process


@pytest.fixture(scope="module")
def multiply_server():
    from tasks.openenv_launch import LaunchedServer

    server = LaunchedServer(HELPERS, "MultiplyServer", 16, 120.0)  # two ranks' 8 sessions each, end to end
    yield server
    server.stop()


def test_an_openenv_server_plays_text_episodes_and_replays_one_whose_connection_dropped(multiply_server):
    """The action's and observation's text fields read off the server's schema; the reset's observation is the prompt;
    a connection closed under an episode is replaced by a fresh session that replays it, and the episode goes on with
    the answers an undisturbed one gets."""
    task = make_task(f"openenv:{multiply_server.url}", options())
    assert (task.action_field, task.observation_field, task.tools_mode) == ("text", "text", False)
    record = task.environment_record()
    assert record["url"] == multiply_server.url and record["server"]["name"] == "MultiplyServer"
    assert record["server"]["version"] == "1.0.0" and record["openenv_core"] and record["sessions_per_rank"] == 4
    undisturbed = play(task, 21, ["[11*11]", "[12*12]", "0"])
    environment = environment_of(task)
    opening = start_episode(environment, task.train[0], 4, 21)
    first = environment.step("[11*11]")
    environment.session.connection.socket.close()  # the connection drops under the episode
    rest = [environment.step("[12*12]"), environment.step("0")]
    assert (opening, [first, *rest]) == undisturbed[:2] and environment.events["reconnects"] == 1
    environment.finish()
    assert play(task, 21, [product(opening)])[1] == [(None, 1.0, True)]
    task.pool.close()  # the server's sessions free for the end-to-end run below


def test_a_server_with_fewer_sessions_than_episodes_is_refused_and_mcp_tools_are_the_models(tmp_path: Path):
    """openenv's MCP tool environments: list_tools gives the model's tools, a call is a call_tool step. The same
    server, serving two sessions, is refused for a run that needs four per rank, with its limit and the arithmetic."""
    from tasks.openenv_launch import LaunchedServer

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "6*7:"}) + "\n")
    server = LaunchedServer(HELPERS, "CalculatorTools", 2, 120.0)
    try:
        task = make_task(f"openenv:{server.url}", options(dataset=str(rows), prompts_per_step=1, num_eval_prompts=1))
        assert task.tools_mode and list(task.tools) == ["multiply"]
        assert task.tool_schemas[0]["function"]["parameters"]["required"] == ["a", "b"]
        _, results, _, events = play(task, 1, ['<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}'
                                               '</tool_call>', '<tool_call>{"name": "divide", "arguments": {}}'
                                               '</tool_call>', "42"])
        assert results == [("42", 0.0, False), ("error: no tool 'divide'; the tools are multiply", 0.0, False),
                           (None, 0.0, True)]
        assert events == {"tool_calls": 2, "failed_unknown_tool": 1}
        task.pool.close()  # its sessions given up: the refusal below is the run's own need
        with pytest.raises(TaskError) as refused:
            make_task(f"openenv:{server.url}", options(prompts_per_step=4, num_generations=2, generating_ranks=2))
        assert f"the OpenEnv server at {server.url} accepts at most 2 sessions at once" in str(refused.value)
        assert "this rank runs 4 episodes at once (4 prompts x 2 samples / 2 ranks in training" in str(refused.value)
        assert "4 x 2 = 8 over the run's ranks" in str(refused.value)
    finally:
        server.stop()
    with pytest.raises(TaskError, match="OneSessionServer does not set SUPPORTS_CONCURRENT_SESSIONS = True"):
        make_task(f"openenv:{HELPERS}:OneSessionServer", options())


def test_the_episodes_a_rank_runs_at_once():
    """What a rank's sessions must cover: a training step's rows, or its share of an evaluation (k samples each),
    whichever is more; a split layout's trainer runs none but its probe."""
    settings = dict(prompts_per_step=8, num_generations=4, num_eval_prompts=0, generating_ranks=2)
    assert EnvOptions(**settings).episodes_at_once(test_count=10) == 16  # training: 8 x 4 / 2
    assert EnvOptions(**settings).episodes_at_once(test_count=41) == 21  # evaluation: 41 / 2, rounded up
    assert EnvOptions(**settings, eval_samples=4).episodes_at_once(test_count=10) == 20  # 5 prompts x 4 samples
    assert EnvOptions(**settings, generates=False).episodes_at_once(test_count=41) == 1


def test_a_launched_server_goes_when_its_trainer_is_killed(tmp_path: Path):
    """A trainer killed outright (no exit handler runs) still takes its server along: the parent-death signal."""
    code = ("import sys, time\nfrom tasks.openenv_launch import LaunchedServer\n"
            f"server = LaunchedServer({HELPERS!r}, 'MultiplyServer', 1, 120.0)\n"
            "print(server.process.pid, flush=True)\ntime.sleep(600)\n")
    trainer = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=script_env(), stdout=subprocess.PIPE,
                               text=True)
    server_pid = int(trainer.stdout.readline())
    os.kill(server_pid, 0)  # running
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.killpg(server_pid, signal.SIGKILL)
        pytest.fail("the server outlived its trainer")


# ---------------------------------------------------------------- end to end

TRL_RUN = ["--task", f"{HELPERS}:TinyCalls", "--model-name-or-path", str(CALCULATOR), "--max-completion-length",
           "24", "--max-turns", "2", "--prompts-per-step", "4", "--num-generations", "4", "--micro-batch-size", "16",
           "--num-eval-prompts", "8", "--eval-every", "2", "--total-steps", "2", "--save-every", "1", "--keep-last",
           "0", "--seed", "1"]


def final_hash(run_dir: Path) -> str:
    return json.loads((run_dir / "final.json").read_text())["parameter_sha256"]


def test_grpo_trains_a_trl_class_with_the_same_bits_twice_at_any_thread_count_and_after_a_resume(tmp_path: Path):
    """Two ranks, two steps, one environment thread per rank; then a resume from step 1 with four threads computes
    step 2 and the final evaluation again, in fresh processes, to the same bytes and weights: the same bits twice, at
    any thread count, and after a resume (fresh instances per episode, seeded by their coordinates)."""
    check(run_script("grpo_llm.py", [*TRL_RUN, "--env-workers", "1", "--run-root", str(tmp_path)], nproc=2))
    run_dir = only_run_dir(tmp_path)
    reference, reference_hash = (run_dir / "metrics.jsonl").read_bytes(), final_hash(run_dir)
    steps = [m for m in read_metrics(run_dir) if m["step"]]
    assert all(m["episode/answers"] == 1.0 for m in steps) and sum(m["episode/tool_calls"] for m in steps) > 0
    assert any(m["train/grad_norm"] > 0 for m in steps)  # the weights moved: the comparison means something
    record = json.loads((run_dir / "manifest.json").read_text())["determinism"]["environment"]
    assert record["contract"] == "TRL environment class" and record["answer_tool"] == "submit"
    check(run_script("grpo_llm.py", [*TRL_RUN, "--env-workers", "4", "--resume",
                                     str(run_dir / "checkpoints" / "step_00000001")], nproc=2))
    assert (run_dir / "metrics.jsonl").read_bytes() == reference and final_hash(run_dir) == reference_hash


SMALL_ENV_RUN = ["--model-name-or-path", str(CALCULATOR), "--max-completion-length", "24", "--max-turns", "2",
                 "--prompts-per-step", "4", "--num-generations", "4", "--micro-batch-size", "16",
                 "--num-eval-prompts", "8", "--eval-every", "2", "--total-steps", "2", "--seed", "1"]


def test_grpo_trains_against_an_openenv_server_on_two_ranks(tmp_path: Path, multiply_server):
    """The test's server (openenv-core's app in its own process) serves both ranks' sessions; the manifest records
    its URL and version."""
    check(run_script("grpo_llm.py", [*SMALL_ENV_RUN, "--task", f"openenv:{multiply_server.url}", "--run-root",
                                     str(tmp_path)], nproc=2))
    run_dir = only_run_dir(tmp_path)
    steps = [m for m in read_metrics(run_dir) if m["step"]]
    assert len(steps) == 2 and all(m["episode/failed_connection"] == 0 == m["episode/failed_error"] for m in steps)
    assert any(m["episode/env_tokens"] > 0 for m in steps)  # the calculator answered calls over the wire
    record = json.loads((run_dir / "manifest.json").read_text())["determinism"]["environment"]
    assert record["url"] == multiply_server.url and record["server"]["version"] == "1.0.0"


def test_grpo_trains_a_gymnasium_text_environment(tmp_path: Path):
    check(run_script("grpo_llm.py", [*SMALL_ENV_RUN, "--task", f"{HELPERS}:MultiplyText", "--run-root",
                                     str(tmp_path)]))
    steps = [m for m in read_metrics(only_run_dir(tmp_path)) if m["step"]]
    assert len(steps) == 2 and all(m["episode/failed_timeout"] == 0 for m in steps)


def test_a_single_session_server_and_a_bad_reset_are_refused_before_any_model_loads(tmp_path: Path):
    from tasks.openenv_launch import LaunchedServer

    server = LaunchedServer(HELPERS, "OneSessionServer", 1, 120.0)
    try:
        result = run_script("grpo_llm.py", [*SMALL_ENV_RUN, "--task", f"openenv:{server.url}", "--run-root",
                                            str(tmp_path / "one")], timeout=300)
    finally:
        server.stop()
    assert result.returncode == 2
    assert "accepts at most 1 session at once" in result.stderr and "this rank runs 16 episodes at once" in \
        result.stderr
    result = run_script("grpo_llm.py", [*SMALL_ENV_RUN, "--task", f"{HELPERS}:BrokenReset", "--run-root",
                                        str(tmp_path / "broken")], timeout=300)
    assert result.returncode == 2 and "failed in reset" in result.stderr
    assert "BrokenReset.reset raised ValueError('no problem table loaded')" in result.stderr
    for output in ("one", "broken"):
        assert not (tmp_path / output).exists() or not list((tmp_path / output).iterdir())
    assert "Initializing" not in result.stdout + result.stderr



# ---------------------------------------------------------------- docs/environments.md's examples


def docs_block(heading: str, name: str, tmp_path: Path) -> str:
    """The first Python block under `heading` in docs/environments.md, saved as a user would save it."""
    section = (ROOT / "docs" / "environments.md").read_text().split(heading, 1)[1]
    (tmp_path / f"{name}.py").write_text(section.split("```python\n", 1)[1].split("```", 1)[0])
    return str(tmp_path / f"{name}.py")


def test_the_docs_examples_play_their_episodes(tmp_path: Path):
    """Each contract's complete example, loaded as `--task` loads it: a right guess ends the episode with reward 1 (a
    Hermes call of the TRL class's tool, the Gymnasium environment's answer, a launched OpenEnv server's step), and the
    same start seed gives the same secret."""
    def find(task: object, ask: object) -> list[tuple]:
        """Binary search with the environment's hints, from the same start each time."""
        low, high, results = 1, 100, []
        while low <= high:
            middle = (low + high) // 2
            environment = environment_of(task)
            start_episode(environment, task.train[0], 8, 99)
            results = [ask(environment, middle)]
            environment.finish()
            hint = results[-1][0] or ""
            if results[-1][2] or "right" in hint:
                return results
            low, high = (middle + 1, high) if "igher" in hint else (low, middle - 1)
        return results

    trl = make_task(f"{docs_block('## TRL environment classes', 'guess', tmp_path)}:GuessTheNumber", options())
    call = '<tool_call>{{"name": "guess", "arguments": {{"number": {}}}}}</tool_call>'
    assert find(trl, lambda environment, n: environment.step(call.format(n))) == [("right", 0.0, False)]
    gym = make_task(f"{docs_block('## Gymnasium text environments', 'higher_lower', tmp_path)}:HigherLower",
                    options())
    assert find(gym, lambda environment, n: environment.step(str(n))) == [(None, 1.0, True)]
    from tasks.openenv_launch import LaunchedServer

    served = make_task(f"openenv:{docs_block('## OpenEnv servers', 'guess_server', tmp_path)}:GuessServer",
                       options(time_limit_s=120.0))  # a server of its own, as a rank starts one
    assert isinstance(served.server, LaunchedServer)
    try:
        assert (served.action_field, served.observation_field) == ("guess", "message")
        assert find(served, lambda environment, n: environment.step(str(n))) == [(None, 1.0, True)]
    finally:
        served.server.stop()
