"""Random-weight Llamas for the PyTorch engine's correctness tests, its examples and its benchmark
(needs torch and transformers): what a user tests an engine against.

Nothing is downloaded: build_model makes a Llama of a SIZES shape from a config, with the
layers past the first scaled down (`residual_scale`), so that a draft of the first layer (the
self-speculative draft, memra_cuda.torch.self_draft) or a model of its own made of copies of
them (separate_draft) agrees with the target often, but not always: every figure measured on
them says so, since their acceptance is set by hand. A hybrid variant's layers HYBRID are a
gated linear recurrence (RecurrentLayer), a stand-in for a recurrent layer whose state
round-stream rolls back. static_tree is the static tree for their draft's agreement, and
parse_tree names a tree in a line, as the tree example's --tree and the benchmark's trees section
take it; benchmarks/picks.py holds the trees measured fastest on these models.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ..buffers.tree import DynamicTree, Tree, TreeShape
from .adapter import need_cuda
from .kv import head_size
from .state import Recurrent, has_recurrent

SIZES: dict[str, dict[str, Any]] = {  # the prototype model, and one about 16 times its parameters
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=8, dtype=torch.float32),
    "large": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                  num_key_value_heads=8, dtype=torch.bfloat16),
}
VOCAB = 32000  # the random-weight models' vocabulary (a Llama tokenizer's size)
PROMPT = [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203]
HYBRID = (2, 5)  # the hybrid variant's recurrent layers: the target's, past the draft's
GATE_BIAS = 3.0  # sigmoid(3) = 0.95: a recurrent state remembers about the last twenty tokens


def prompts(batch: int, seed: int = 0, shortest: int = 2, longest: int = 40) -> list[list[int]]:
    """`batch` prompts of different lengths (from `shortest` to `longest` tokens), each starting
    with BOS: requests as a server sees them."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (batch,), generator=gen).tolist()
    return [[1] + torch.randint(2, VOCAB, (n - 1,), generator=gen).tolist() for n in lengths]


def build_model(size: str = "small", *, draft_layers: int = 1, residual_scale: float = 0.01,
                logit_scale: float = 1.0, head_dim: int | None = None, recurrent_layers: Sequence[int] = (),
                seed: int = 0, device: str | torch.device = "cuda") -> LlamaForCausalLM:
    """A random-weight Llama of `size`, with layers past the first `draft_layers` scaled down.
    `logit_scale` multiplies the head's weights: random ones give logits so flat that sampling
    is near uniform; a scale of a few makes the sampled law peaked, as a trained model's is.
    `head_dim` sets a head size other than hidden_size / heads, as some configs do.
    `recurrent_layers` (the hybrid variant: HYBRID) become RecurrentLayers, scaled down alike;
    Hugging Face's own forward cannot run them, memra_cuda.torch's Stack can. It is made on
    `device`, a CUDA GPU unless another is given: where torch sees none, CudaUnavailable says so
    first (torch's own error came from deep inside the model's construction)."""
    if torch.device(device).type == "cuda":
        need_cuda(f"build_model(device={device!r})", ": device='cpu' builds it on the CPU")
    count = SIZES[size]["num_hidden_layers"]
    if any(not draft_layers <= i < count for i in recurrent_layers):
        raise ValueError(f"recurrent layers must be among layers {draft_layers}..{count - 1}, past the draft's "
                         f"{draft_layers}: the draft stays attention (it folds its last step, docs/model-side.md), "
                         f"not {tuple(recurrent_layers)}")
    shape = dict(SIZES[size], **({"head_dim": head_dim} if head_dim else {}))
    dtype = shape.pop("dtype")
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=4096, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, attn_implementation="sdpa", **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers[draft_layers:]:
                layer.self_attn.o_proj.weight.mul_(residual_scale)
                layer.mlp.down_proj.weight.mul_(residual_scale)
            model.lm_head.weight.mul_(logit_scale)
            for i in recurrent_layers:
                model.model.layers[i] = RecurrentLayer(model.model.layers[i], config, residual_scale)
    return _for_inference(model.to(dtype))


def _for_inference(model: Any) -> Any:
    """Eval mode, no autograd graph kept alive by the caches, and greedy run to the budget unless
    an EOS is asked for."""
    model = model.eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def separate_draft(target: LlamaForCausalLM, layers: int = 2, dtype: torch.dtype = torch.bfloat16
                   ) -> LlamaForCausalLM:
    """A draft model of its own for a build_model target: a config of `layers` layers and
    parameters of its own in `dtype`, holding copies of the target's embeddings, first `layers`
    layers, final norm and head, so that it agrees with the target often (the target's layers
    past the first are scaled down) while it shares no module, and so no cache, with it: the
    stand-in of a trained draft (a model with its own prefill, graphs, dtype and layer count)."""
    if has_recurrent(target.model.layers[:layers]):
        raise ValueError(f"the target's first {layers} layers must be attention to make a draft of")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    with torch.device(target.device):
        draft = LlamaForCausalLM(config)
    for mine, theirs in ((draft.model.embed_tokens, target.model.embed_tokens), (draft.model.norm, target.model.norm),
                         (draft.lm_head, target.lm_head), *zip(draft.model.layers, target.model.layers)):
        mine.load_state_dict(theirs.state_dict())
    return _for_inference(draft.to(dtype))


