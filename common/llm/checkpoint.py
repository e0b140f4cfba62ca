"""The LLM scripts' training state in a checkpoint directory (common/checkpoint.py writes it atomically): every
rank's shards of each trained model and optimizer (torch.distributed.checkpoint), a `transformers`-loadable export of
the policy, and rank 0's trainer_state.pt (step, arguments, world size, every rank's RNG states, the algorithm's
state, the split layout's batch in flight); and the checks that refuse a damaged checkpoint or one of another run
before any model loads, naming the previous complete one."""

import json
import zipfile
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from common.checkpoint import check_resume_args, resolve_checkpoint, save_checkpoint, save_object
from common.determinism import rng_states
from common.distributed import fail, in_brief, save_group
from common.llm.lora import base_fingerprint, is_adapter, lora_layers, lora_spec, write_peft_adapter
from common.llm.models import export_pretrained, stream_weights


def trainer_shards_damage(trainer: Path) -> str | None:
    """What is wrong with a torch.distributed.checkpoint directory: its .metadata does not load, or a file it
    records is missing or shorter than the last byte range recorded in it."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (trainer / ".metadata").is_file():
        return f"{trainer.name}/.metadata is missing"
    try:
        metadata = FileSystemReader(str(trainer)).read_metadata()
    except Exception as error:  # a damaged pickle raises many types
        return f"{trainer.name}/.metadata does not load ({in_brief(error)})"
    needed: dict[str, int] = {}
    for stored in (metadata.storage_data or {}).values():
        needed[stored.relative_path] = max(needed.get(stored.relative_path, 0), stored.offset + stored.length)
    for name, length in sorted(needed.items()):
        path = trainer / name
        if not path.is_file():
            return f"{trainer.name}/{name} is missing"
        if path.stat().st_size < length:
            return f"{trainer.name}/{name} is {path.stat().st_size} bytes, its metadata needs {length} (truncated?)"
    return None


def export_damage(directory: Path) -> str | None:
    """What is wrong with a checkpoint's transformers export: a safetensors file (the index's, the single
    model.safetensors, or a LoRA checkpoint's adapter_model.safetensors) is missing, its header does not parse, or it
    is shorter than the tensors its header lists."""
    index = directory / "model.safetensors.index.json"
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
            else ["adapter_model.safetensors" if (directory / "adapter_config.json").is_file() else "model.safetensors"]
    except (ValueError, KeyError) as error:
        return f"{index.name} does not parse ({in_brief(error)})"
    for name in names:
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        with open(path, "rb") as handle:  # safetensors: 8 bytes of header length, a JSON header, the tensors' bytes
            header_length = int.from_bytes(handle.read(8), "little")
            try:
                header = json.loads(handle.read(header_length)) if size >= 8 + header_length else None
            except ValueError:
                header = None
        if header is None:
            return f"{name} is {size} bytes and its header does not parse (truncated?)"
        data_end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
        if size < 8 + header_length + data_end:
            return f"{name} is {size} bytes, its header needs {8 + header_length + data_end} (truncated?)"
    return None


def checkpoint_damage(directory: Path) -> str | None:
    """What makes the checkpoint `directory` unusable, as one line naming the damaged file, or None when it is
    whole. Cheap (trainer_state.pt and headers are read, never a shard), and needs nothing that checkpoints have not
    always held."""
    state_file = directory / "trainer_state.pt"
    if not state_file.is_file():
        return "trainer_state.pt is missing"
    if not zipfile.is_zipfile(state_file):  # torch.save writes a zip archive, whose directory comes last
        return f"trainer_state.pt is {state_file.stat().st_size} bytes and not a complete archive (truncated?)"
    try:
        torch.load(state_file, weights_only=False)
    except Exception as error:  # unpickling raises many types
        return f"trainer_state.pt does not load ({in_brief(error)})"
    return trainer_shards_damage(directory / "trainer") or export_damage(directory)


def previous_complete_checkpoint(directory: Path) -> Path | None:
    """The newest undamaged checkpoint beside `directory` with an earlier step."""
    earlier = sorted((p for p in directory.parent.glob("step_*") if p.is_dir() and p.name < directory.name),
                     reverse=True)
    return next((candidate for candidate in earlier if checkpoint_damage(candidate) is None), None)


def resume_instead(directory: Path) -> str:
    """Where to resume from when `directory` cannot be: named, never taken silently."""
    earlier = previous_complete_checkpoint(directory)
    if earlier is None:
        return "There is no earlier complete checkpoint (without --resume the run starts over)"
    return f"The previous complete checkpoint is {earlier}: resume from it with --resume {earlier}"


def resume_mismatch(directory: Path, state: dict, args: object, world_size: int, may_change: Iterable[str]
                    ) -> str | None:
    """Why the checkpoint `directory` (its trainer_state: `state`) cannot continue as this run (`args`), or None."""
    if state.get("world_size") != world_size:
        return f"checkpoint was written with world size {state.get('world_size')}, this run has {world_size}; " \
               "resume needs the same"
    problems = check_resume_args(state["args"], asdict(args), may_change)
    if problems:
        return f"{directory} was written with other arguments; resuming would silently change the run:\n  " \
            + "\n  ".join(problems) + f"\n(arguments a resume may change: {', '.join(may_change)}; " \
            "--total-steps may grow)"
    if args.total_steps <= state["step"]:
        return f"the checkpoint is at step {state['step']}, --total-steps is {args.total_steps}: nothing left to " \
               "run (a larger --total-steps extends the run)"
    bases = state.get("lora_bases", {})
    if "lora_base" in state:  # written before every adapted model's base was named: the policy's
        bases = {"policy": state["lora_base"]}
    paths = args.adapted_bases()
    for role, base in bases.items():
        fingerprint = base_fingerprint(paths[role])  # the same roles: the arguments that adapt them were compared
        if base["sha256"] != fingerprint:
            return f"{directory} holds LoRA adapters trained on the base {base['path']!r} (the {role}'s; weights " \
                   f"sha256 {base['sha256'][:16]}...), but the weights at {paths[role]!r} are {fingerprint[:16]}...: " \
                   "the adapters would act on another model"
    return None


def read_training_state(args: object, world_size: int, may_change: Iterable[str]) -> tuple[Path, dict]:
    """The checkpoint `args.resume` names and this rank's view of its trainer_state.pt, refused with one message on
    every rank (before any other collective) when a file of it is damaged (naming the previous complete checkpoint),
    when it was written at another world size, with other arguments than `args` (except `may_change`), or has
    nothing left to run. Rank 0 alone reads and checks: the others receive its verdict, the shared fields, and their
    own RNG states and in-flight batch (`rng`, `in_flight`: this rank's entries of the lists rank 0 saved). So
    every other rank makes no file-system call here and unpickles nothing but its share: at N ranks the file holds N
    RNG states and, with --max-staleness 1, every trainer's batch in flight, and N ranks each reading it whole and
    statting every shard would be N^2 file-system operations on one shared file system."""
    rank = dist.get_rank()
    directory, problem, shares = None, None, [None] * dist.get_world_size()
    if rank == 0:
        try:
            directory = resolve_checkpoint(args.resume)
        except FileNotFoundError as error:
            problem = str(error)
        if directory is not None:
            damage = checkpoint_damage(directory)
            if damage:
                problem = f"checkpoint {directory} is damaged: {damage}. {resume_instead(directory)}"
            else:
                try:  # rank 0 must reach the broadcast whatever the file holds, or the others wait for it
                    state = torch.load(directory / "trainer_state.pt", weights_only=False)
                    problem = resume_mismatch(directory, state, args, world_size, may_change)
                    if problem is None:
                        shared = {key: value for key, value in state.items() if key not in ("rng", "in_flight")}
                        shares = [{**shared, "rng": state["rng"][r] if r < len(state["rng"]) else None,
                                   **({"in_flight": state["in_flight"][r] if r < len(state["in_flight"]) else None}
                                      if "in_flight" in state else {})} for r in range(len(shares))]
                except Exception as error:  # e.g. a trainer_state.pt of another layout: fields missing
                    problem = f"cannot resume from {directory}: its trainer_state.pt does not read as a checkpoint " \
                              f"of this project ({in_brief(error)}). {resume_instead(directory)}"
    verdict = [problem, directory]
    dist.broadcast_object_list(verdict, src=0, group=save_group())
    if verdict[0] is not None:
        fail(verdict[0])
    mine: list[object] = [None]
    dist.scatter_object_list(mine, shares if rank == 0 else None, src=0, group=save_group())
    return verdict[1], mine[0]


def trained_state_dict(model: torch.nn.Module) -> dict:
    """What a checkpoint holds of a model: its trained parameters (all of them; a LoRA model's adapters and any
    trained head, its frozen base left out: the base is named by its fingerprint instead). A tied parameter's other
    name (a tied LM head) goes with it, which torch's ignore_frozen_params, naming each parameter once, would keep."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {name: value for name, value in get_model_state_dict(model).items() if name not in frozen}


def state_options(model: torch.nn.Module) -> object:
    """How a trained_state_dict loads back: strictly, unless frozen parameters were left out of it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(strict=all(p.requires_grad for p in model.parameters()))


def save_training_checkpoint(root: Path, step: int, trained: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]],
                             tokenizer: object, args: object, extra: dict | None = None,
                             in_flight: list[dict] | None = None, lora_bases: dict | None = None) -> Path:
    """A collective: every rank writes its shard of each trained model and optimizer (`trained`, e.g. {"policy":
    (model, optimizer)}) with torch.distributed.checkpoint; the policy is exported loadable by transformers and vLLM;
    rank 0 adds trainer_state.pt (step, arguments, world size, every rank's RNG states, `extra`: state the
    algorithm carries between steps, e.g. an adaptive coefficient, and every rank's `in_flight`: the split layout's
    batch already sampled for the next step, a few bytes per token). The RNG states and batches are gathered to rank
    0 only (gather_object), not to every rank.

    A LoRA policy's checkpoint holds its adapters and their optimizer state, not its base: the export is a PEFT
    adapter directory (`adapter_config.json`, `adapter_model.safetensors`, in float32) with the tokenizer, plus the
    merged model under merged/ with --export-merged, and trainer_state.pt names the bases of every adapted model
    (`lora_bases`: by role, path and weights fingerprint, rank 0's), which a resume must match."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    is_writer = dist.get_rank() == 0
    all_rng: list[object] | None = [None] * dist.get_world_size() if is_writer else None
    dist.gather_object(rng_states(), all_rng, group_dst=0, group=save_group())
    all_in_flight: list[object] | None = [None] * dist.get_world_size() if is_writer else None
    if in_flight is not None:
        dist.gather_object(in_flight, all_in_flight, group_dst=0, group=save_group())

    def write(directory: Path) -> None:
        state = {name: {"model": trained_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
                 for name, (model, optimizer) in trained.items()}
        dcp.save(state, checkpoint_id=str(directory / "trainer"), process_group=save_group())
        policy = trained["policy"][0]
        if lora_layers(policy):
            adapters = dict(stream_weights(policy, torch.float32, only=is_adapter))  # a collective: every rank
            if is_writer:
                write_peft_adapter(directory, {name: tensor.cpu() for name, tensor in adapters.items()},
                                   lora_spec(args), args.model_name_or_path)
                tokenizer.save_pretrained(directory)
            if args.export_merged:
                (directory / "merged").mkdir(exist_ok=True)
                export_pretrained(policy, tokenizer, directory / "merged", merge_lora=True)
        else:
            export_pretrained(policy, tokenizer, directory)
        if is_writer:
            save_object({"step": step, "args": asdict(args), "world_size": dist.get_world_size(), "rng": all_rng,
                        "extra": extra or {}, **({"in_flight": all_in_flight} if in_flight is not None else {}),
                         **({"lora_bases": lora_bases} if lora_bases else {})},
                        directory / "trainer_state.pt")

    return save_checkpoint(root, step, write, args.keep_last, save_group())


def load_training_checkpoint(directory: Path, trained: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]
                             ) -> None:
    """Read each rank's shards back into the (already sharded) models and optimizers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = {name: {"model": trained_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
             for name, (model, optimizer) in trained.items()}
    try:
        dcp.load(state, checkpoint_id=str(directory / "trainer"), process_group=save_group())
    except dcp.CheckpointException as error:  # raised on every rank alike, whichever rank's read failed
        ranks_by_error: dict[str, list[str]] = {}
        for rank, (exception, _) in sorted(error.failures.items()):
            ranks_by_error.setdefault(in_brief(exception), []).append(str(rank))
        failures = "; ".join(f"{'ranks' if len(ranks) > 1 else 'rank'} {', '.join(ranks)}: {message}"
                             for message, ranks in ranks_by_error.items())
        fail(f"checkpoint {directory}: its trainer/ shards do not load ({failures}). {resume_instead(directory)}")
    for name, (model, optimizer) in trained.items():
        set_model_state_dict(model, state[name]["model"], options=state_options(model))
        set_optimizer_state_dict(model, optimizer, state[name]["optimizer"])
