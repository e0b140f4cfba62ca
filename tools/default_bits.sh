#!/bin/bash
# The default-path runs a change must keep bit for bit, 2 ranks each (4 steps, evaluation and checkpoints on):
#     tools/default_bits.sh CHECKOUT OUTDIR
# prints one line per run: name, final parameter sha256[:16], metrics.jsonl sha256[:16]. Run it in the checkout
# before a change and after it (a worktree of the old commit with this .venv), and compare the two outputs.
set -u
cd "$1" || exit 2
OUT=$2
mkdir -p "$OUT"
S="--prompts-per-step 16 --num-generations 4 --micro-batch-size 16 --num-eval-prompts 32 --eval-every 2
   --total-steps 4 --save-every 2 --keep-last 0 --seed 1"
run() {
    name=$1
    shift
    rm -rf "${OUT:?}/$name"
    OMP_NUM_THREADS=1 TORCH_CPP_LOG_LEVEL=ERROR HF_HUB_OFFLINE=1 .venv/bin/torchrun --nproc_per_node 2 "$@" \
        --run-root "$OUT/$name" > "$OUT/$name.log" 2>&1
    run_dir=$(ls -d "$OUT/$name"/*/)
    echo "$name $(.venv/bin/python -c "import json, sys; print(json.load(open(sys.argv[1]))['parameter_sha256'][:16])" \
        "$run_dir/final.json") $(sha256sum "$run_dir/metrics.jsonl" | cut -c1-16)"
}
# shellcheck disable=SC2086
{
run grpo grpo_llm.py $S
run dpo dpo_online.py $S
run ppo ppo_llm.py $S
run split grpo_llm.py $S --rollout-ranks 1 --max-staleness 1
run calc grpo_llm.py $S --task calculator_tiny --model-name-or-path assets/tiny-calculator --max-completion-length 20
run turns grpo_llm.py $S --task tests/second_look_task.py:SecondLookTask --max-completion-length 16
run balance grpo_llm.py $S --balance-tokens
}
