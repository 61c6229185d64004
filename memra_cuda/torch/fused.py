"""A Llama-family model's weights as a compiled step wants them, and the step's arithmetic.

gpt-fast's recipe: q, k and v are one matrix, gate and up another, so a layer runs four GEMMs
(GEMVs at one token a row) and the norms, the rotary embedding and the MLP's activation are
left to the compiler to fuse around them. `fuse(model)` converts a transformers
LlamaForCausalLM-shaped model (Llama, Mistral, Qwen2) once: the fused matrices are new tensors,
and the model's own q/k/v and gate/up weights become views of them, so the weights are held once
and the model still runs as Hugging Face's (the reference the tests compare with). A layer is
converted once whoever asks (a self-speculative draft's layers are the target's: both fuse to
the same tensors).

What cannot be fused is refused, naming why (NotFused): a recurrent layer, a projection that is
not a plain `torch.nn.Linear` (a tensor-parallel rank's, a quantised one), an activation other
than SiLU. memra_cuda.torch.Stack runs such models through their own modules.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..driver.errors import NotFused
from .kv import head_size
from .stack import SCALED_FIELDS
from .state import Recurrent

_MODEL_TYPES = ("llama", "mistral", "qwen2")
# A projection's arithmetic: F.linear's (x, weight, bias), or memra_cuda.torch.skinny's few_rows; and
# the MLP's down projection of SwiGLU's fused gate and up ([..., 2 x inner]), where one kernel makes
# silu(gate) * up as it reads it (skinny's few_rows_gated): None, the projection of swiglu()'s product
Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


@dataclass(frozen=True)
class Heads:
    """What a layer's attention is shaped by: query heads, K/V heads, the head size, the norms'
    epsilon."""

    heads: int
    kv_heads: int
    dim: int
    eps: float

    @property
    def scale(self) -> float:
        return float(self.dim) ** -0.5

    @property
    def gqa(self) -> bool:
        """Whether K/V heads are shared by several query heads."""
        return self.kv_heads != self.heads


class FusedLayer(torch.nn.Module):
    """One decoder layer's weights: `qkv` [(H + 2 H_kv) d][hidden], `o`, `gate_up` [2 I][hidden],
    `down`, their biases where the model has them (Qwen2's q, k, v), and the two norms."""

    qkv_bias: torch.Tensor | None
    gate_up_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    down_bias: torch.Tensor | None

    def __init__(self, layer: Any):
        super().__init__()
        attention, mlp = layer.self_attn, layer.mlp
        self.qkv, self.qkv_bias = _fuse(attention.q_proj, attention.k_proj, attention.v_proj)
        self.gate_up, self.gate_up_bias = _fuse(mlp.gate_proj, mlp.up_proj)
        self.o, self.o_bias = attention.o_proj.weight, attention.o_proj.bias
        self.down, self.down_bias = mlp.down_proj.weight, mlp.down_proj.bias
        self.attention_norm, self.mlp_norm = layer.input_layernorm.weight, layer.post_attention_layernorm.weight

    def holds(self, layer: Any) -> bool:
        """Whether `layer`'s weights are still these: its q, k, v and gate, up views of the fused
        matrices (and biases), its others the same tensors of the same dtype. A weight replaced
        since (load_state_dict(assign=True), a parameter set anew, model.to(dtype), which gives
        the views new storage) is not."""
        attention, mlp = layer.self_attn, layer.mlp
        views = [(linear, self.qkv, self.qkv_bias) for linear in (attention.q_proj, attention.k_proj, attention.v_proj)]
        views += [(linear, self.gate_up, self.gate_up_bias) for linear in (mlp.gate_proj, mlp.up_proj)]
        same = [(attention.o_proj.weight, self.o), (attention.o_proj.bias, self.o_bias),
                (mlp.down_proj.weight, self.down), (mlp.down_proj.bias, self.down_bias),
                (layer.input_layernorm.weight, self.attention_norm),
                (layer.post_attention_layernorm.weight, self.mlp_norm)]
        return (all(_view_of(linear.weight, weight) and (linear.bias is None or _view_of(linear.bias, bias))
                    for linear, weight, bias in views)
                and all(mine is fused and (mine is None or mine.dtype == self.qkv.dtype) for mine, fused in same))


def _fuse(*linears: torch.nn.Linear) -> tuple[torch.nn.Parameter, torch.nn.Parameter | None]:
    """One weight (and bias) for `linears`, stacked by output rows, as parameters (a compiled
    step keeps a parameter's shape static); each linear's own weight becomes a view of its rows,
    so nothing is held twice."""
    with torch.no_grad():
        weight = torch.nn.Parameter(torch.cat([linear.weight for linear in linears]), requires_grad=False)
        bias = None
        if any(linear.bias is not None for linear in linears):
            bias = torch.nn.Parameter(torch.cat([linear.bias if linear.bias is not None
                                                 else linear.weight.new_zeros(linear.weight.shape[0])
                                                 for linear in linears]), requires_grad=False)
        start = 0
        for linear in linears:
            rows = linear.weight.shape[0]
            linear.weight = torch.nn.Parameter(weight[start:start + rows], requires_grad=False)
            if linear.bias is not None and bias is not None:
                linear.bias = torch.nn.Parameter(bias[start:start + rows], requires_grad=False)
            start += rows
    return weight, bias


def _view_of(tensor: torch.Tensor, base: torch.Tensor | None) -> bool:
    """Whether `tensor` lies in `base`'s memory, of its dtype."""
    return (base is not None and tensor.dtype == base.dtype
            and tensor.untyped_storage().data_ptr() == base.untyped_storage().data_ptr())


_LAYERS: weakref.WeakKeyDictionary[torch.nn.Module, FusedLayer] = weakref.WeakKeyDictionary()


def check_fuses(model: Any) -> None:
    """Refuse (NotFused), naming why, a model the step cannot run; reads nothing but its config and
    its modules' types."""
    config = model.config
    if getattr(config, "model_type", None) not in _MODEL_TYPES:
        raise NotFused(f"the compiled step runs {', '.join(_MODEL_TYPES)} models, not {config.model_type!r}")
    fields = [name for name in SCALED_FIELDS if getattr(config, name, None) is not None]
    if fields:  # a Llama's config may carry them too, and the step would skip them
        raise NotFused(f"the model scales or caps outside its layers ({', '.join(fields)}), which the step does not")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise NotFused(f"the compiled step's MLP is SwiGLU: {config.hidden_act!r} is not SiLU")
    for i, layer in enumerate(model.model.layers[:config.num_hidden_layers]):
        if isinstance(layer, Recurrent):
            raise NotFused(f"layer {i} is recurrent: its state is the model's own modules' to keep")
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        for name in names:
            linear = getattr(attention if name in names[:4] else mlp, name, None)
            if type(linear) is not torch.nn.Linear:
                raise NotFused(f"layer {i}'s {name} is {type(linear).__name__}, not a torch.nn.Linear "
                               "(a tensor-parallel or quantised projection runs through the model's own modules)")


class FusedLlama(torch.nn.Module):
    """A model's fused weights and the arithmetic of its step over caches it is given.

    forward() is what memra_cuda.torch.CompiledStack compiles: embeddings, the layers, the final
    norm and the head of R rows of T tokens, reading positions, slots and cache rows as device
    tensors, writing each token's K and V into its own slot of its layer's cache, and attending
    the way `attend` says (memra_cuda.torch.attention)."""

    def __init__(self, model: Any):  # made by fuse(), which checks the model first (check_fuses)
        super().__init__()
        config, inner = model.config, model.model
        self.shape = Heads(config.num_attention_heads, config.num_key_value_heads, head_size(config),
                           float(config.rms_norm_eps))
        self.embed = inner.embed_tokens.weight
        self.norm, self.head = inner.norm.weight, model.lm_head.weight
        self.layers = torch.nn.ModuleList(self._layer(layer) for layer in inner.layers[:config.num_hidden_layers])

    @staticmethod
    def _layer(layer: torch.nn.Module) -> FusedLayer:
        """`layer` fused once, whoever asks, and again where its weights were replaced since."""
        if layer not in _LAYERS or not _LAYERS[layer].holds(layer):
            _LAYERS[layer] = FusedLayer(layer)
        return _LAYERS[layer]

    def holds(self, model: Any) -> bool:
        """Whether `model`'s weights are still those fused here (FusedLayer.holds, layer by layer;
        the embeddings, the final norm and the head the same tensors)."""
        inner, count = model.model, model.config.num_hidden_layers
        return (self.embed is inner.embed_tokens.weight and self.norm is inner.norm.weight
                and self.head is model.lm_head.weight and len(self.layers) == len(inner.layers[:count])
                and all(fused.holds(layer) for fused, layer in zip(self.layers, inner.layers[:count])))

    def forward(self, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: list[torch.Tensor],
                values: list[torch.Tensor], rows: torch.Tensor, slots: torch.Tensor,
                attend: Callable[..., torch.Tensor], last: bool = False, linear: Linear = F.linear,
                down: Linear | None = None) -> torch.Tensor:
        """The head's logits ([R][T][V], or [R][1][V] after each row's last token where `last`)
        after `tokens` ([R][T] int64) whose rotary embedding is `cos`, `sin` ([R][T][d]), their
        K and V written at `slots` ([R][T]) of cache rows `rows` ([R][1]) in every layer's
        `keys` and `values` ([B][H_kv][capacity][d] each), attending by `attend(q, k, v, cache_k,
        cache_v)` (q [R][H][T][d], this forward's k and v [R][H_kv][T][d], the layer's caches),
        every projection and the head through `linear` (F.linear's arguments), the MLP's down
        projection of its gate and up through `down` where given (else `linear` of swiglu's)."""
        shape = self.shape
        hidden = F.embedding(tokens, self.embed)
        cos, sin = cos[:, :, None], sin[:, :, None]  # [R][T][1][d]: one for every head
        for layer, cache_k, cache_v in zip(self.layers, keys, values):
            hidden = hidden + self._attention(layer, hidden, cos, sin, cache_k, cache_v, rows, slots, attend, linear)
            mixed = linear(_rms(hidden, layer.mlp_norm, shape.eps), layer.gate_up, layer.gate_up_bias)
            hidden = hidden + (down(mixed, layer.down, layer.down_bias) if down is not None
                               else linear(swiglu(mixed), layer.down, layer.down_bias))
        hidden = _rms(hidden[:, -1:] if last else hidden, self.norm, shape.eps)
        return linear(hidden, self.head, None)

    def _attention(self, layer: FusedLayer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache_k: torch.Tensor, cache_v: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                   attend: Callable[..., torch.Tensor], linear: Linear) -> torch.Tensor:
        shape = self.shape
        r, t = hidden.shape[:2]
        qkv = linear(_rms(hidden, layer.attention_norm, shape.eps), layer.qkv, layer.qkv_bias)
        q, k, v = qkv.split([shape.heads * shape.dim, shape.kv_heads * shape.dim, shape.kv_heads * shape.dim], -1)
        q = _rotate(q.view(r, t, shape.heads, shape.dim), cos, sin)
        k = _rotate(k.view(r, t, shape.kv_heads, shape.dim), cos, sin)
        v = v.view(r, t, shape.kv_heads, shape.dim)
        cache_k[rows, :, slots] = k  # [R][T][H_kv][d] into this forward's own slots, nothing else
        cache_v[rows, :, slots] = v
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cache_k, cache_v)  # [R][H][T][d]
        return linear(out.transpose(1, 2).reshape(r, t, shape.heads * shape.dim), layer.o, layer.o_bias)


def swiglu(mixed: torch.Tensor) -> torch.Tensor:
    """SwiGLU's product of the fused gate and up projections' output ([..., 2 x inner], the gate
    first): silu(gate) * up, [..., inner]."""
    gate, up = mixed.chunk(2, -1)
    return F.silu(gate) * up


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's arithmetic: in fp32, back to the input's dtype before the weight."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one of q, k ([R][T][heads][d])."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


_MODELS: weakref.WeakKeyDictionary[Any, FusedLlama] = weakref.WeakKeyDictionary()


def fuse(model: Any) -> FusedLlama:
    """`model`'s weights fused (see the module's docstring), the first time it is asked for and
    then the same FusedLlama, while the model's weights are those it fused (FusedLlama.holds):
    where one was replaced since, fused again (a stack made then ran the weights fused before, its
    logits another model's, silently; or met mixed dtypes after model.to); or NotFused saying why not."""
    check_fuses(model)  # first: holds() reads parts a model no longer fusing may lack (a shard's, a recurrent layer)
    if model not in _MODELS or not _MODELS[model].holds(model):
        _MODELS[model] = FusedLlama(model)
    return _MODELS[model]
