"""Where a decoder's two models come from: a checkpoint directory each (a trained target and
draft of one tokenizer), or a target and its own first layers (a self-speculative draft).

Loading reads local files only: a directory is what `save_pretrained` wrote (config.json, the
weights, and beside them the tokenizer's files), and nothing is downloaded.
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import torch

from ..driver.values import as_size


DTYPES = ("auto", "bfloat16", "float16", "float32")  # load_model's dtype by name ("auto": the checkpoint's)


def load_model(directory: str | Path, *, dtype: torch.dtype | str = "auto", device: torch.device | str = "cuda") -> Any:
    """The causal language model saved in `directory` (transformers' from_pretrained, local files
    only), in `dtype` ("auto": the checkpoint's), on `device`, for inference: eval mode and no
    parameter requiring grad (a model whose parameters did would make every in-place write into
    a KV cache a node of an autograd graph the cache keeps alive), attention through SDPA (which
    takes Stack's additive masks). A directory's own Python (config.json's auto_map) is never
    run: transformers would ask at a terminal whether to, and run it on a yes. The arguments are
    checked before the directory: a device the machine lacks (the default "cuda" on a machine
    without CUDA) is the more fundamental refusal, which no directory mends, and it was told only
    once a directory had been found."""
    if not isinstance(dtype, torch.dtype) and dtype not in DTYPES:
        raise ValueError(f"dtype is a torch.dtype or one of {DTYPES}, not {dtype!r}")
    device = _as_device(device)
    check_model_directory(directory)
    _check_config(Path(directory))
    from transformers import AutoModelForCausalLM
    model, info = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=dtype,
                                                       attn_implementation="sdpa", trust_remote_code=False,
                                                       output_loading_info=True)
    for kind in ("missing", "unexpected"):  # transformers logs them and loads: random weights, or weights unused
        if info[f"{kind}_keys"]:
            keys = sorted(info[f"{kind}_keys"])
            raise ValueError(f"{directory}'s weights do not match its config.json: {len(keys)} {kind} "
                             f"({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})")
    return model.to(device).eval().requires_grad_(False)


# config.json's sizes, as a Llama-family config names them (null where a default stands: head_dim, KV heads)
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "max_position_embeddings")


def _check_config(directory: Path) -> None:
    """config.json's sizes checked before any weight is made: transformers met a negative one with
    torch's "negative dimension", a string with an error of no ValueError's kind, heads its KV heads
    do not divide with a shape mismatch, an unknown rope type with a KeyError, all naming no field;
    and a layer count past the weights' made (2**20: for ever) and randomly initialised the layers
    the weights lack. The weights' layers are read from safetensors' headers alone (a count short
    of theirs is refused once loaded, by the keys left over: a checkpoint may hold layers past it,
    as DeepSeek's next-token layers, which transformers drops)."""
    path = directory / "config.json"
    config = _json(path)
    sizes = {name: as_size(config[name], f"{path}'s {name}") for name in SIZES if config.get(name) is not None}
    heads = sizes.get("num_attention_heads", 1)
    if heads % sizes.get("num_key_value_heads", heads):
        raise ValueError(f"{path}'s num_key_value_heads ({sizes['num_key_value_heads']}) does not divide its "
                         f"num_attention_heads ({heads})")
    if "head_dim" not in sizes and sizes.get("hidden_size", heads) % heads:
        raise ValueError(f"{path}'s num_attention_heads ({heads}) does not divide its hidden_size "
                         f"({sizes['hidden_size']}), and it names no head_dim")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    for field in ("rope_parameters", "rope_scaling"):  # transformers 5's, and 4's which it still reads
        rope = config.get(field)
        kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"{path}'s {field} names rope type {kind!r}, none transformers knows "
                             f"({', '.join(ROPE_INIT_FUNCTIONS)})")
    layers = _saved_layers(directory)
    if layers is not None and sizes.get("num_hidden_layers", 0) > layers:  # fewer: their keys left over, below
        raise ValueError(f"{path}'s num_hidden_layers is {sizes['num_hidden_layers']}, but its weights hold "
                         f"{layers} layers")


def _json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, else ValueError naming the file."""
    try:
        loaded = json.loads(path.read_text())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not JSON: {e}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} holds a JSON object, not {type(loaded).__name__}")
    return loaded


def _saved_layers(directory: Path) -> int | None:
    """How many decoder layers the safetensors weights in `directory` hold (model.layers.N.*), by
    their names alone; None where there are none to read (another format: transformers' to check)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = list(_json(index).get("weight_map", {}))
    elif (directory / "model.safetensors").is_file():
        from safetensors import SafetensorError, safe_open
        try:
            with safe_open(directory / "model.safetensors", framework="pt") as weights:
                names = list(weights.keys())
        except SafetensorError as e:  # its own message named no file
            raise ValueError(f"{directory / 'model.safetensors'} is no safetensors file: {e}") from None
    else:
        return None
    found = {int(match[1]) for name in names if (match := re.search(r"\blayers\.(\d+)\.", name))}
    return max(found) + 1 if found else 0


def _as_device(device: torch.device | str) -> torch.device:
    """`device` as a torch.device this machine has, else ValueError naming it: checked before a
    checkpoint is read (a misspelt device, or a GPU past the machine's, met torch's error only once
    every weight had been loaded)."""
    try:
        checked = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is no torch device: {e}") from None
    if checked.type == "meta":  # loaded there, a model's weights are shapes alone, and a decoder's outputs garbage
        raise ValueError(f"device {device!r} is no place for weights: load a model onto the CPU or a GPU")
    count = getattr(getattr(torch, checked.type, None), "device_count", None)  # torch.cuda's, .xpu's, .mps'
    if checked.type != "cpu" and callable(count) and (checked.index or 0) >= count():
        raise ValueError(f"device {device!r} is not on this machine: it has {count()} {checked.type} device(s)")
    return checked


# What a tokenizer's save_pretrained writes, one of them at least (a fast tokenizer's, its config, a
# SentencePiece model, a BPE vocabulary): a directory with none holds a model without its tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(directory: str | Path) -> Any:
    """The tokenizer saved in `directory` (AutoTokenizer, local files only; the directory's own
    Python never run, as load_model's). A directory of a model saved without its tokenizer is a
    FileNotFoundError naming the files looked for (transformers' own error named none of them)."""
    from transformers import AutoTokenizer
    check_tokenizer_directory(directory)
    return AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)


def check_tokenizer_directory(directory: str | Path) -> None:
    """`directory` a model directory (check_model_directory) that holds a tokenizer too, else
    FileNotFoundError naming the files looked for: load_tokenizer's check, and the examples'
    command line's (examples/_cli.py) before any model is loaded."""
    check_model_directory(directory)
    if not has_tokenizer(directory):
        raise FileNotFoundError(f"{directory} holds a model but no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
                                "save the tokenizer beside it (tokenizer.save_pretrained(directory))")


def has_tokenizer(directory: str | Path) -> bool:
    """Whether `directory` holds a tokenizer's files (any of TOKENIZER_FILES): a draft's may not,
    its tokenizer being its target's."""
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def check_model_directory(directory: str | Path) -> None:
    """`directory` one that save_pretrained wrote (config.json in it), else FileNotFoundError:
    load_model's and load_tokenizer's check, and the examples' command line's (examples/_cli.py)."""
    if not (Path(directory) / "config.json").is_file():
        raise FileNotFoundError(f"{directory} holds no config.json: a model directory is what transformers' "
                                "save_pretrained writes (nothing is downloaded)")


def self_draft(model: Any, layers: int = 1) -> Any:
    """A self-speculative draft of `model`: a model of the same class made of the target's own
    embeddings, first `layers` decoder layers, final norm and head (the same modules, no copy).
    A decoder given it copies its draft cache from the target's instead of computing it, and
    Hugging Face's assisted generation takes it as an assistant model."""
    count = len(model.model.layers)
    layers = as_size(layers, f"layers (a self-speculative draft takes 1 to {count - 1} of the target's {count})",
                     1, count - 1)
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):  # Qwen2's and others' per-layer attention kinds
        config.layer_types = config.layer_types[:layers]
    with torch.device("meta"):  # every module is replaced by the target's
        draft = type(model)(config)
    draft.model.embed_tokens = model.model.embed_tokens
    draft.model.layers = torch.nn.ModuleList(model.model.layers[:layers])
    draft.model.norm, draft.model.rotary_emb, draft.lm_head = model.model.norm, model.model.rotary_emb, model.lm_head
    draft.generation_config = copy.deepcopy(model.generation_config)
    return draft.eval()
