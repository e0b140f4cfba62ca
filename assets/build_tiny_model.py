"""Build the embedded models: a character-level tokenizer and a tiny Qwen2 trained by SFT on a task's training set
until it is only partly right on the held-out test set, so RL has room to improve it. `assets/tiny-adder/` (the
default model, `AdditionTask`), `assets/tiny-countdown/` (`TinyCountdownTask`, `--task countdown_tiny`) and
`assets/tiny-calculator/` (`TinyCalculatorTask`, `--task calculator_tiny`: a mixture of whole tool episodes, call,
the calculator's reply and the answer, and direct answers; it learns to copy the tool's result but not to multiply,
so RL can teach it to call; held-out numbers of its greedy episodes and of its tool use are in build_info.json).

Deterministic: a fixed seed, deterministic kernels and a fixed thread count rebuild the same `model.safetensors`,
bit for bit, on the same machine and software. Run from the repository root:

    python -m assets.build_tiny_model
    python -m assets.build_tiny_model --task countdown_tiny --output-dir assets/tiny-countdown --steps 750
    python -m assets.build_tiny_model --task calculator_tiny --output-dir assets/tiny-calculator --steps 600 \
        --tool-fraction 0.3

calculator_tiny's steps and fraction, read off one run with --eval-during-training (the learning rate is constant
after warmup, so a run's step N is the build with --steps N): at --tool-fraction 0.3 the sampled (temperature 1)
tool-call probability stays at 0.25-0.33 from step 200 on, a forced call is answered right 98-100% of the time from
step 200, and direct answers are right 0.6% at step 200, 3.6% at 600, 8.6% at 1000 (the model starts to multiply,
then memorise). 600 steps: greedy episodes mostly answer directly (6.6% call), and the tool is worth 90 points.
"""

import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro
from tokenizers import Tokenizer, decoders, models
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from tasks import TASKS, Example, Task

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
# each task's alphabet; calculator_tiny's `?` is the reply of a call that gives no number (`=?;`, never trained on)
CHARACTERS = {"addition": "0123456789+=", "countdown_tiny": "0123456789+-*/(),>:",
              "calculator_tiny": "0123456789*[]=;:?"}


@dataclass
class Args:
    task: Literal["addition", "countdown_tiny", "calculator_tiny"] = "addition"
    """the task whose training set the model learns (and whose characters are its vocabulary)"""
    output_dir: str = "assets/tiny-adder"
    """where the model, tokenizer and build_info.json go"""
    seed: int = 1
    """seed of the weight init and of the training batches"""
    # 650 steps gave 43.4% while 46 test prompts' commutative twins were trained on. Without them: 650 -> 33.8%,
    # 700 -> 42.4%, 750 -> 50.0%. 750 is chosen because its sampled (temperature 1) reward at GRPO's start, about 0.28,
    # matches the old model's (0.29), while 700 starts at 0.19 and did not learn in 20 GRPO steps (42.4% -> 40.8%).
    steps: int = 750
    """SFT optimizer steps; 750 lands held-out greedy accuracy at about 50%, mid-way up a steep learning curve"""
    batch_size: int = 128
    """sequences per step"""
    learning_rate: float = 1e-3
    """AdamW learning rate (constant after a linear warmup)"""
    warmup_steps: int = 100
    """linear warmup steps"""
    weight_decay: float = 0.01
    """AdamW weight decay"""
    num_threads: int = 1
    """torch CPU threads; part of what makes the build bitwise reproducible (1 also copes best with busy cores)"""
    log_every: int = 250
    """steps between loss (and held-out accuracy) prints"""
    eval_during_training: bool = False
    """also print held-out greedy accuracy every `log_every` steps (to choose `steps`)"""
    tool_fraction: float = 0.3
    """calculator_tiny only: the share of SFT sequences that are whole tool episodes (the rest answer directly)"""


