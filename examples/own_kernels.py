"""A first token of your own model: your CUDA C, compiled with memra_cuda.compile_ptx, decoded
speculatively through RoundStream and checked against its own greedy decoding.

A tiny model with a KV cache: the token after t at position p hashes a table row (the
"weights"), p and the cache's last entry; the draft is the same model, wrong at a quarter of
the positions. A wrong position or rollback changes the output. docs/model-side.md is the contract.

    pip install '.[nvrtc]'              # in memra_cuda's checkout: NVRTC, for compile_ptx
    python examples/own_kernels.py [--k 4] [--m-rounds 8] [--mode graph] [--tokens 64] [--prompt ID ...]

Exit status 0 on a match, 1 otherwise (or without a GPU or NVRTC, said in one line), 2 for an
option out of range (a prompt's token id past the vocabulary, a negative k, no rounds a burst).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import numpy as np

from memra_cuda import Geometry
from memra_cuda import (Cache, DeviceBuffer, Engine, Greedy, KVLayer, Mode, Module, RoundStream, StreamBufs,
                        compile_ptx, kv_capacity, kv_len_ptr_table)
from memra_cuda.buffers import i32_kv_capacity
from memra_cuda.driver import Signature
from memra_cuda.errors import CudaUnavailable, NvrtcUnavailable

SOURCE = r"""
typedef unsigned int u32;
__device__ u32 fmix(u32 h) { h ^= h >> 16; h *= 0x85ebca6bu; h ^= h >> 13; h *= 0xc2b2ae35u; return h ^ (h >> 16); }

// k + 1 tokens of row b at positions pos[b] + i, one thread a row. Each reads the last of its
// cache's entries [0, len), appends itself (clamped to the capacity) and predicts the next token.
// The verify (draft = 0) reads vtok (tokens) and writes pred[0..k]; the draft chain reads pend
// (tokens), then its own guesses, and writes draft[0..k): its last step only appends.
extern "C" __global__ void model(u32 draft, u32 vocab, u32 k, u32 cap, const u32* table, const u32* tokens,
                                 const int* pos, u32* out, u32* kv, int* len) {
    const u32 b = blockIdx.x;
    tokens += draft ? b : b * (k + 1);
    out += draft ? b * max(k, 1u) : b * (k + 1);
    kv += (size_t)b * cap;
    u32 t = tokens[0], p = pos[b], n = len[b];
    for (u32 i = 0; i <= k; ++i, ++p) {
        const u32 last = n > 0 && n <= cap ? kv[n - 1] : 0;
        if (p < cap) kv[p] = t;
        n = p + 1;
        u32 next = fmix(table[t % vocab] ^ p ^ last * 0x9e3779b1u) % vocab;
        if (draft && fmix(p ^ 0x5bd1e995u) % 4 == 0) next = (next + 1) % vocab;  // the draft errs
        if (!draft || i < k) out[i] = next;
        if (i < k) t = draft ? next : tokens[i + 1];
    }
    len[b] = min(n, cap);
}
"""
# The kernel's parameters as the source declares them: a launch prepared with other types (a u32
# for a pointer, an i32 for a u32) is refused at prepare, naming the parameter, and its arguments
# are set by these names, so two u32s swapped (k and cap) cannot pass as each other.
SIGNATURES = {"model": Signature.of(draft="u32", vocab="u32", k="u32", cap="u32", table="ptr", tokens="ptr",
                                    pos="ptr", out="ptr", kv="ptr", len="ptr")}
VOCAB, PROMPT = 1000, [17, 423, 9, 871]
TABLE = np.random.default_rng(7).integers(0, 2**32, VOCAB, dtype=np.uint32)


def fmix(h: int) -> int:
    for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        h = ((h ^ (h >> shift)) * mul) & 0xFFFFFFFF
    return h ^ (h >> 16)


def greedy(prompt: list[int], new_tokens: int) -> list[int]:
    """The target's own greedy decoding, a token at a time on the host."""
    tokens = list(prompt)
    for p in range(len(prompt) - 1, len(prompt) - 1 + new_tokens):
        last = tokens[p - 1] if p else 0
        tokens.append(fmix(int(TABLE[tokens[p]]) ^ p ^ (last * 0x9E3779B1 & 0xFFFFFFFF)) % VOCAB)
    return tokens[len(prompt):]


