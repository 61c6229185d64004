"""A real transformer decoding through round-stream: a Llama-architecture model from
`transformers` with a self-speculative draft, greedy, on one PyTorch stream.

The model is built from a config with random weights (nothing is downloaded). Its draft is
honestly part of it: the same embeddings, first decoder layer(s), final norm and head; the
target's remaining layers have their residual contributions (o_proj, down_proj) scaled down,
so the draft agrees with the target often but not always. Both keep a static KV cache whose
per-layer lengths are device int32 tensors registered with round-stream as KVLayers, and every
position they use is read on the device, so a whole burst of rounds can be captured.

    PYTHONPATH=. python examples/torch_llama.py [--size small|large] [--tokens 256] [--k 4]
                                                [--m-rounds 16] [--mode graph] [--eos ID]

`make bench-torch` times it against Hugging Face generate, assisted generation with the same
draft, and plain greedy decoding captured with torch.cuda.graph.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from typing import Iterator, Sequence

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memra_cuda import Cache, Greedy, KVLayer, RoundStream, SpecKernels, StreamBufs, kv_capacity, kv_len_ptr_table
from memra_cuda import torch as memra_torch
from memra_cuda.layout import CTL_DONE

SIZES = {  # the issue's prototype model, and one about 16 times its parameters
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=8, dtype=torch.float32),
    "large": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                  num_key_value_heads=8, dtype=torch.bfloat16),
}
PROMPT = [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203]


def build_model(size: str = "small", *, draft_layers: int = 1, residual_scale: float = 0.01,
                seed: int = 0) -> LlamaForCausalLM:
    """A random-weight Llama of `size` on the GPU, with layers past the draft's scaled down."""
    shape = dict(SIZES[size])
    dtype = shape.pop("dtype")
    config = LlamaConfig(vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, attn_implementation="sdpa", **shape)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers[draft_layers:]:
            layer.self_attn.o_proj.weight.mul_(residual_scale)
            layer.mlp.down_proj.weight.mul_(residual_scale)
    model = model.to(dtype).eval()
    model.generation_config.eos_token_id = None  # greedy runs to the budget unless an EOS is asked for
    model.generation_config.pad_token_id = 0
    return model


def draft_model(model: LlamaForCausalLM, draft_layers: int = 1) -> LlamaForCausalLM:
    """The draft as a model of its own (for Hugging Face's assisted generation): the target's
    own modules, first `draft_layers` layers only."""
    config = LlamaConfig(**{**model.config.to_dict(), "num_hidden_layers": draft_layers})
    with torch.device("meta"):
        draft = LlamaForCausalLM(config)
    draft.model.embed_tokens = model.model.embed_tokens
    draft.model.layers = torch.nn.ModuleList(model.model.layers[:draft_layers])
    draft.model.norm, draft.model.rotary_emb, draft.lm_head = model.model.norm, model.model.rotary_emb, model.lm_head
    draft.generation_config = copy.deepcopy(model.generation_config)
    return draft.eval()


class StaticKV:
    """K and V for `n_layers` layers at fixed addresses, written at device positions.

    Hugging Face's attention calls update(k, v, layer) with the new entries; they land at
    `positions` (set by the caller for this forward) and the whole cache comes back, masked by
    the caller. `lengths` (int32, one per layer) counts each layer's entries: round-stream's
    rollback rewrites them, which is all it takes to forget rejected drafts.
    """

    def __init__(self, config: LlamaConfig, n_layers: int, capacity: int, dtype: torch.dtype):
        heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
        self.k = torch.zeros(n_layers, 1, heads, capacity, dim, dtype=dtype, device="cuda")
        self.v = torch.zeros_like(self.k)
        self.lengths = torch.zeros(n_layers, dtype=torch.int32, device="cuda")
        self.capacity = capacity
        self.positions = torch.zeros(1, dtype=torch.long, device="cuda")

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int, *args, **kwargs):
        self.k[layer].index_copy_(2, self.positions, key)
        self.v[layer].index_copy_(2, self.positions, value)
        return self.k[layer], self.v[layer]

    def cache(self) -> Cache:
        return Cache([KVLayer(self.lengths[i:i + 1], self.capacity) for i in range(len(self.lengths))])

    def copy_from(self, other: StaticKV) -> None:
        """`other`'s first layers, entries and lengths (what a stack of those same layers would
        compute over the same tokens)."""
        n = len(self.lengths)
        self.k.copy_(other.k[:n])
        self.v.copy_(other.v[:n])
        self.lengths.copy_(other.lengths[:n])