class RecurrentLayer(Recurrent):
    """A decoder layer whose attention is a gated linear recurrence (random weights), between the
    Llama layer's own norms and MLP. Per head, with x_t the normed input:

        g_t = sigmoid(w_g x_t + b_g),   S_t = g_t S_{t-1} + k_t^T v_t,   o_t = q_t S_t / sqrt(d_k)

    with q, k (d_k) and v (d_v = d_k) projections of x_t, S a d_k × d_v matrix (heads × d_k × d_v
    a row, fp32 whatever the model's dtype) and o_t, over the heads, through an output
    projection scaled down like the other layers past the draft's. A stand-in for Mamba or a
    gated delta net: the state after every token exists, which is what rollback needs.
    """

    def __init__(self, layer: torch.nn.Module, config: LlamaConfig, out_scale: float):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.mlp = layer.mlp
        self.heads, self.d_k, self.d_v = config.num_attention_heads, head_size(config), head_size(config)
        self.state_shape = (self.heads, self.d_k, self.d_v)
        hidden, std = config.hidden_size, config.initializer_range
        self.q_proj = torch.nn.Linear(hidden, self.heads * self.d_k, bias=False)
        self.k_proj = torch.nn.Linear(hidden, self.heads * self.d_k, bias=False)
        self.v_proj = torch.nn.Linear(hidden, self.heads * self.d_v, bias=False)
        self.gate = torch.nn.Linear(hidden, self.heads)
        self.o_proj = torch.nn.Linear(self.heads * self.d_v, hidden, bias=False)
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.gate):
            torch.nn.init.normal_(linear.weight, std=std)
        torch.nn.init.constant_(self.gate.bias, GATE_BIAS)
        torch.nn.init.normal_(self.o_proj.weight, std=std * out_scale)

    def forward(self, hidden: torch.Tensor, state: torch.Tensor,
                store: Callable[[int, torch.Tensor], None] | None = None,
                active: torch.Tensor | None = None,
                parents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Recurrent's contract: token by token, as a decoder steps, so the state after every
        token exists; a garbage parent is clamped to an earlier token."""
        x = self.input_layernorm(hidden)
        rows, tokens, _ = x.shape
        q = (self.q_proj(x).float() * self.d_k ** -0.5).view(rows, tokens, self.heads, 1, self.d_k)
        k = self.k_proj(x).float().view(rows, tokens, self.heads, self.d_k, 1)
        v = self.v_proj(x).float().view(rows, tokens, self.heads, 1, self.d_v)
        g = torch.sigmoid(self.gate(x).float()).view(rows, tokens, self.heads, 1, 1)
        if parents is not None:
            every = torch.arange(rows, device=x.device)
            parents = parents.long()
            after_node = torch.empty(rows, tokens, *state.shape[1:], device=x.device)
        out = []
        for t in range(tokens):
            if parents is not None and t:
                state = after_node[every, parents[:, t].clamp(0, t - 1)]
            after = g[:, t] * state + k[:, t] * v[:, t]
            state = after if active is None else torch.where(active[:, t, None, None, None], after, state)
            if parents is not None:
                after_node[:, t] = state
            if store is not None:
                store(t, state)
            out.append(q[:, t] @ state)  # [R][heads][1][d_v]
        mixed = torch.stack(out, 1).view(rows, tokens, self.heads * self.d_v).to(hidden.dtype)
        hidden = hidden + self.o_proj(mixed)
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), state


# -- trees ------------------------------------------------------------------------------------

RANKS = 4  # the most candidates a node of static_tree has


def static_tree(size: int, depth: int = 10) -> TreeShape:
    """The static tree of `size` drafts, at most `depth` deep, for these models: the likeliest
    nodes for a draft whose best candidate is right 87% of the time and its second best 13% (0.15
    times as often), the self-speculative draft's rates on CPU (benchmarks/RESULTS.md, "Dynamic trees")."""
    return TreeShape.likeliest(size, depth=depth, right=0.87, fall=0.15, ranks=RANKS)


def parse_tree(text: str) -> Tree:
    """"static:N" or "static:N,DEPTH" (static_tree of N drafts), "chain:K,LEAVES"
    (TreeShape.chain_with_leaves) or "dynamic:D,W,B" (DynamicTree); what is no str is a
    TypeError naming the forms (5 met "'int' object has no attribute 'partition'")."""
    if not isinstance(text, str):
        raise TypeError(f'a tree is "static:N[,DEPTH]", "chain:K,LEAVES" or "dynamic:DEPTH,WIDTH,BRANCH" (a str), '
                        f"not {text!r}")
    kind, _, spec = text.partition(":")
    try:
        numbers = [int(x) for x in spec.split(",")]
    except ValueError:
        numbers = []
    if kind == "static" and len(numbers) in (1, 2):
        return static_tree(*numbers)
    if kind == "chain" and len(numbers) == 2:
        return TreeShape.chain_with_leaves(*numbers)
    if kind == "dynamic" and len(numbers) == 3:
        return DynamicTree(*numbers)
    raise ValueError(f'a tree is "static:N[,DEPTH]", "chain:K,LEAVES" or "dynamic:DEPTH,WIDTH,BRANCH", not {text!r}')
