"""Where a decoder's two models come from: a checkpoint directory each (a trained target and
draft of one tokenizer), or a target and its own first layers (a self-speculative draft).

Loading reads local files only: a directory is what `save_pretrained` wrote (config.json, the
weights, and beside them the tokenizer's files), and nothing is downloaded.
"""
from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..driver.values import as_index, as_real, as_size


DTYPES = ("auto", "bfloat16", "float16", "float32")  # load_model's dtype by name ("auto": the checkpoint's)


def is_float_dtype(dtype: object) -> bool:
    """Whether `dtype` is a torch.dtype a model's weights and activations are made in: a float of 2
    bytes or more (transformers refuses an integer one, once the checkpoint is read, and a float8
    one met "TypeError: couldn't find storage object Float8_e4m3fnStorage"; float8_e4m3fn holds no
    -inf, an additive mask's)."""
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize >= 2


def load_model(directory: str | Path, *, dtype: torch.dtype | str = "auto", device: torch.device | str = "cuda") -> Any:
    """The causal language model saved in `directory` (transformers' from_pretrained, local files
    only), in `dtype` ("auto": the checkpoint's), on `device`, for inference: eval mode and no
    parameter requiring grad (a model whose parameters did would make every in-place write into
    a KV cache a node of an autograd graph the cache keeps alive), attention through SDPA (which
    takes Stack's additive masks). A directory's own Python (config.json's auto_map) is never
    run: transformers would ask at a terminal whether to, and run it on a yes. The arguments are
    checked before the directory: a device the machine lacks (the default "cuda" on a machine
    without CUDA) is the more fundamental refusal, which no directory mends, and it was told only
    once a directory had been found. Weights that do not fit config.json (a tensor of another
    shape, one missing, one left over) are a ValueError naming them (_check_weights)."""
    if not (is_float_dtype(dtype) or dtype in DTYPES):
        raise ValueError(f"dtype is a floating-point torch.dtype of 2 bytes or more or one of {DTYPES}, not {dtype!r}")
    device = _as_device(device)
    check_model(directory)
    from transformers import AutoModelForCausalLM
    # ignore_mismatched_sizes: a tensor of another shape is reported in `info`, refused below by name (transformers
    # raised a RuntimeError naming none, pointing at a report in its log)
    model, info = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=dtype,
                                                       attn_implementation="sdpa", trust_remote_code=False,
                                                       output_loading_info=True, ignore_mismatched_sizes=True)
    order = {name: at for at, name in enumerate(model.state_dict())}
    shaped = sorted(info["mismatched_keys"], key=lambda key: (order.get(key[0], len(order)), key[0]))
    _check_weights(directory, [(name, tuple(found), tuple(made)) for name, found, made in shaped],
                   info["missing_keys"], info["unexpected_keys"])
    return model.to(device).eval().requires_grad_(False)


def _check_weights(directory: str | Path, shaped: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
                   missing: Collection[str] = (), unexpected: Collection[str] = ()) -> None:
    """ValueError naming `directory` and, a few of each, the tensors its weights hold in another
    shape than its config.json makes (`shaped`: name, the weights' shape, config.json's, in the
    model's order), and the keys missing from them or left over (in name order), if any: a model
    loaded so would be silently wrong (transformers initialises a missing or mismatched weight at
    random and drops one left over, only logging it)."""
    parts = []
    if shaped:
        parts.append(f"{len(shaped)} of another shape ("
                     + _few([f"{name}: {list(found)} in the weights, {list(made)} by config.json"
                             for name, found, made in shaped], "; ") + ")")
    for kind, keys in (("missing", missing), ("unexpected", unexpected)):
        if keys:
            parts.append(f"{len(keys)} {kind} ({_few(sorted(keys), ', ')})")
    if parts:
        raise ValueError(f"{directory}'s weights do not match its config.json: {'; '.join(parts)}")


def _few(items: list[str], between: str, most: int = 3) -> str:
    """The first `most` of `items` joined by `between`, an ellipsis after them where there are more."""
    return between.join(items[:most]) + (f"{between}..." if len(items) > most else "")


