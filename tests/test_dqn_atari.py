"""dqn_atari.py: wrappers on a real ALE game, the frame-sharing replay buffer, the loss, the update and evaluation on
hand-built inputs, and end-to-end runs as subprocesses (python and torchrun with 2 ranks): determinism, a negative
control, update counts, save + evaluate, exact resume in the checkpoint's run directory, bad input."""

import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import psutil
import pytest
import torch
from gymnasium.wrappers import AtariPreprocessing

import dqn_atari as dqn
from common.tracking import WALL_CLOCK_PREFIXES

ROOT = Path(__file__).resolve().parent.parent
# A few hundred updates on a tiny buffer: every phase runs (collection, learning, target copies, a checkpoint
# halfway, logging, save + one evaluation game) in about 20 s on 2 CPU cores.
TINY = ["--total-timesteps", "1200", "--learning-starts", "400", "--buffer-size", "600", "--batch-size", "8",
        "--target-network-frequency", "200", "--save-every", "600", "--save-model", "--eval-episodes", "1"]


def run(args: list[str], run_root: Path, nproc: int = 0) -> subprocess.CompletedProcess:
    """`python dqn_atari.py` (nproc=0) or `torchrun --nproc_per_node nproc dqn_atari.py`, one thread per process, by
    the tests' warm launcher (tests/warm_launcher.py: the imports paid once)."""
    from conftest import run_script  # not at the top: the gradient worker imports this module outside pytest

    return run_script("dqn_atari.py", [*args, "--run-root", str(run_root)], nproc, launcher="warm")


