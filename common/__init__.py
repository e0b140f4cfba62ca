"""What all four scripts share: determinism, the process group, the run directory and its logs, checkpoints,
preemption. The LLM scripts' own plumbing is `common.llm`; the tasks are the top-level package `tasks`."""
