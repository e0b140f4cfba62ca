"""dqn_atari.py: wrappers on a real ALE game, the frame-sharing replay buffer, and end-to-end runs as subprocesses
(python and torchrun with 2 ranks): determinism, a negative control, save + evaluate, exact resume, bad input."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

import dqn_atari as dqn
from common.tracking import strip_wall_clock

ROOT = Path(__file__).resolve().parent.parent
# A few hundred updates on a tiny buffer: every phase runs (collection, learning, target copies, a checkpoint
# halfway, logging, save + one evaluation game) in about 20 s on 2 CPU cores.
TINY = ["--total-timesteps", "1200", "--learning-starts", "400", "--buffer-size", "600", "--batch-size", "8",
        "--target-network-frequency", "200", "--checkpoint-frequency", "600", "--save-model", "--eval-episodes", "1"]


def run(args: list[str], run_root: Path, nproc: int = 0) -> subprocess.CompletedProcess:
    """`python dqn_atari.py` (nproc=0) or `torchrun --nproc_per_node nproc dqn_atari.py`, one thread per process."""
    launcher = [sys.executable]
    if nproc:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # as torchrun sets it, for both launchers
    return subprocess.run([*launcher, "dqn_atari.py", *args, "--run-root", str(run_root)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def run_ok(args: list[str], run_root: Path, nproc: int = 0) -> Path:
    result = run(args, run_root, nproc)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    runs = [p for p in run_root.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def metric_lines(run_dir: Path) -> list[str]:
    """metrics.jsonl without wall-clock fields, as the exact bytes each record serialises to."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [json.dumps(strip_wall_clock(r), sort_keys=True) for r in records]


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
    env, slot = np.nonzero(buffer.valid)
    _, _, _, terminated, next_obs = buffer.transitions(env, slot)
    for k, key in enumerate(zip(env.tolist(), slot.tolist())):
        _, _, _, was_terminated, was_truncated, final_obs, _ = recorded[key]
        if was_truncated and not was_terminated:
            assert terminated[k] == 0.0
            np.testing.assert_array_equal(next_obs[k], final_obs)  # the real last observation, not the reset one
        if was_terminated:
            assert terminated[k] == 1.0
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
    buffer = dqn.ReplayBuffer(1_000_000, 1)  # np.zeros: nothing is touched, so this allocates no RAM
    total = sum(array.nbytes for array in buffer.state_dict().values())
    assert total < 8e9, total


def test_to_device_packs_one_block_and_unpacks_exactly():
    arrays = (np.arange(6, dtype=np.uint8).reshape(2, 3), np.array([3, 1], dtype=np.int64),
              np.array([0.5, -1.0], dtype=np.float32))
    out = dqn.to_device(arrays, torch.device("cpu"))
    for a, t in zip(arrays, out):
        np.testing.assert_array_equal(t.numpy(), a)
        assert t.shape == a.shape


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
    for key in ("charts/episodic_return", "charts/episodic_length", "charts/SPS", "charts/epsilon",
                "losses/td_loss", "losses/q_values", "eval/episodic_return"):
        assert key in keys, key
    record = final(python_run)
    assert record["global_step"] == 1200 and record["ranks_agree"] and len(record["eval_returns"]) == 1
    state = torch.load(python_run / "dqn_atari.cleanrl_model", weights_only=True)
    assert dqn.parameter_hash(state) == record["parameter_sha256"]
    assert (python_run / "checkpoints" / "latest").read_text().strip() == "step_00001200"
    assert list(python_run.glob("events.out.tfevents.*")) and (python_run / "manifest.json").is_file()


def test_python_runs_are_bitwise_reproducible(python_run: Path, tmp_path: Path):
    again = run_ok(TINY, tmp_path)
    assert metric_lines(again) == metric_lines(python_run)
    assert final(again)["parameter_sha256"] == final(python_run)["parameter_sha256"]


def test_a_different_seed_gives_a_different_run(python_run: Path, tmp_path: Path):
    other = run_ok([*TINY, "--seed", "2"], tmp_path)
    assert final(other)["parameter_sha256"] != final(python_run)["parameter_sha256"]
    assert metric_lines(other) != metric_lines(python_run)