def run_ok(args: list[str], run_root: Path, nproc: int = 0) -> Path:
    result = run(args, run_root, nproc)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    runs = [p for p in run_root.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def metric_lines(run_dir: Path) -> list[str]:
    """metrics.jsonl's lines, checked to hold no wall-clock field (those go to perf.jsonl), as exact bytes."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    timed = [key for line in lines for key in json.loads(line) if key.startswith(WALL_CLOCK_PREFIXES)]
    assert not timed, f"wall-clock fields in metrics.jsonl: {sorted(set(timed))}"
    return lines


def final(run_dir: Path) -> dict:
    return json.loads((run_dir / "final.json").read_text())


# ---------------------------------------------------------------------------------------------------------------------
# Wrappers on a real game
# ---------------------------------------------------------------------------------------------------------------------
def test_observations_are_stacked_84x84_uint8_frames():
    env = dqn.make_env("BreakoutNoFrameskip-v4", 108_000)()
    obs, _ = env.reset(seed=0)
    assert obs.shape == (4, 84, 84) and obs.dtype == np.uint8 and env.observation_space.shape == (4, 84, 84)
    assert all(np.array_equal(obs[0], frame) for frame in obs)  # reset pads with copies of the first frame
    distinct = set()
    for action in [2] * 10 + [3] * 10:  # move the paddle right, then left
        next_obs, *_ = env.step(action)
        np.testing.assert_array_equal(next_obs[:3], obs[1:])  # a sliding window of the newest frames
        distinct.add(len({frame.tobytes() for frame in next_obs}))
        obs = next_obs
    assert max(distinct) == 4


def test_noop_start_varies_the_first_frame_and_fire_starts_the_game():
    frames = []
    for seed in range(8):
        env = dqn.make_env("BreakoutNoFrameskip-v4", 108_000)()
        env.reset(seed=seed)
        frames.append(env.unwrapped.ale.getEpisodeFrameNumber())
    # 1..30 no-op frames, then FIRE and one more action (4 frames each) from FireResetEnv
    assert all(1 + 8 <= n <= 30 + 8 for n in frames) and len(set(frames)) > 3
    assert dqn.FireResetEnv in {type(layer) for layer in dqn.wrapper_layers(env)}


def test_life_loss_ends_the_episode_but_not_the_game():
    env = dqn.make_env("BreakoutNoFrameskip-v4", 108_000)()
    env.reset(seed=0)
    ale = env.unwrapped.ale
    terminated = False
    while not terminated:
        _, _, terminated, truncated, info = env.step(0)
        assert not truncated
    assert ale.lives() == 4 and not ale.game_over() and "episode" not in info  # a training episode, not a game
    frame_before = ale.getEpisodeFrameNumber()
    env.reset()
    assert ale.lives() == 4 and ale.getEpisodeFrameNumber() > frame_before  # same game, continued


def test_rewards_are_clipped_but_episode_returns_are_not():
    env = dqn.make_env("SpaceInvadersNoFrameskip-v4", 108_000)()
    env.reset(seed=0)
    stats = next(layer for layer in dqn.wrapper_layers(env) if isinstance(layer, dqn.RecordEpisodeStatistics))
    rng, clipped = np.random.default_rng(0), 0.0
    for _ in range(300):
        _, reward, *_ = env.step(int(rng.integers(6)))
        assert reward in (-1.0, 0.0, 1.0)
        clipped += reward
    assert 0 < clipped < stats.episode_returns  # invaders are worth 5 to 30 points each


def test_v5_id_runs_the_v4_protocol():
    def rollout(env_id: str) -> list[bytes]:
        env = dqn.make_env(env_id, 108_000)()
        obs, _ = env.reset(seed=3)
        out = [obs.tobytes()]
        for action in np.random.default_rng(0).integers(4, size=100):
            obs, reward, terminated, truncated, _ = env.step(int(action))
            out.append(obs.tobytes() + bytes([int(reward), terminated, truncated]))
        return out

    assert rollout("ALE/Breakout-v5") == rollout("BreakoutNoFrameskip-v4")


def test_time_limit_truncates_without_terminating():
    env = dqn.make_env("BreakoutNoFrameskip-v4", 80)()  # 80 emulator frames: truncated before the ball is lost
    env.reset(seed=0)
    for _ in range(30):
        _, _, terminated, truncated, _ = env.step(0)
        if terminated or truncated:
            break
    assert truncated and not terminated


def test_game_ending_mid_skip_returns_the_current_frame_not_a_stale_one():
    """Gymnasium's AtariPreprocessing breaks out of the frame skip before reading the screen, so a truncation after 2
    or 3 of its 4 frames returns the previous step's frame; FreshFinalFrame reads it. Stock one: negative control."""
    def final_frame(wrapper: type, max_frames: int) -> tuple[np.ndarray, np.ndarray, int]:
        env = gym.make("BreakoutNoFrameskip-v4", max_num_frames_per_episode=max_frames, disable_env_checker=True)
        env = wrapper(env, noop_max=30, frame_skip=4, screen_size=84, terminal_on_life_loss=False)
        env.reset(seed=0)
        for i in range(100):
            before = env.unwrapped.ale.getEpisodeFrameNumber()
            obs, _, terminated, truncated, _ = env.step(1 if i % 2 else 2)  # FIRE, RIGHT: ball and paddle move
            if truncated:
                return obs, dqn.screen_84(env), env.unwrapped.ale.getEpisodeFrameNumber() - before
        raise AssertionError("no truncation")

    for max_frames in (100, 101):  # with seed 0's no-ops, these budgets end a step after 2 and 3 of its 4 frames
        fresh, screen, frames_in_step = final_frame(dqn.FreshFinalFrame, max_frames)
        assert frames_in_step < 4
        np.testing.assert_array_equal(fresh, screen)
        stale, screen, _ = final_frame(AtariPreprocessing, max_frames)
        assert not np.array_equal(stale, screen)


def test_env_state_round_trip_reproduces_the_future():
    """Emulator + RNGs + wrapper state restored into a fresh env replay the same steps (the basis of exact resume)."""
    def play(env: gym.Env, actions: np.ndarray) -> list[bytes]:
        out = []
        for action in actions:
            obs, reward, terminated, truncated, _ = env.step(int(action))
            out.append(obs.tobytes() + bytes([int(reward), terminated, truncated]))
            if terminated or truncated:
                out.append(env.reset()[0].tobytes())
        return out

    actions = np.random.default_rng(1).integers(4, size=400)
    env = dqn.make_env("BreakoutNoFrameskip-v4", 108_000)()
    env.reset(seed=5)
    play(env, actions[:50])
    state = dqn.get_env_state(env)
    expected = play(env, actions[50:])
    other = dqn.make_env("BreakoutNoFrameskip-v4", 108_000)()
    other.reset(seed=99)
    dqn.set_env_state(other, state)
    assert play(other, actions[50:]) == expected


# ---------------------------------------------------------------------------------------------------------------------
# Replay buffer
# ---------------------------------------------------------------------------------------------------------------------
def rollout_into_buffer(capacity: int, steps: int = 300, num_envs: int = 2, max_frames: int = 400):
    """Random play in a SameStep vector env, storing into a ReplayBuffer and recording what the env returned.
    The short time limit makes both terminations (lost lives) and truncations happen."""
    envs = gym.vector.SyncVectorEnv([dqn.make_env("BreakoutNoFrameskip-v4", max_frames)] * num_envs,
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    buffer = dqn.ReplayBuffer(capacity, num_envs)
    obs, _ = envs.reset(seed=0)
    buffer.start(obs)
    rng = np.random.default_rng(0)
    recorded = {}  # (env, slot) -> (obs, action, reward, terminated, truncated, next_obs, steps into the episode)
    steps_in = np.zeros(num_envs, dtype=int)
    for _ in range(steps):
        actions = rng.integers(4, size=num_envs)
        slots = (buffer.next_slot - 1) % capacity
        next_obs, rewards, terminated, truncated, infos = envs.step(actions)
        for i in range(num_envs):
            final_obs = infos["final_obs"][i] if terminated[i] or truncated[i] else next_obs[i]
            recorded[(i, int(slots[i]))] = (obs[i], actions[i], rewards[i], terminated[i], truncated[i], final_obs,
                                            steps_in[i])
        steps_in = np.where(terminated | truncated, 0, steps_in + 1)
        buffer.add(actions, rewards, terminated, truncated, next_obs, infos.get("final_obs"))
        obs = next_obs
    return buffer, recorded


def check_against_env(buffer: dqn.ReplayBuffer, recorded: dict) -> int:
    env, slot = np.nonzero(buffer.valid)
    obs, actions, rewards, terminated, next_obs = buffer.transitions(env, slot)
    for k, key in enumerate(zip(env.tolist(), slot.tolist())):
        want = recorded[key]
        np.testing.assert_array_equal(obs[k], want[0])
        np.testing.assert_array_equal(next_obs[k], want[5])
        assert (actions[k], rewards[k], terminated[k]) == (want[1], want[2], float(want[3]))
    return len(env)


def test_buffer_rebuilds_exactly_what_the_env_returned():
    buffer, recorded = rollout_into_buffer(capacity=1000)
    assert check_against_env(buffer, recorded) == len(recorded)  # nothing lost before the ring wraps
    ends = [v for v in recorded.values() if v[3] or v[4]]
    assert any(v[3] for v in ends) and any(v[4] for v in ends)  # both kinds of episode end were exercised
    assert buffer.frames.shape[1] * buffer.frames.shape[2] == 1000 * 84  # one 84x84 frame per slot, not a stack


def test_buffer_after_wrapping_still_matches_and_never_mixes_episodes():
    buffer, recorded = rollout_into_buffer(capacity=50)
    live = check_against_env(buffer, recorded)
    assert live >= 2 * (50 - 8)  # at most one final frame per episode end and three lost slots are skipped
    # the first stacks of an episode repeat its first frame instead of showing the previous episode's last ones
    env, slot = np.nonzero(buffer.valid)
    obs = buffer.transitions(env, slot)[0]
    early = [(k, recorded[key][6]) for k, key in enumerate(zip(env.tolist(), slot.tolist())) if recorded[key][6] < 3]
    assert early
    for k, steps_in in early:
        assert all(np.array_equal(obs[k][j], obs[k][3 - steps_in]) for j in range(3 - steps_in))


def test_truncated_steps_bootstrap_and_terminated_steps_do_not():
    buffer, recorded = rollout_into_buffer(capacity=1000)
    env, slot = buffer.sample_slots(2048, np.random.default_rng(0))  # what the learner would draw
    _, _, _, terminated, next_obs = buffer.transitions(env, slot)
    seen = {"truncated": 0, "terminated": 0}
    for k, key in enumerate(zip(env.tolist(), slot.tolist())):
        _, _, _, was_terminated, was_truncated, final_obs, _ = recorded[key]
        if was_truncated and not was_terminated:
            assert terminated[k] == 0.0
            np.testing.assert_array_equal(next_obs[k], final_obs)  # the real last observation, not the reset one
            seen["truncated"] += 1
        if was_terminated:
            assert terminated[k] == 1.0
            seen["terminated"] += 1
    assert seen["truncated"] > 0 and seen["terminated"] > 0, seen  # both kinds were actually sampled
    rewards, next_q = torch.tensor([1.0, 1.0]), torch.tensor([10.0, 10.0])
    target = dqn.td_target(rewards, torch.tensor([0.0, 1.0]), next_q, gamma=0.9)
    assert target.tolist() == [1.0 + 0.9 * 10.0, 1.0]


def test_sampling_draws_only_stored_transitions_from_every_env_and_is_reproducible():
    buffer, _ = rollout_into_buffer(capacity=50, steps=120)
    env, slot = buffer.sample_slots(4096, np.random.default_rng(7))
    assert buffer.valid[env, slot].all() and set(env.tolist()) == {0, 1}
    assert len(set(zip(env.tolist(), slot.tolist()))) == buffer.valid.sum()  # every stored transition is reachable
    first, again = buffer.sample(256, np.random.default_rng(7)), buffer.sample(256, np.random.default_rng(7))
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert first[0].shape == (256, 4, 84, 84) and first[0].dtype == np.uint8


def test_a_million_transitions_fit_in_8_gb():
    """What a transition costs, measured on 20k of them: resident memory after writing every byte of the buffer
    (np.zeros alone allocates nothing) is its arrays' bytes; a 1M buffer's arrays (reserved, not written: writing
    7 GB took the suite 34 s of page faults) hold 7.07 GB, under 8 GB."""
    def resident() -> int:
        return int([line for line in open("/proc/self/status") if line.startswith("VmRSS")][0].split()[1]) * 1024

    before = resident()
    small = dqn.ReplayBuffer(20_000, 1)
    for array in small.state_dict().values():
        array.fill(1)
    written = sum(array.nbytes for array in small.state_dict().values())
    assert 0.95 * written < resident() - before < 1.1 * written, (resident() - before, written)
    arrays = dqn.ReplayBuffer(1_000_000, 1).state_dict()
    assert all(array.shape[:2] == (1, 1_000_000) for array in arrays.values() if array.ndim >= 2)
    assert 6.5e9 < sum(array.nbytes for array in arrays.values()) < 8e9


# ---------------------------------------------------------------------------------------------------------------------
# The algorithm on hand-built inputs: loss, update, gradient averaging, evaluation, seeds, defaults
# ---------------------------------------------------------------------------------------------------------------------
class TableQ(torch.nn.Module):
    """Q-values looked up by state id (obs[:, 0]): a network whose outputs are known exactly."""

    def __init__(self, table: list[list[float]]) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.tensor(table))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.table[obs[:, 0]]


def test_td_loss_on_hand_built_networks():
    online, target = TableQ([[1.0, 2.0], [4.0, 0.0]]), TableQ([[3.0, 5.0], [7.0, 6.0]])
    obs, next_obs = torch.tensor([[0], [1]]), torch.tensor([[0], [1]])
    batch = [obs, torch.tensor([1, 0]), torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), next_obs]
    loss, q_mean = dqn.td_loss(online, target, batch, gamma=0.9)
    # y0 = 1 + 0.9 * max(3, 5) = 5.5 against Q = 2; y1 = 0 (terminal) against Q = 4: ((2 - 5.5)^2 + 4^2) / 2
    assert loss.item() == pytest.approx(((2 - 5.5) ** 2 + 16) / 2) and q_mean.item() == pytest.approx(3.0)
    loss.backward()
    assert target.table.grad is None  # the target is not trained
    # d loss / d Q(s0, a=1) = (2 - 5.5), d / d Q(s1, a=0) = 4; untaken actions get nothing
    torch.testing.assert_close(online.table.grad, torch.tensor([[0.0, -3.5], [4.0, 0.0]]))


