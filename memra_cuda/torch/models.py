"""Where a decoder's two models come from: a checkpoint directory each (a trained target and
draft of one tokenizer), or a target and its own first layers (a self-speculative draft).

Loading reads local files only: a directory is what `save_pretrained` wrote (config.json, the
weights, and beside them the tokenizer's files), and nothing is downloaded.
"""
from __future__ import annotations

import copy
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
    _check_directory(directory)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=dtype,
                                                 attn_implementation="sdpa", trust_remote_code=False)
    return model.to(device).eval().requires_grad_(False)


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
    _check_directory(directory)
    if not any((Path(directory) / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"{directory} holds a model but no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
                                "save the tokenizer beside it (tokenizer.save_pretrained(directory))")
    return AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)


def _check_directory(directory: str | Path) -> None:
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