def _check_shapes(directory: Path, saved: dict[str, Saved | None]) -> None:
    """_check_weights on the shapes the safetensors headers give (`saved`) against those of the
    model config.json makes, built on the meta device (no memory), before any weight is made:
    transformers met a config.json edited to another size, or another model's weights, with a
    RuntimeError naming no tensor (its report went to its log), once it had made the model at
    config.json's sizes. Tensors of one name are compared; one that only one side has is left to
    the check once loaded (a tied head, a renamed key), and so is a quantized checkpoint (its
    packed shapes are the quantizer's) and a model whose weights transformers converts as it
    loads (a mixture of experts' fused into one tensor). A tensor whose dtype the headers give as
    no float's (I32, BOOL) where the model's is a float is refused too, naming it: transformers
    cast it to the model's dtype as it loaded, saying nothing."""
    model = _made(directory)
    if model is None:
        return
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        if get_model_conversion_mapping(model, add_legacy=False):
            return
    except ImportError:  # another transformers: its loading checks alone
        return
    made = model.state_dict()
    shaped = [(name, found.shape, shape) for name, tensor in made.items()
              if (found := saved.get(name)) is not None and found.shape != (shape := tuple(tensor.shape))]
    _check_weights(directory, shaped)
    # a float weight saved as integers or bools (no quantization_config says how to read them) was cast to
    # the model's dtype as it loaded, a bool head 0s and 1s, and nothing said so
    unfloat = sorted(f"{name}: {found.dtype}" for name, tensor in made.items()
                     if (found := saved.get(name)) is not None and tensor.is_floating_point()
                     and not _floating(found.dtype))
    if unfloat:
        raise ValueError(f"{directory}'s weights are of no floating-point dtype where its model's are floats: "
                         f"{len(unfloat)} ({_few(unfloat, ', ')}); a quantized checkpoint names its "
                         "quantization_config in config.json")


def _made(directory: Path) -> Any:
    """The model `directory`'s config.json makes, on the meta device (shapes alone, no memory), or
    None for a quantized checkpoint (its packed shapes are the quantizer's). What transformers
    refuses as it reads the config or makes the model is a ValueError naming the file, its words
    kept: they were a KeyError (a rope type's missing factor), a TypeError from deep inside (a
    string rope_theta: "unsupported operand type(s) for ** or pow(): 'str' and 'Tensor'") or
    huggingface_hub's StrictDataclassError (a string where a bool stands), of no ValueError's
    kind, none naming the file."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig, AutoModelForCausalLM
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
        if getattr(config, "quantization_config", None) is not None:
            return None
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except (KeyError, TypeError, ValueError, StrictDataclassError) as e:
        said = " ".join(str(e).split())  # one line: the dataclasses' errors span several
        raise ValueError(f"{directory / 'config.json'} makes no model transformers builds: {type(e).__name__}: "
                         f"{said}") from None


def _floating(dtype: str) -> bool:
    """Whether a safetensors header's dtype (F32, BF16, F8_E4M3, I32, BOOL, ...) is a float's."""
    return dtype.startswith(("F", "BF"))


# config.json's sizes, as a Llama-family config names them (null where a default stands: head_dim, KV heads)
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "max_position_embeddings")


def _check_config(directory: Path, saved: dict[str, Saved | None] | None) -> None:
    """config.json's sizes checked before any weight is made: transformers met a negative one with
    torch's "negative dimension", a string with an error of no ValueError's kind, heads its KV heads
    do not divide with a shape mismatch, an unknown rope type with a KeyError, all naming no field;
    and a layer count past the weights' made (2**20: for ever) and randomly initialised the layers
    the weights lack. A dtype torch lacks (dtype, torch_dtype) met torch's AttributeError naming
    no field, an activation transformers lacks (hidden_act) a KeyError of its name alone, a
    pad_token_id past the vocabulary torch's AssertionError, and a negative or NaN rms_norm_eps
    loaded a model whose logits were NaN. The weights' layers are
    read from safetensors' headers alone (a count short of theirs is refused once loaded, by the
    keys left over: a checkpoint may hold layers past it, as DeepSeek's next-token layers, which
    transformers drops)."""
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
    # transformers 5's dtype, else 4's torch_dtype (the one it reads: getattr(torch, "float32")); a quantized
    # checkpoint's may name its storage's (an FP8 one's "float8_e4m3fn", beside its quantization_config)
    field = "dtype" if config.get("dtype") is not None else "torch_dtype"
    named = config.get(field)
    made = getattr(torch, named, None) if isinstance(named, str) else None
    if named is not None and not (is_float_dtype(made) or (isinstance(made, torch.dtype)
                                                           and config.get("quantization_config") is not None)):
        raise ValueError(f"{path}'s {field} names no floating-point dtype of torch's, not {named!r}")
    if config.get("rms_norm_eps") is not None:  # negative or NaN: NaN logits, loaded without a word
        eps = as_real(config["rms_norm_eps"], f"{path}'s rms_norm_eps")
        if not 0 <= eps < math.inf:
            raise ValueError(f"{path}'s rms_norm_eps must be a finite number of at least 0, not {eps}")
    vocab = sizes.get("vocab_size")
    if config.get("pad_token_id") is not None and vocab is not None:  # the embedding's padding_idx, as torch reads it
        pad = as_index(config["pad_token_id"], f"{path}'s pad_token_id")
        if not -vocab <= pad < vocab:  # torch's AssertionError "Padding_idx must be within num_embeddings"
            raise ValueError(f"{path}'s pad_token_id must be None or an int from -{vocab} to {vocab - 1} (its "
                             f"embedding's padding_idx), not {pad}")
    from transformers.activations import ACT2FN
    act = config.get("hidden_act")
    if act is not None and not (isinstance(act, str) and act in ACT2FN):  # its KeyError named the activation alone
        raise ValueError(f"{path}'s hidden_act names activation {act!r}, none transformers knows ({', '.join(ACT2FN)})")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    for field in ("rope_parameters", "rope_scaling"):  # transformers 5's, and 4's which it still reads
        rope = config.get(field)
        kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"{path}'s {field} names rope type {kind!r}, none transformers knows "
                             f"({', '.join(ROPE_INIT_FUNCTIONS)})")
    layers = _saved_layers(saved)
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


class Saved(NamedTuple):
    """A tensor as a safetensors header gives it: its shape and its dtype's name (F32, BF16, I32)."""

    shape: tuple[int, ...]
    dtype: str