def build_tokenizer(characters: str = CHARACTERS["addition"]) -> PreTrainedTokenizerFast:
    """One token per character: a BPE model with no merges, so every known character is its own token."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + list(characters))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.decoder = decoders.Fuse()  # join the characters back without spaces
    # AutoTokenizer reloads any qwen2 model's tokenizer as Qwen2Tokenizer, which appends an "<|endoftext|>" unk token
    # (one id past the model's vocab) unless the tokenizer names its own unk token: hence "<unk>", otherwise unused.
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", padding_side="left"
    )


def build_model(tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,  # vLLM's CPU attention kernel rejects small head dims such as 16
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    return Qwen2ForCausalLM(config)


def make_batch(examples: list[Example], tokenizer: PreTrainedTokenizerFast) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `prompt + answer + <eos>` ids, and labels that are -100 except on the completion tokens."""
    rows, labels = [], []
    for example in examples:
        prompt = tokenizer.encode(example.prompt)
        completion = tokenizer.encode(example.answer) + [tokenizer.eos_token_id]
        rows.append(prompt + completion)
        labels.append([-100] * len(prompt) + completion)
    width = max(len(row) for row in rows)
    input_ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows])
    label_ids = torch.tensor([label + [-100] * (width - len(label)) for label in labels])
    return input_ids, label_ids


def make_tool_batch(examples: list[Example], use_tool: list[bool], tokenizer: PreTrainedTokenizerFast,
                    task: Task) -> tuple[torch.Tensor, torch.Tensor]:
    """`make_batch` for a tool task: where `use_tool`, the whole episode `prompt [a*b]<eos> =P; P<eos>` (the reply
    is the environment's, from its own step, with labels -100: the model never learns to write it), else the direct
    answer `prompt P<eos>`. Labels on the model's turns only."""
    rows, labels = [], []
    for example, tool in zip(examples, use_tool):
        prompt = tokenizer.encode(example.prompt)
        answer = tokenizer.encode(example.answer) + [tokenizer.eos_token_id]
        row, label = prompt, [-100] * len(prompt)
        if tool:
            call_text = f"[{example.data['a']}*{example.data['b']}]"
            environment = task.environment()
            environment.reset(example)
            reply = tokenizer.encode(environment.step(call_text)[0])
            call = tokenizer.encode(call_text) + [tokenizer.eos_token_id]
            row, label = row + call + reply, label + call + [-100] * len(reply)
        rows.append(row + answer)
        labels.append(label + answer)
    width = max(len(row) for row in rows)
    input_ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows])
    label_ids = torch.tensor([label + [-100] * (width - len(label)) for label in labels])
    return input_ids, label_ids


@torch.no_grad()
def greedy_turns(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, contexts: list[list[int]],
                 limits: list[int], first: Literal["free", "call", "direct"] = "free") -> list[list[int]]:
    """One greedy model turn after each context, at most its limit's tokens, up to and with the EOS. `first`
    forces the turn's first token: `call` the call's `[`, `direct` the most likely token other than `[`.
    Contexts are batched by length and limit, so no padding is involved."""
    bracket = tokenizer.convert_tokens_to_ids("[")
    groups: dict[tuple[int, int], list[int]] = {}
    for index, (context, limit) in enumerate(zip(contexts, limits)):
        groups.setdefault((len(context), limit), []).append(index)
    turns: list[list[int]] = [[] for _ in contexts]
    for (_, limit), indices in groups.items():
        input_ids = torch.tensor([contexts[i] for i in indices])
        if first != "free":
            logits = model(input_ids=input_ids).logits[:, -1]
            logits[:, bracket] = float("inf") if first == "call" else float("-inf")
            input_ids = torch.cat([input_ids, logits.argmax(-1, keepdim=True)], dim=1)
        if limit > input_ids.shape[1] - len(contexts[indices[0]]):
            input_ids = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                       max_new_tokens=limit - (input_ids.shape[1] - len(contexts[indices[0]])))
        for i, row in zip(indices, input_ids[:, len(contexts[indices[0]]):].tolist()):
            ends = [k for k, token in enumerate(row) if token == tokenizer.eos_token_id]
            turns[i] = row[:ends[0] + 1] if ends else row
    return turns


