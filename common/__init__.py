"""Infrastructure shared by the single-file scripts: determinism, distributed setup, run tracking,
checkpoints, rollout engines and tasks. The algorithms themselves live in the top-level scripts."""