def _saved_shapes(directory: Path) -> dict[str, Saved | None] | None:
    """The safetensors weights in `directory`, each tensor's name, shape and dtype, from the
    files' headers alone (no tensor is read); a shard the index names that is not there gives its
    names without them (transformers' to refuse). None where there are none (another format:
    transformers' to check)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files: dict[str, list[str]] = {}
        for name, file in _json(index).get("weight_map", {}).items():
            files.setdefault(str(file), []).append(name)
    elif (directory / "model.safetensors").is_file():
        files = {"model.safetensors": []}
    else:
        return None
    from safetensors import SafetensorError, safe_open
    shapes: dict[str, Saved | None] = {}
    for file, names in files.items():
        path = directory / file
        if not path.is_file():
            shapes.update(dict.fromkeys(names))
            continue
        try:
            with safe_open(path, framework="pt") as weights:
                shapes.update({name: Saved(tuple((part := weights.get_slice(name)).get_shape()), part.get_dtype())
                               for name in weights.keys()})
        except SafetensorError as e:  # its own message named no file
            raise ValueError(f"{path} is no safetensors file: {e}") from None
    return shapes


def _saved_layers(saved: dict[str, Any] | None) -> int | None:
    """How many decoder layers the weights named in `saved` hold (model.layers.N.*), by their
    names alone; None where there are none to read (another format: transformers' to check)."""
    if saved is None:
        return None
    found = {int(match[1]) for name in saved if (match := re.search(r"\blayers\.(\d+)\.", name))}
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
    FileNotFoundError naming the files looked for (transformers' own error named none of them), and
    one whose tokenizer transformers cannot read a ValueError naming the directory, its words kept
    (a tokenizer.json of "{}" met a KeyError of 'added_tokens', one of no JSON json's error)."""
    from transformers import AutoTokenizer
    check_tokenizer_directory(directory)
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except (KeyError, TypeError, ValueError) as e:  # a tokenizer.json of "{}": KeyError 'added_tokens'; no JSON:
        # json's JSONDecodeError; either naming no file
        said = " ".join(str(e).split())
        raise ValueError(f"{directory} holds a tokenizer transformers cannot read: {type(e).__name__}: "
                         f"{said}") from None


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


def check_model(directory: str | Path) -> None:
    """What load_model checks of `directory` before any weight is made (no memory, no device): a
    model directory (check_model_directory), its config.json's fields (_check_config) and the
    safetensors headers against the model it makes (_check_shapes), each refusal naming the field
    or the tensors: load_model's checks, and the examples' command line's (examples/_cli.py), which
    met them only past the GPU check, once the target had loaded."""
    check_model_directory(directory)
    saved = _saved_shapes(Path(directory))
    _check_config(Path(directory), saved)
    if saved is not None:
        _check_shapes(Path(directory), saved)


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