@torch.no_grad()
def episode_metrics(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, examples: list[Example],
                    task: Task, budget: int = 24, first: Literal["free", "call", "direct"] = "free"
                    ) -> dict[str, float]:
    """Greedy two-turn episodes, played as common/llm/episodes.py plays them (`budget`: the run's
    --max-completion-length, the tokens of both turns and the reply together; --max-turns 2): turn 1 and the
    environment's step on its text; if it called the tool, the reply (when it leaves room for another token) and
    turn 2. Correct as the environment says; a second call, or a turn cut by the budget before its EOS after a
    call, ends the episode unsolved. Returns the accuracy and the share of episodes whose first turn calls the tool."""
    eos = tokenizer.eos_token_id
    prompts = [tokenizer.encode(example.prompt) for example in examples]
    environments = [task.environment() for _ in examples]
    for environment, example in zip(environments, examples):
        environment.reset(example)
    first_turns = greedy_turns(model, tokenizer, prompts, [budget] * len(examples), first)
    calls = sum(turn[:1] == [tokenizer.convert_tokens_to_ids("[")] for turn in first_turns)
    second = []  # (index, context, limit)
    for i, (environment, turn) in enumerate(zip(environments, first_turns)):
        reply, _, done = environment.step(tokenizer.decode(turn[:-1] if turn[-1:] == [eos] else turn,
                                                           skip_special_tokens=True))
        context = prompts[i] + turn + (tokenizer.encode(reply) if not done else [])
        if not done and turn[-1:] == [eos] and len(context) - len(prompts[i]) < budget:
            second.append((i, context, budget - (len(context) - len(prompts[i]))))
    if second:
        indices, contexts, limits = zip(*second)
        for i, turn in zip(indices, greedy_turns(model, tokenizer, list(contexts), list(limits))):
            environments[i].step(tokenizer.decode(turn[:-1] if turn[-1:] == [eos] else turn, skip_special_tokens=True))
    correct = [bool(environment.correct) for environment in environments]  # None: no answer (a call last)
    return {"accuracy": sum(correct) / len(examples), "tool_call_rate": calls / len(examples)}


@torch.no_grad()
def sampled_tool_call_probability(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast,
                                  examples: list[Example]) -> float:
    """The mean over the prompts of the probability, at temperature 1, that the first token is the call's `[`."""
    prompt_ids = torch.tensor([tokenizer.encode(example.prompt) for example in examples])  # all of one length
    probabilities = model(input_ids=prompt_ids).logits[:, -1].softmax(-1)
    return probabilities[:, tokenizer.convert_tokens_to_ids("[")].mean().item()


def tool_metrics(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, examples: list[Example],
                 task: Task) -> dict[str, float]:
    """A tool task's held-out numbers: the greedy episode's accuracy and tool-call rate, the sampled tool-call
    probability, and the greedy accuracy when the first turn is forced to answer directly or to call the tool."""
    free = episode_metrics(model, tokenizer, examples, task)
    return {
        "heldout_greedy_accuracy": free["accuracy"],
        "heldout_greedy_tool_call_rate": free["tool_call_rate"],
        "heldout_sampled_tool_call_probability": sampled_tool_call_probability(model, tokenizer, examples),
        "heldout_direct_answer_accuracy": episode_metrics(model, tokenizer, examples, task, first="direct")["accuracy"],
        "heldout_tool_path_accuracy": episode_metrics(model, tokenizer, examples, task, first="call")["accuracy"],
    }