def decode(engine: Engine, prompt: list[int], new_tokens: int, k: int, m_rounds: int,
           mode: str = "graph") -> tuple[list[int], str]:
    """`new_tokens` tokens after `prompt`, decoded speculatively; and a line on how it went."""
    module = Module(engine, compile_ptx(SOURCE, name="model.cu"), SIGNATURES)
    geometry = Geometry(k, m_rounds)  # the rounds' shape, which the caches and the buffers are sized by
    capacity, table_d = kv_capacity(len(prompt), new_tokens, geometry, overlap=mode == "overlap"), engine.htod(TABLE)
    # Each model's KV cache: the entries its kernel writes, and their count (len_d), which rollback rewinds.
    target_entries, draft_entries = engine.zeros(np.uint32, capacity), engine.zeros(np.uint32, capacity)
    target = KVLayer(engine.zeros(np.int32, 1), capacity, target_entries)
    draft = KVLayer(engine.zeros(np.int32, 1), capacity, draft_entries)
    bufs = StreamBufs(engine, geometry)
    draft_d, pred_d = engine.zeros(np.uint32, max(k, 1)), engine.zeros(np.uint32, k + 1)

    def run(is_draft: int, tokens: DeviceBuffer, position: DeviceBuffer, out: DeviceBuffer,
            kv: KVLayer) -> Callable[[], None]:
        """One launch of `model`: the draft chain (is_draft 1) or the verify trunk (0)."""
        return module.kernel("model").prepare(grid=bufs.batch).set(
            draft=is_draft, vocab=VOCAB, k=k, cap=capacity, table=table_d, tokens=tokens, pos=position, out=out,
            kv=kv.data_d, len=kv.len_d)

    rounds = RoundStream(bufs, draft_chain=run(1, bufs.pend_d, bufs.pos_ctr_d, draft_d, draft),
                         verify_trunk=run(0, bufs.vtok_d, bufs.pos_start_d, pred_d, target),
                         draft_d=draft_d, acceptance=Greedy(pred_d),
                         rollback_tables=[kv_len_ptr_table(engine, Cache([target, draft]), pos_ctr=bufs.pos_ctr_d)])
    for entries, kv in ((target_entries, target), (draft_entries, draft)):  # prefill: the prompt but its last token
        engine.copy_htod(entries, prompt[:-1])
        engine.copy_htod(kv.len_d, [len(prompt) - 1])
    bufs.reset(prompt[-1], len(prompt) - 1)  # the last prompt token is pending, at that position
    tokens = rounds.generate(new_tokens, mode=mode).tolist()
    accepted, drafted = bufs.drafts_accepted(len(tokens))
    return tokens, (f"k={k} M={m_rounds} {mode}: {len(tokens)} tokens in {rounds.rounds} rounds and "
                    f"{rounds.bursts} readbacks, {accepted} of {drafted} drafts accepted")


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(prog="examples/own_kernels.py",
                                  description="Your own CUDA C model, decoded speculatively and checked against "
                                              "its own greedy decoding.")
    cli.add_argument("--k", type=int, default=4, help="draft tokens per round (default: %(default)s)")
    cli.add_argument("--m-rounds", type=int, default=8, metavar="M", help="rounds per burst (default: %(default)s)")
    cli.add_argument("--mode", choices=[mode.value for mode in Mode], default="graph",
                     help="how the rounds are issued (default: %(default)s)")
    cli.add_argument("--tokens", type=int, default=64, help="tokens to generate (default: %(default)s)")
    cli.add_argument("--prompt", type=int, nargs="+", default=PROMPT, metavar="ID",
                     help=f"the prompt's token ids, each below {VOCAB} (default: {' '.join(map(str, PROMPT))})")
    args = cli.parse_args(argv)
    # What the options get wrong is the parser's error (exit status 2), said before any GPU work: a
    # token id past the vocabulary failed after decoding (the greedy check indexes TABLE by it, where
    # the kernel wraps it), a negative one at the copy (no u32), and Geometry's refusal of --k or
    # --m-rounds was a traceback from inside the engine.
    outside = [token for token in args.prompt if not 0 <= token < VOCAB]
    if outside:
        cli.error(f"--prompt takes token ids from 0 to {VOCAB - 1}, not {' '.join(map(str, outside))}")
    try:
        geometry = Geometry(args.k, args.m_rounds)
    except ValueError as exc:  # its errors name k and m_rounds, as the demo's: the options are --k and --m-rounds
        cli.error(f"--k {args.k} --m-rounds {args.m_rounds}: {exc}")
    try:  # the caches' positions are i32s (a KVLayer's count): past them, KVLayer refused the caches only after
        # the engine had compiled the model and been asked for them (tens of GB), a traceback
        i32_kv_capacity(len(args.prompt), args.tokens, geometry, overlap=args.mode == "overlap", what="--tokens")
    except ValueError as exc:
        cli.error(str(exc))
    try:
        with Engine() as engine:
            tokens, summary = decode(engine, args.prompt, args.tokens, args.k, args.m_rounds, args.mode)
    except (CudaUnavailable, NvrtcUnavailable) as exc:  # no GPU or NVRTC: one line
        print(f"own_kernels: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    matches = tokens == greedy(args.prompt, args.tokens)
    print(f"{summary}\nfirst tokens {tokens[:10]}\nmatches its own greedy decoding: {'yes' if matches else 'NO'}")
    return 0 if matches else 1


if __name__ == "__main__":
    sys.exit(main())