def random_batch(size: int, seed: int = 0) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.integers(0, 256, (size, 4, 84, 84), dtype=np.uint8)),
            torch.from_numpy(rng.integers(0, 4, size)), torch.from_numpy(rng.normal(size=size).astype(np.float32)),
            torch.from_numpy((rng.random(size) < 0.2).astype(np.float32)),
            torch.from_numpy(rng.integers(0, 256, (size, 4, 84, 84), dtype=np.uint8))]


def test_update_overfits_a_fixed_batch():
    """A no-op step, a flipped sign or a detached loss would leave the loss where it is."""
    torch.manual_seed(0)
    q_network, target_network = dqn.QNetwork(4), dqn.QNetwork(4)
    optimizer = torch.optim.Adam(q_network.parameters(), lr=1e-3, fused=True)
    batch = random_batch(8)
    first = dqn.update(q_network, target_network, optimizer, batch, 0.99, world_size=1)["losses/td_loss"].item()
    for _ in range(15):
        last = dqn.update(q_network, target_network, optimizer, batch, 0.99, world_size=1)["losses/td_loss"].item()
    assert last < 0.1 * first, (first, last)


GRADIENT_WORKER = """
import sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import dqn_atari as dqn
from tests.test_dqn_atari import random_batch
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
q_network, target_network = dqn.QNetwork(4), dqn.QNetwork(4)
half = [t[rank * 16:(rank + 1) * 16] for t in random_batch(32)]
loss, _ = dqn.td_loss(q_network, target_network, half, 0.99)
loss.backward()
dqn.average_gradients(list(q_network.parameters()), dist.get_world_size())
if rank == 0:
    torch.save([p.grad for p in q_network.parameters()], sys.argv[2])
dist.destroy_process_group()
"""


