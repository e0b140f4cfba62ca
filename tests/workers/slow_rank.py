"""Run an LLM script with one rank made slow on purpose, for the split layout's test that timing never changes the
bits: `python tests/workers/slow_rank.py SCRIPT ARGS...` under torchrun, with SLOW_RANK (a global rank), SLOW_GENERATE_S
(a sleep before each generation on that rank), SLOW_UPDATE_S (a sleep before each optimizer step on that rank) and
SLOW_SAVE_S (a sleep after that rank wrote its part of each checkpoint, before the checkpoint is published: a kill then
lands mid-save). Any script, DQN's too."""

import os
import runpy
import sys
import time

import common.checkpoint
import common.llm.engines
import common.llm.models

if int(os.environ["RANK"]) == int(os.environ["SLOW_RANK"]):
    generate_s, update_s = float(os.environ.get("SLOW_GENERATE_S", 0)), float(os.environ.get("SLOW_UPDATE_S", 0))
    for engine in (common.llm.engines.VLLMEngine, common.llm.engines.HFEngine, common.llm.engines.FakeEngine):
        def slow_generate(self, *args, _generate=engine.generate, **kwargs):
            time.sleep(generate_s)
            return _generate(self, *args, **kwargs)
        engine.generate = slow_generate
    fast_step = common.llm.models.optimizer_step

    def slow_step(*args, **kwargs):
        time.sleep(update_s)
        return fast_step(*args, **kwargs)
    common.llm.models.optimizer_step = slow_step  # before the script imports it by name
    save_s, fast_save = float(os.environ.get("SLOW_SAVE_S", 0)), common.checkpoint.save_checkpoint

    def slow_save(root, step, write, *args, **kwargs):
        def slow_write(directory):
            write(directory)
            time.sleep(save_s)
        return fast_save(root, step, slow_write, *args, **kwargs)
    common.checkpoint.save_checkpoint = slow_save

sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
