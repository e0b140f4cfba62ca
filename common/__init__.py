"""What every script shares, DQN and the LLM scripts alike: determinism, the process group, the run directory and its
logs, checkpoints, preemption. The LLM scripts' own plumbing is `common.llm`; the tasks are the top-level package
`tasks`."""