def test_two_rank_averaged_gradient_equals_the_one_rank_gradient_on_the_combined_batch(tmp_path: Path):
    (tmp_path / "worker.py").write_text(GRADIENT_WORKER)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(tmp_path / "worker.py"), str(ROOT), str(tmp_path / "grads.pt")], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    averaged = torch.load(tmp_path / "grads.pt")
    torch.manual_seed(0)
    q_network, target_network = dqn.QNetwork(4), dqn.QNetwork(4)
    dqn.td_loss(q_network, target_network, random_batch(32), 0.99)[0].backward()
    for mine, theirs in zip((p.grad for p in q_network.parameters()), averaged):
        # summation order differs, nothing else: measured at most 4e-6 of the tensor's largest element (a missing
        # average would be off by 100%), so elements are judged against 1e-3 of that scale, on any CPU's kernels
        torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-3 * mine.abs().max().item())


class CountingQ(dqn.QNetwork):
    """Always prefers action 2 and counts how many observations it was asked about."""

    def __init__(self) -> None:
        super().__init__(4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += len(x)
        return torch.tensor([[0.0, 0.0, 1.0, 0.0]]).repeat(len(x), 1)


@pytest.mark.parametrize("epsilon", [0.0, 0.3])
def test_evaluation_acts_with_its_epsilon(epsilon: float):
    network = CountingQ()
    args = dqn.Args(eval_episodes=1, eval_epsilon=epsilon, max_episode_frames=2000)
    (_, length), = dqn.evaluate(network, args, torch.device("cpu"), None)
    greedy_share = network.calls / length
    assert abs(greedy_share - (1 - epsilon)) < 0.08, (greedy_share, length)


def test_rank_and_environment_seeds_never_collide():
    seeds = {}
    for seed in (1, 2, 3):
        for rank in (0, 1):
            rng, env_seeds = dqn.rank_streams(seed, rank, 4)
            seeds[(seed, rank)] = (rng.integers(2**62), *env_seeds)
    values = [v for group in seeds.values() for v in group]
    assert len(set(values)) == len(values)  # seed 1 rank 1 is not seed 2 rank 0; seeds share no env seed
    assert dqn.rank_streams(1, 1, 4)[1] == list(seeds[(1, 1)][1:])  # and they are reproducible


def test_defaults_are_the_nature_cleanrl_table():
    defaults = dataclasses.asdict(dqn.Args())
    expected = {"seed": 1, "total_timesteps": 10_000_000, "learning_rate": 1e-4, "buffer_size": 1_000_000,
                "gamma": 0.99, "tau": 1.0, "target_network_frequency": 1000, "batch_size": 32, "start_e": 1.0,
                "end_e": 0.01, "exploration_fraction": 0.10, "learning_starts": 80_000, "train_frequency": 4,
                "num_envs": 1, "max_episode_frames": 108_000, "eval_epsilon": 0.05, "deterministic": True,
                "env_id": "BreakoutNoFrameskip-v4"}
    assert {key: defaults[key] for key in expected} == expected


# ---------------------------------------------------------------------------------------------------------------------
# End to end: python and torchrun, determinism, negative control, save + evaluate, resume
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def python_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_ok(TINY, tmp_path_factory.mktemp("dqn_python"))


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_ok(TINY, tmp_path_factory.mktemp("dqn_torchrun"), nproc=2)


def test_python_run_logs_saves_and_evaluates(python_run: Path):
    keys = set().union(*(json.loads(line) for line in (python_run / "metrics.jsonl").read_text().splitlines()))
    for key in ("charts/episodic_return", "charts/episodic_length", "charts/epsilon", "losses/td_loss",
                "losses/q_values", "eval/episodic_return"):
        assert key in keys, key
    assert "charts/SPS" in (python_run / "perf.jsonl").read_text()  # wall-clock measures live apart
    record = final(python_run)
    assert record["global_step"] == 1200 and record["ranks_agree"] and len(record["eval_returns"]) == 1
    evals = [json.loads(line) for line in (python_run / "metrics.jsonl").read_text().splitlines()
             if "eval/episodic_return" in line]
    assert [r["step"] for r in evals] == [1200]  # logged at the final step, so a resume's cut-back keeps them right
    state = torch.load(python_run / "dqn_atari.cleanrl_model", weights_only=True)
    assert dqn.parameter_hash(state) == record["parameter_sha256"]
    assert (python_run / "checkpoints" / "latest").read_text().strip() == "step_00001200"
    assert list(python_run.glob("events.out.tfevents.*")) and (python_run / "manifest.json").is_file()


def test_update_counts_follow_the_schedule(python_run: Path):
    """One update per 4 global steps after learning starts: steps 404, 408, ..., 1200 = 200 updates; target copies at
    600, 800, 1000, 1200. The last one happens at the final step, so the target equals the online network."""
    record = final(python_run)
    assert (record["updates"], record["target_updates"]) == (200, 4)
    assert record["target_sha256"] == record["parameter_sha256"]


def test_python_runs_are_bitwise_reproducible(python_run: Path, tmp_path: Path):
    again = run_ok(TINY, tmp_path)
    assert metric_lines(again) == metric_lines(python_run)
    assert final(again)["parameter_sha256"] == final(python_run)["parameter_sha256"]


def test_a_different_seed_gives_a_different_run(python_run: Path, tmp_path: Path):
    other = run_ok([*TINY, "--seed", "2"], tmp_path)
    assert final(other)["parameter_sha256"] != final(python_run)["parameter_sha256"]
    assert metric_lines(other) != metric_lines(python_run)


def resume_in_copy(run_dir: Path, tmp_path: Path, extra: list[str], nproc: int = 0) -> Path:
    """Resume a copy of `run_dir` from its step-600 checkpoint; the resumed run must continue in that copy."""
    copy = tmp_path / run_dir.name
    shutil.copytree(run_dir, copy)
    (tmp_path / "root").mkdir()
    result = run([*extra, "--resume", str(copy / "checkpoints" / "step_00000600")], tmp_path / "root", nproc)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert not any((tmp_path / "root").iterdir())  # no new run directory
    assert json.loads((copy / "manifest.json").read_text())["resumed"][0]["from_step"] == 600
    return copy


def test_resume_continues_in_the_run_directory_and_equals_the_uninterrupted_run(python_run: Path, tmp_path: Path):
    resumed = resume_in_copy(python_run, tmp_path, TINY)
    assert metric_lines(resumed) == metric_lines(python_run)  # cut back to step 600, then the same records again
    assert final(resumed)["parameter_sha256"] == final(python_run)["parameter_sha256"]
    assert final(resumed)["target_sha256"] == final(python_run)["target_sha256"]
    assert (final(resumed)["updates"], final(resumed)["target_updates"]) == (200, 4)


def test_resume_refuses_changed_arguments_and_lists_them_all(python_run: Path, tmp_path: Path):
    checkpoint = str(python_run / "checkpoints" / "step_00000600")
    result = run([*TINY, "--learning-rate", "0.001", "--gamma", "0.9", "--end-e", "0.1", "--resume", checkpoint],
                 tmp_path / "a")
    assert result.returncode == 2, result.stderr[-2000:]
    for line in ("--learning-rate: checkpoint 0.0001, now 0.001", "--gamma: checkpoint 0.99, now 0.9", "--end-e"):
        assert line in result.stderr
    result = run([*TINY, "--total-timesteps", "500", "--resume", checkpoint], tmp_path / "b")
    assert result.returncode == 2 and "--total-timesteps" in result.stderr  # shrinking below the checkpoint


def test_world_size_one_under_torchrun_equals_plain_python(python_run: Path, tmp_path: Path):
    single = run_ok(TINY, tmp_path, nproc=1)
    assert metric_lines(single) == metric_lines(python_run)
    assert final(single)["parameter_sha256"] == final(python_run)["parameter_sha256"]


def test_torchrun_two_ranks_agree_and_are_reproducible(torchrun_run: Path, tmp_path: Path):
    assert final(torchrun_run)["ranks_agree"]
    # 2 global steps per iteration: updates at 404, ..., 1200 (200) and target copies at 600, ..., 1200 (4)
    assert (final(torchrun_run)["updates"], final(torchrun_run)["target_updates"]) == (200, 4)
    files = {p.name for p in (torchrun_run / "checkpoints" / "step_00000600").iterdir()}
    assert {"trainer_state.pt", "rank0.pt", "rank1.pt", "rank0_buffer_frames.npy", "rank1_buffer_frames.npy"} <= files
    again = run_ok(TINY, tmp_path, nproc=2)
    assert metric_lines(again) == metric_lines(torchrun_run)
    assert final(again)["parameter_sha256"] == final(torchrun_run)["parameter_sha256"]


def test_torchrun_preempted_at_a_random_moment_then_killed_mid_save_resumes_exactly(torchrun_run: Path,
                                                                                     tmp_path: Path):
    """SIGTERM to the launcher at a random moment: every rank stops at the same LOG_EVERY boundary with one
    checkpoint and the line that resumes it. That resume is then killed (SIGKILL to its launcher) in the middle of
    its next save (rank 0 sleeps before publishing it, tests/workers/slow_rank.py): `latest` still names the
    preemption's checkpoint, which resumes to the uninterrupted run's metrics and weights."""
    # not at the top: the gradient worker imports this module outside pytest
    from conftest import only_run_dir, preempt_at_random, read_metrics, resume_line, run_resume_line, script_env

    sps = statistics.median(p["charts/SPS"] for p in read_metrics(torchrun_run, "perf.jsonl") if "charts/SPS" in p)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "--shutdown-timeout", "120", "dqn_atari.py", *TINY, "--run-root", str(tmp_path / "runs")]
    status, text, delay = preempt_at_random(command, tmp_path / "output.txt", "step 100/1200", 500 / sps)
    context = f"SIGTERM {delay:.2f} s after the first progress line\n{text[-4000:]}"
    run_dir = only_run_dir(tmp_path / "runs")
    stopped = json.loads((run_dir / "stopped.json").read_text())
    assert status != 0 and stopped["exit_status"] == 3 and stopped["signal"] == "SIGTERM", context
    assert stopped["step"] % dqn.LOG_EVERY == 0 and stopped["step"] < 1200, context
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == Path(stopped["checkpoint"]).name, context

    resume = resume_line(text)
    script = resume.index("dqn_atari.py")
    slow = [*resume[:script], "tests/workers/slow_rank.py", *resume[script:]]
    with open(tmp_path / "killed.txt", "w") as sink:
        launcher = subprocess.Popen(slow, cwd=ROOT, env={**script_env(), "SLOW_RANK": "0", "SLOW_SAVE_S": "120"},
                                    stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not list(checkpoints.glob(".step_*.tmp")) and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = psutil.Process(launcher.pid).children(recursive=True)
        launcher.send_signal(signal.SIGKILL)  # the workers die with it (PR_SET_PDEATHSIG)
        launcher.wait()
        psutil.wait_procs(workers, timeout=30)
    finally:
        launcher.kill()
    partial = list(checkpoints.glob(".step_*.tmp"))
    assert len(partial) == 1, (tmp_path / "killed.txt").read_text()[-4000:]
    assert (checkpoints / "latest").read_text().strip() == Path(stopped["checkpoint"]).name
    resumed = run_resume_line(text)  # the printed line again, by the warm launcher
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert metric_lines(run_dir) == metric_lines(torchrun_run), context
    assert final(run_dir)["parameter_sha256"] == final(torchrun_run)["parameter_sha256"]
    assert not list(checkpoints.glob(".step_*.tmp")) and not (run_dir / "stopped.json").exists()


def test_a_configured_stop_signal_ends_a_python_run_with_status_3(tmp_path: Path):
    """--stop-signals SIGUSR2 under plain python: the run's own exit status is 3, after one checkpoint at a
    LOG_EVERY boundary, with the resume line and stopped.json."""
    from conftest import only_run_dir, preempt_at_random

    command = [sys.executable, "dqn_atari.py", *TINY, "--stop-signals", "SIGUSR2", "--run-root", str(tmp_path)]
    status, text, delay = preempt_at_random(command, tmp_path / "output.txt", "step 100/1200", 1.0,
                                            stop_signal=signal.SIGUSR2)
    run_dir = only_run_dir(tmp_path)
    stopped = json.loads((run_dir / "stopped.json").read_text())
    assert status == 3 and stopped["signal"] == "SIGUSR2", text[-4000:]
    assert f"preempted by SIGUSR2 after step {stopped['step']}, checkpoint written; resume with: python dqn_atari.py" \
        in text and stopped["resume_command"].endswith(f"--resume {stopped['checkpoint']}")
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == Path(stopped["checkpoint"]).name


def test_three_envs_per_rank_update_as_the_schedule_implies(tmp_path: Path):
    run_dir = run_ok([*TINY, "--num-envs", "3", "--total-timesteps", "900", "--save-every", "0"], tmp_path)
    # 3 steps per iteration: the first past 400 is 402, so updates count multiples of 4 in (399, 900]: 225 - 99
    assert (final(run_dir)["global_step"], final(run_dir)["updates"], final(run_dir)["target_updates"]) == (900, 126, 3)
    assert any("charts/episodic_return" in line for line in metric_lines(run_dir))


def test_resume_with_two_envs_equals_the_uninterrupted_run(tmp_path: Path):
    two_envs = [*TINY, "--num-envs", "2"]
    full = run_ok(two_envs, tmp_path / "full")
    resumed = resume_in_copy(full, tmp_path / "resumed", two_envs)
    assert metric_lines(resumed) == metric_lines(full)
    assert final(resumed)["parameter_sha256"] == final(full)["parameter_sha256"]


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: a clear message, exit code 2, no run directory
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--env-id", "NoSuchGameNoFrameskip-v4"], "unknown env id"),
    (["--env-id", "CartPole-v1"], "unknown env id"),
    (["--buffer-size", "16", "--batch-size", "32"], "smaller than --batch-size"),
    (["--total-timesteps", "0"], "must be positive"),
    (["--num-envs", "0"], "must be positive"),
    (["--learning-starts", "2000", "--total-timesteps", "1000"], "must be below --total-timesteps"),
    (["--resume", "/nonexistent/checkpoint"], "no complete checkpoint"),
    (["--stop-signals", "SIGTERM", "SIGKILL"], "'SIGKILL' is not a signal a process can catch"),
])
def test_bad_input_fails_clearly(args: list[str], message: str, tmp_path: Path):
    result = run(args, tmp_path)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-3000:]
    assert not any(tmp_path.iterdir())