@torch.no_grad()
def greedy_accuracy(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, examples: list[Example],
                    task: Task) -> float:
    """The share of greedy completions the task counts correct (a tool task: of greedy episodes,
    `episode_metrics`). Prompts are batched by length, so no padding is involved."""
    if task.tools:
        return episode_metrics(model, tokenizer, examples, task)["accuracy"]
    by_length: dict[int, list[Example]] = {}
    for example in examples:
        by_length.setdefault(len(example.prompt), []).append(example)
    correct = 0
    for group in by_length.values():
        prompt_ids = torch.tensor([tokenizer.encode(example.prompt) for example in group])
        output = model.generate(
            prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=False,
            max_new_tokens=task.min_completion_length + 2,  # room to go wrong past the shortest budget
        )
        completions = tokenizer.batch_decode(output[:, prompt_ids.shape[1] :], skip_special_tokens=True)
        correct += sum(task.correct(completion, example) for completion, example in zip(completions, group))
    return correct / len(examples)


def main(args: Args) -> None:
    start = time.time()
    torch.set_num_threads(args.num_threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    task = TASKS[args.task]()
    tokenizer = build_tokenizer(CHARACTERS[args.task])
    model = build_model(tokenizer)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}; vocab: {vocab}")

    # SFT: loss on the answer and <eos> only (a tool task: on the call and its <eos> too); batches drawn from the
    # training stream by a seeded generator
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / args.warmup_steps))
    generator = torch.Generator().manual_seed(args.seed)
    mixture = torch.Generator().manual_seed(args.seed + 1)  # a tool task's choice of tool episodes, a stream apart
    model.train()
    for step in range(1, args.steps + 1):
        indices = torch.randint(len(task.train), (args.batch_size,), generator=generator).tolist()
        batch = [task.train[i] for i in indices]
        if task.tools:
            use_tool = (torch.rand(args.batch_size, generator=mixture) < args.tool_fraction).tolist()
            input_ids, labels = make_tool_batch(batch, use_tool, tokenizer, task)
        else:
            input_ids, labels = make_batch(batch, tokenizer)
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if step % args.log_every == 0 or step == args.steps:
            message = f"step {step:5d}  loss {loss.item():.4f}  lr {scheduler.get_last_lr()[0]:.2e}"
            if args.eval_during_training and task.tools:
                model.eval()
                message += "".join(f"  {name.removeprefix('heldout_')} {value:.3f}"
                                   for name, value in tool_metrics(model, tokenizer, task.test, task).items())
                model.train()
            elif args.eval_during_training:
                model.eval()
                message += f"  held-out greedy accuracy {greedy_accuracy(model, tokenizer, task.test, task):.3f}"
                model.train()
            print(message, flush=True)

    # held-out evaluation, then save
    model.eval()
    accuracy = greedy_accuracy(model, tokenizer, task.test, task)
    accuracy_first_100 = greedy_accuracy(model, tokenizer, task.test[:100], task)
    output_dir = Path(args.output_dir)
    model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    sha256 = hashlib.sha256((output_dir / "model.safetensors").read_bytes()).hexdigest()
    info = {
        "command": " ".join(["python", *sys.orig_argv[1:]]),
        "args": asdict(args),
        "steps": args.steps,
        "heldout_greedy_accuracy": accuracy,
        "heldout_greedy_accuracy_first_100": accuracy_first_100,
        "num_heldout": len(task.test),
        "model_safetensors_sha256": sha256,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "torch": torch.__version__,
        "build_seconds": round(time.time() - start, 1),
    }
    if task.tools:  # the episode's accuracy is heldout_greedy_accuracy; how the model uses the tool besides
        info.update(tool_metrics(model, tokenizer, task.test, task))
        info["build_seconds"] = round(time.time() - start, 1)
    (output_dir / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"held-out greedy accuracy {accuracy:.3f} (first 100: {accuracy_first_100:.2f}); sha256 {sha256}")


if __name__ == "__main__":
    main(tyro.cli(Args))