def test_resume_equals_the_uninterrupted_run(python_run: Path, tmp_path: Path):
    resumed = run_ok([*TINY, "--resume", str(python_run / "checkpoints" / "step_00000600")], tmp_path)
    tail = metric_lines(resumed)
    assert tail and metric_lines(python_run)[-len(tail):] == tail
    assert all(json.loads(line)["step"] <= 600 for line in metric_lines(python_run)[: -len(tail)])
    assert final(resumed)["parameter_sha256"] == final(python_run)["parameter_sha256"]
    assert final(resumed)["target_sha256"] == final(python_run)["target_sha256"]


def test_world_size_one_under_torchrun_equals_plain_python(python_run: Path, tmp_path: Path):
    single = run_ok(TINY, tmp_path, nproc=1)
    assert metric_lines(single) == metric_lines(python_run)
    assert final(single)["parameter_sha256"] == final(python_run)["parameter_sha256"]


def test_torchrun_two_ranks_agree_and_are_reproducible(torchrun_run: Path, tmp_path: Path):
    assert final(torchrun_run)["ranks_agree"]
    files = {p.name for p in (torchrun_run / "checkpoints" / "step_00000600").iterdir()}
    assert {"trainer_state.pt", "rank0.pt", "rank1.pt", "rank0_buffer_frames.npy", "rank1_buffer_frames.npy"} <= files
    again = run_ok(TINY, tmp_path, nproc=2)
    assert metric_lines(again) == metric_lines(torchrun_run)
    assert final(again)["parameter_sha256"] == final(torchrun_run)["parameter_sha256"]


def test_torchrun_resume_equals_the_uninterrupted_run(torchrun_run: Path, tmp_path: Path):
    resumed = run_ok([*TINY, "--resume", str(torchrun_run / "checkpoints" / "step_00000600")], tmp_path, nproc=2)
    tail = metric_lines(resumed)
    assert tail and metric_lines(torchrun_run)[-len(tail):] == tail
    assert final(resumed)["parameter_sha256"] == final(torchrun_run)["parameter_sha256"]


def test_several_envs_per_rank_run(tmp_path: Path):
    run_dir = run_ok([*TINY, "--num-envs", "3", "--total-timesteps", "900", "--checkpoint-frequency", "0"], tmp_path)
    assert final(run_dir)["global_step"] == 900
    assert any("charts/episodic_return" in line for line in metric_lines(run_dir))


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
])
def test_bad_input_fails_clearly(args: list[str], message: str, tmp_path: Path):
    result = run(args, tmp_path)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-3000:]
    assert not any(tmp_path.iterdir())


def test_bad_input_under_torchrun_stops_every_rank(tmp_path: Path):
    result = run(["--buffer-size", "16", "--batch-size", "32"], tmp_path, nproc=2)
    assert result.returncode != 0 and result.stderr.count("smaller than --batch-size") == 2


def test_capture_video_without_moviepy_says_what_to_install(tmp_path: Path):
    if importlib.util.find_spec("moviepy") is not None:
        pytest.skip("moviepy is installed")
    result = run(["--capture-video"], tmp_path)
    assert result.returncode == 2 and "pip install moviepy" in result.stderr


def test_checkpoint_from_another_env_or_network_is_refused(python_run: Path, tmp_path: Path):
    checkpoint = python_run / "checkpoints" / "step_00000600"
    result = run([*TINY, "--env-id", "PongNoFrameskip-v4", "--resume", str(checkpoint)], tmp_path / "a")
    assert result.returncode == 2 and "env_id='BreakoutNoFrameskip-v4'" in result.stderr, result.stderr[-2000:]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    trainer = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
    trainer["q_network"] = {"network.0.weight": torch.zeros(16, 4, 8, 8)}
    torch.save(trainer, foreign / "trainer_state.pt")
    result = run([*TINY, "--resume", str(foreign)], tmp_path / "b")
    assert result.returncode == 2 and "different network" in result.stderr, result.stderr[-2000:]
    torch.save({"model": {}}, foreign / "trainer_state.pt")  # e.g. another script's checkpoint
    result = run([*TINY, "--resume", str(foreign)], tmp_path / "c")
    assert result.returncode == 2 and "not a dqn_atari checkpoint" in result.stderr


def test_benchmark_table_reads_runs_and_draws_curves(python_run: Path, tmp_path: Path):
    pytest.importorskip("matplotlib")
    result = subprocess.run([sys.executable, "benchmarks/dqn_table.py", str(python_run.parent), "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "| Breakout | 1 | 1200 |" in result.stdout and "not yet run by us" in result.stdout  # Pong, BeamRider
    assert (tmp_path / "dqn_Breakout.png").stat().st_size > 0 and (tmp_path / "table.md").is_file()