def test_bad_input_under_torchrun_stops_every_rank(tmp_path: Path):
    """Each rank checks its arguments before any collective and exits 2 with the message; torchrun then ends the
    other rank, which may not have printed yet (so the message shows once or twice), and nothing hangs."""
    result = run(["--buffer-size", "16", "--batch-size", "32"], tmp_path, nproc=2)
    assert result.returncode != 0 and 1 <= result.stderr.count("smaller than --batch-size") <= 2
    assert "exitcode  : 2" in result.stderr  # the first rank to fail did so by the check, not by a signal
    assert not any(tmp_path.iterdir())


def test_capture_video_without_moviepy_says_what_to_install(tmp_path: Path):
    if importlib.util.find_spec("moviepy") is not None:
        pytest.skip("moviepy is installed")
    result = run(["--capture-video"], tmp_path)
    assert result.returncode == 2 and "pip install moviepy" in result.stderr


def test_checkpoint_from_another_env_world_or_script_is_refused(python_run: Path, tmp_path: Path):
    checkpoint = python_run / "checkpoints" / "step_00000600"
    result = run([*TINY, "--env-id", "PongNoFrameskip-v4", "--resume", str(checkpoint)], tmp_path / "a")
    assert result.returncode == 2 and "--env-id: checkpoint 'BreakoutNoFrameskip-v4'" in result.stderr
    result = run([*TINY, "--resume", str(checkpoint)], tmp_path / "b", nproc=2)
    assert result.returncode != 0 and "world size: checkpoint 1, now 2" in result.stderr
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    torch.save({"model": {}}, foreign / "trainer_state.pt")  # e.g. another script's checkpoint
    result = run([*TINY, "--resume", str(foreign)], tmp_path / "c")
    assert result.returncode == 2 and "not a dqn_atari checkpoint" in result.stderr