class Stack:
    """Embeddings, the first `n_layers` decoder layers, final norm and head of a Llama, run
    over a StaticKV at positions held on the device: append(tokens, positions) adds the
    tokens' KV and returns their last hidden states; greedy() also applies the head and
    returns the next-token ids. No value is read on the host."""

    def __init__(self, model: LlamaForCausalLM, n_layers: int, capacity: int):
        self.model = model
        self.layers = model.model.layers[:n_layers]
        self.kv = StaticKV(model.config, n_layers, capacity, model.dtype)
        self.slots = torch.arange(capacity, device="cuda")
        # The rotary embedding of every position, computed once by the model's own module (the
        # same numbers it computes per call): a step then gathers two rows instead of
        # recomputing them, a dozen fewer kernels per step.
        dummy = torch.zeros(1, 1, 1, dtype=model.dtype, device="cuda")
        self.cos, self.sin = model.model.rotary_emb(dummy, self.slots[None])
        self.prompt = torch.zeros(capacity, dtype=torch.long, device="cuda")
        self.prefills: dict[int, torch.cuda.CUDAGraph] = {}  # prompt length bucket -> its graph

    def greedy(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The next token after each of `tokens`."""
        return self.model.lm_head(self.append(tokens, positions)).argmax(-1)

    def greedy_last(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The next token after the last of `tokens` (the head runs on one row)."""
        return self.model.lm_head(self.append(tokens, positions)[-1:]).argmax(-1)

    def append(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        inner = self.model.model
        positions = positions.long().clamp(0, self.kv.capacity - 1)  # a garbage position never writes outside
        hidden = inner.embed_tokens(tokens.long())[None]
        position_ids = positions[None]
        rope = self.cos[:, positions], self.sin[:, positions]
        mask = (self.slots[None, :] <= positions[:, None])[None, None]  # causal over the absolute positions
        self.kv.positions = positions
        for layer in self.layers:
            out = layer(hidden, attention_mask=mask, position_ids=position_ids, past_key_values=self.kv,
                        use_cache=True, cache_position=positions, position_embeddings=rope)
            hidden = out[0] if isinstance(out, tuple) else out
        self.kv.lengths.copy_((positions[-1] + 1).to(torch.int32).expand_as(self.kv.lengths))
        return inner.norm(hidden)[0]

    def prefill(self, tokens: Sequence[int]) -> None:
        """The prompt's KV at positions 0.. (lengths become len(tokens)).

        Run eagerly, a short prompt's prefill is mostly the host launching a few hundred
        kernels (10 ms here, against 1 ms on the GPU), so it is a graph, captured once for every
        power-of-two length. The padding's entries, past the prompt, are rewritten before any
        position reads them."""
        n = len(tokens)
        if n > self.kv.capacity:
            raise ValueError(f"a prompt of {n} tokens does not fit a cache of {self.kv.capacity}")
        if n:
            bucket = min(1 << (n - 1).bit_length(), self.kv.capacity)
            self.prompt[:n].copy_(torch.tensor(tokens))
            if bucket not in self.prefills:
                self.append(self.prompt[:bucket], self.slots[:bucket])  # torch's lazy set-up, off the graph
                self.prefills[bucket] = graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self.append(self.prompt[:bucket], self.slots[:bucket])
            self.prefills[bucket].replay()
        self.kv.lengths.fill_(n)


class SpeculativeLlama:
    """Target and draft Stacks wired to a RoundStream on one torch stream.

    The draft chain runs k draft steps from the pending token at pos_ctr; the verify trunk runs
    the target over vtok at pos_start. Both run on the engine's stream whichever stream the
    caller is on, write int64 ids (argmax's own type) straight into the token buffers
    round-stream reads, and read every position from round-stream's device buffers.

    The draft's KV of the last draft token is missing after a round that accepted every draft.
    Instead of a (k+1)-th draft step for it every round (README: the model's side), the
    first step appends the token behind the pending one along with it: vtok_d[acc_d[0]] at
    pos_ctr - 1, which is that draft or, in any other round, a token whose entry it rewrites
    unchanged. A step over two tokens costs little more than over one.
    """

    def __init__(self, model: LlamaForCausalLM, *, k: int = 4, m_rounds: int = 16, capacity: int = 1024,
                 draft_layers: int = 1):
        self.model, self.k = model, k
        self.stream = torch.cuda.Stream()
        with torch.cuda.stream(self.stream):
            self.engine = memra_torch.engine()
            self.target = Stack(model, model.config.num_hidden_layers, capacity)
            self.draft = Stack(model, draft_layers, capacity)
            self.bufs = StreamBufs(self.engine, k, m_rounds)
            self.pend = memra_torch.tensor(self.bufs.pend_d, torch.int32)
            self.pos_ctr = memra_torch.tensor(self.bufs.pos_ctr_d)
            self.pos_start = memra_torch.tensor(self.bufs.pos_start_d)
            self.vtok = memra_torch.tensor(self.bufs.vtok_d, torch.int32)
            self.accepted = memra_torch.tensor(self.bufs.acc_d, torch.int32)[:1]  # drafts accepted last round
            self.done = memra_torch.tensor(self.bufs.ctl_d)[CTL_DONE:CTL_DONE + 1]
            self.draft_d = torch.zeros(max(k, 1), dtype=torch.long, device="cuda")
            self.pred_d = torch.zeros(k + 1, dtype=torch.long, device="cuda")
            self.steps = torch.arange(k + 1, device="cuda")
            table = kv_len_ptr_table(self.engine, self.target.kv.cache() + self.draft.kv.cache(),
                                     pos_ctr=self.bufs.pos_ctr_d)
            self.rounds = RoundStream(SpecKernels(self.engine), self.bufs, draft_chain=self.draft_chain,
                                      verify_trunk=self.verify_trunk, draft_d=self.draft_d,
                                      acceptance=Greedy(self.pred_d), rollback_tables=[table],
                                      capture=memra_torch.capture)
            # One eager round, so torch's lazy set-up (library handles, workspaces) happens before
            # any capture; the next prefill resets everything it touched.
            self.prefill([0, 0])
            self.rounds.issue_round()

    def draft_chain(self) -> None:
        if not self.k:
            return  # nothing to draft, and no draft KV is ever read
        with torch.cuda.stream(self.stream):
            positions = self.pos_ctr.long() + self.steps
            # No token behind the pending one to append: at position 0, or when the row is done
            # (its entries stay as they are). Then the pending token fills both rows.
            lone = (self.done != 0) | (positions[:1] == 0)
            behind = torch.where(lone, self.pend, torch.index_select(self.vtok, 0, self.accepted))
            token = self.draft.greedy_last(torch.cat([behind, self.pend]),
                                           torch.cat([positions[:1] - 1 + lone, positions[:1]]))
            self.draft_d[:1].copy_(token)
            for step in range(1, self.k):
                token = self.draft.greedy(token, positions[step:step + 1])
                self.draft_d[step:step + 1].copy_(token)

    def verify_trunk(self) -> None:
        with torch.cuda.stream(self.stream):
            self.pred_d.copy_(self.verify(self.vtok, self.pos_start + self.steps))

    def verify(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The target's next token after each of the k+1 tokens. Its GEMMs have k+1 rows, a
        shape cuBLAS's own fp32 kernels serve at twice a one-row GEMV's time; cuBLASLt's
        kernels take a verify of 5 tokens from 1.18 to 1.10 target steps (H200, small model)."""
        with blas("cublaslt"):
            return self.target.greedy(tokens, positions)

    def prefill(self, prompt: Sequence[int]) -> int:
        """Both caches take the prompt but its last token, which becomes pending. reset zeroes
        acc_d, so the first draft step reads vtok_d[0] as the token behind the pending one:
        the prompt's last but one."""
        with torch.cuda.stream(self.stream):
            self.target.prefill(prompt[:-1])
            self.draft.kv.copy_from(self.target.kv)  # the draft's layers are the target's first
            self.bufs.reset(self.engine, prompt[-1], len(prompt) - 1)
            if len(prompt) > 1:
                self.vtok[:1].fill_(prompt[-2])
        return len(prompt) - 1

    def generate(self, prompt: Sequence[int], max_new_tokens: int, *, eos: int | None = None,
                 mode: str = "graph") -> list[int]:
        start = self.prefill(prompt)
        with torch.cuda.stream(self.stream):
            return self.rounds.generate(start, max_new_tokens, eos=eos, mode=mode).tolist()

    def acceptance(self, committed: int) -> float:
        accepted, drafted = self.bufs.drafts_accepted(self.engine, committed)
        return accepted / drafted if drafted else 1.0


@contextlib.contextmanager
def blas(library: str) -> Iterator[None]:
    """torch's preferred BLAS library ("cublas", "cublaslt") for the kernels issued inside."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def capacity_for(prompt_len: int, tokens: int, k: int, m_rounds: int) -> int:
    return kv_capacity(prompt_len, tokens, k, m_rounds, overlap=True)


def hf_greedy(model: LlamaForCausalLM, prompt: Sequence[int], max_new_tokens: int, eos: int | None = None,
              assistant: LlamaForCausalLM | None = None, k: int = 4) -> list[int]:
    """Hugging Face's own greedy decoding (assisted by `assistant`, k tokens at a time, if given)."""
    ids = torch.tensor([list(prompt)], device="cuda")
    extra = {}
    if assistant is not None:
        config = assistant.generation_config
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"
        config.assistant_confidence_threshold = 0.0
        extra["assistant_model"] = assistant
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=0, do_sample=False, eos_token_id=eos, pad_token_id=0, **extra)
    return out[0, len(prompt):].tolist()


class GraphedGreedy:
    """Plain greedy decoding, one token per step, the step captured once with torch.cuda.graph
    and replayed; the host reads each token back (as an engine streaming tokens would)."""

    def __init__(self, model: LlamaForCausalLM, capacity: int):
        self.stream = torch.cuda.Stream()
        self.stack = Stack(model, model.config.num_hidden_layers, capacity)
        self.token = torch.zeros(1, dtype=torch.long, device="cuda")
        self.position = torch.zeros(1, dtype=torch.long, device="cuda")
        self.graph: torch.cuda.CUDAGraph | None = None

    def _step(self) -> None:
        self.token.copy_(self.stack.greedy(self.token, self.position))
        self.position.add_(1)

    def generate(self, prompt: Sequence[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
        with torch.cuda.stream(self.stream):
            self.stack.prefill(prompt[:-1])
            self.token.fill_(prompt[-1])
            self.position.fill_(len(prompt) - 1)
            if self.graph is None:
                self._step()  # warm-up off the graph, then undo it
                self.position.fill_(len(prompt) - 1)
                self.token.fill_(prompt[-1])
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, stream=self.stream):
                    self._step()
            out: list[int] = []
            while len(out) < max_new_tokens:
                self.graph.replay()
                out.append(int(self.token.item()))
                if out[-1] == eos:
                    break
            return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--m-rounds", type=int, default=16)
    parser.add_argument("--mode", choices=["readback", "stream", "graph", "overlap"], default="graph")
    parser.add_argument("--eos", type=int, default=None)
    args = parser.parse_args(argv)
    model = build_model(args.size)
    spec = SpeculativeLlama(model, k=args.k, m_rounds=args.m_rounds,
                            capacity=capacity_for(len(PROMPT), args.tokens, args.k, args.m_rounds))
    got = spec.generate(PROMPT, args.tokens, eos=args.eos, mode=args.mode)
    print(f"{args.size} model, k={args.k}, M={args.m_rounds}, {args.mode}: {len(got)} tokens, "
          f"acceptance {spec.acceptance(len(got)):.2f}")
    print(got[:32], "..." if len(got) > 32 else "")
    if model.dtype == torch.float32:
        want = hf_greedy(model, PROMPT, args.tokens, args.eos)
        print(f"equals Hugging Face greedy: {'yes' if got == want else 'NO'}")
        return 0 if got == want else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