def test_benchmark_table_reads_runs_and_draws_curves(python_run: Path, tmp_path: Path):
    pytest.importorskip("matplotlib")
    shutil.copytree(python_run, tmp_path / "runs" / "complete")
    shutil.copytree(python_run, tmp_path / "runs" / "died")
    died = tmp_path / "runs" / "died"  # killed at step 600: no final.json, metrics up to 600; never scored
    (died / "final.json").unlink()
    lines = (died / "metrics.jsonl").read_text().splitlines(keepends=True)
    (died / "metrics.jsonl").write_text("".join(line for line in lines if json.loads(line)["step"] <= 600))
    result = subprocess.run([sys.executable, "benchmarks/dqn_table.py", str(tmp_path / "runs"), "--out",
                             str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "| Breakout | 1 | 1200 |" in result.stdout and "not yet run by us" in result.stdout  # Pong, BeamRider
    assert "died: incomplete (reached step 600 of 1200)" in result.stdout
    assert (tmp_path / "dqn_Breakout.png").stat().st_size > 0 and (tmp_path / "table.md").is_file()


def test_learning_summary_is_over_seeds_and_refuses_runs_that_differ_in_more(python_run: Path, tmp_path: Path):
    pytest.importorskip("matplotlib")
    seeds = []
    for seed in (1, 2, 3):  # copies of one run, labelled as seeds 1-3; seed 3 died before its end
        run = tmp_path / f"seed_{seed}"
        shutil.copytree(python_run, run)
        manifest = json.loads((run / "manifest.json").read_text())
        manifest["args"]["seed"] = seed
        (run / "manifest.json").write_text(json.dumps(manifest))
        seeds.append(run)
    (seeds[2] / "final.json").unlink()
    command = [sys.executable, "benchmarks/dqn_learning.py", "--random-games", "2", "--last", "3", "--out",
               str(tmp_path / "out")]
    result = subprocess.run([*command, *map(str, seeds)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    games = [json.loads(line)["charts/episodic_return"] for line in (python_run / "metrics.jsonl").read_text()
             .splitlines() if "charts/episodic_return" in line]
    assert [s["seed"] for s in summary["seeds"]] == [1, 2, 3] and summary["complete_seeds"] == 2
    assert summary["over_seeds"] == {"mean": pytest.approx(np.mean(games[-3:])), "std": 0.0}
    assert summary["random_games"] == 2
    assert "| 3 | 1,200 (incomplete) |" in result.stdout and "over 2 complete seeds" in result.stdout
    assert (tmp_path / "out" / "breakout_curve.png").stat().st_size > 0

    manifest = json.loads((seeds[1] / "manifest.json").read_text())
    manifest["args"]["learning_rate"] *= 2
    (seeds[1] / "manifest.json").write_text(json.dumps(manifest))
    result = subprocess.run([*command, *map(str, seeds)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "differs from" in result.stderr and "learning_rate" in result.stderr
