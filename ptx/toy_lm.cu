// The toy language model (docs/toy-model.md, "Definition"), mirrored by memra_cuda/testing/toy/lm.py.
//
// Batched as the round-stream buffers are (docs/buffers.md, "Batched layout"): the draft step and
// the verify run one block per sequence (blockIdx.x is the row), every KV layer holds `capacity`
// entries per row ([B][capacity]) and one length per row (i32[B]).
//
// A pipeline stage holds the target layers [layer0, layer0 + n_layers) of the model ("Pipeline
// stages on several GPUs"): salts use the absolute layer index, and the verify of a stage that
// is not the last passes on its partial sums over layers (one u32 per token: the activation)
// instead of predictions; the next stage adds them to its own.
//
// Its next token depends on every KV entry and every word of recurrent state, so a wrong rollback
// or position changes the output, and its work is spread over a block so a round costs little more
// than its launches: it exists to expose the round-stream machinery's overhead. All arithmetic is
// u32 and wraps; the sums over layers and entries are therefore one block-wide reduction each. KV
// appends are clamped to the cache capacity: garbage positions produce garbage tokens, never a write
// outside a buffer.
//
// Recurrent layers (the bits of rec_mask) are rolled back by state (docs/model-side.md, "Recurrent
// state"): each model (target, draft) finds its states through address tables, per recurrent layer
// r its slots and, rolled back by copy, its live state (see StateRow). Word w of layer r is thread
// r * words + w's sequential chain, so n_rec * words <= BLOCK (ToyLM checks).

#include "layout.cuh"
#include "philox.cuh"

#define BLOCK 512  // every block-wide kernel is launched with this many threads

__device__ __forceinline__ u32 fmix(u32 h) {
    h ^= h >> 16; h *= 0x85ebca6bu; h ^= h >> 13; h *= 0xc2b2ae35u; h ^= h >> 16;
    return h;
}
__device__ __forceinline__ u32 embed(u32 t, u32 j, u32 seed) { return fmix(t * 0x9E3779B1u + j * 0x85EBCA77u + seed); }
__device__ __forceinline__ u32 salt(u32 l) { return fmix(0x27d4eb2fu * (l + 1)); }

// Sampling mode (docs/toy-model.md, "Sampling mode"): the next-token distribution at hash state h
// is a mixture, `floor` on every token plus weight c[j] on candidate j = fmix(h ^ j * 0x27d4eb2f) %
// vocab, whose first is the greedy token fmix(h) % vocab. The host sets floor = eps / vocab and
// c = (1 - eps) softmax(-j / temperature), so the weights sum to one without a pass over V.
#define CANDIDATES 4

struct Mixture {
    u32 token[CANDIDATES];
    float weight[CANDIDATES];
    float floor;
};

__device__ __forceinline__ Mixture mixture(u32 h, u32 vocab, float floor, float c0, float c1, float c2, float c3) {
    Mixture m = {{0, 0, 0, 0}, {c0, c1, c2, c3}, floor};
    for (u32 j = 0; j < CANDIDATES; ++j) m.token[j] = fmix(h ^ j * 0x27d4eb2fu) % vocab;
    return m;
}

__device__ __forceinline__ float mixture_prob(const Mixture& m, u32 v) {
    float p = m.floor;
    for (u32 j = 0; j < CANDIDATES; ++j)
        if (v == m.token[j]) p += m.weight[j];
    return p;
}

// Word w of a recurrent layer (salt `layer_salt`) after the token of embedding e.
__device__ __forceinline__ u32 recur(u32 s, u32 e, u32 layer_salt, u32 w) { return fmix(s + fmix(e ^ layer_salt) + w); }

// The index of the r-th set bit of mask (r < popc(mask)): recurrent layer r's place among the layers.
__device__ __forceinline__ u32 nth_bit(u32 mask, u32 r) {
    for (; r; --r) mask &= mask - 1;
    return __ffs(mask) - 1;
}

// Where row b of recurrent layer r reads its state and writes the round's. slots[r] holds
// [B][n_slots][words]. Rolled back by copy (idx null): n_slots = k + 1, the state is live[r]
// ([B][words]) and the round writes slots 0..k. By flip (idx non-null, one u32 a row for the
// model): n_slots = 2(k + 1), the state is slot idx[b] and the round writes the other bank, with
// kernel 9's bank rule, so a garbage idx still reads and writes inside the row's slots.
struct StateRow {
    const u32* from;  // the state the round starts from
    u32* to;          // slot 0 of the bank the round writes: slot i (after token i) at to + i * words
};

__device__ __forceinline__ StateRow state_row(const u64* live, const u64* slots, const u32* idx, u32 r, u32 b,
                                              u32 k1, u32 words) {
    if (!idx) return {(const u32*)live[r] + (u64)b * words, (u32*)slots[r] + (u64)b * k1 * words};
    u32* row = (u32*)slots[r] + (u64)b * 2 * k1 * words;
    const u32 at = idx[b], bank = min(at / k1, 1u);
    return {row + (u64)(bank * k1 + at % k1) * words, row + (u64)(1 - bank) * k1 * words};
}

// Wrapping sum of one value per thread over the block; every thread gets the total.
__device__ u32 block_sum(u32 v) {
    __shared__ u32 warp_sums[BLOCK / 32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
    __syncthreads();
    u32 total = 0;
    for (int w = 0; w < BLOCK / 32; ++w) total += warp_sums[w];
    __syncthreads();
    return total;
}

// Row `row`'s entries t_0..t_{n-1} into every target KV layer and the draft's layer (if this
// stage has the draft: draft_data non-null); its lengths become n (n <= capacity, checked by the
// launcher).
extern "C" __global__ void toy_prefill(const u32* tokens, u32 n, u32 row, u32 capacity, const u64* tgt_data,
                                       const u64* tgt_len, u32 n_layers, u32 layer0, u32* draft_data, int* draft_len,
                                       u32 seed) {
    const u64 base = (u64)row * capacity;
    for (u32 j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x) {
        const u32 e = embed(tokens[j], j, seed);
        if (draft_data) draft_data[base + j] = e;
        for (u32 l = 0; l < n_layers; ++l)
            if (tgt_data[l]) ((u32*)tgt_data[l])[base + j] = fmix(e ^ salt(layer0 + l));
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        if (draft_len) draft_len[row] = (int)n;
        for (u32 l = 0; l < n_layers; ++l)
            if (tgt_len[l]) ((int*)tgt_len[l])[row] = (int)n;
    }
}

// One model's recurrent states of row `row` after the prompt but its last token, t_0..t_{n-1} (from
// zero), where the first round reads them: live[r] (copy), or slot 0 with idx[row] = 0 (flip). One
// block; the prefill of the target and of the draft (its own copy) are a launch each.
extern "C" __global__ void __launch_bounds__(BLOCK) toy_prefill_state(
        const u32* tokens, u32 n, u32 row, const u64* live, const u64* slots, u32* idx, u32 rec_mask, u32 words,
        u32 k1, u32 seed) {
    const u32 r = threadIdx.x / words, w = threadIdx.x % words;
    if (r < __popc(rec_mask)) {
        const u32 layer_salt = salt(nth_bit(rec_mask, r));
        u32 s = 0;
        for (u32 j = 0; j < n; ++j) s = recur(s, embed(tokens[j], j, seed), layer_salt, w);
        u32* state = idx ? (u32*)slots[r] + (u64)row * 2 * k1 * words : (u32*)live[r] + (u64)row * words;
        state[w] = s;
    }
    if (idx && threadIdx.x == 0) idx[row] = 0;
}

// Per-layer constants every thread needs: the salts, and each layer's KV data pointer.
// Computed by one thread per layer (n_layers <= 32), so nobody walks the layers alone.
struct Layers {
    u32 salt[32];
    u32* data[32];
};

// Layer i of the table is the model's layer layer0 + i; `row_base` offsets each layer's data to
// this block's row.
__device__ void load_layers(Layers& layers, u32 n_layers, u32 layer0, const u64* tgt_data, u64 row_base) {
    if (threadIdx.x < n_layers) {
        layers.salt[threadIdx.x] = salt(layer0 + threadIdx.x);
        const u64 data = tgt_data ? tgt_data[threadIdx.x] : 0;
        layers.data[threadIdx.x] = data ? (u32*)data + row_base : 0;
    }
    __syncthreads();
}

// This thread's share of the target's history: every KV layer's entries [0, pos) of the row.
__device__ __forceinline__ u32 history_part(const Layers& layers, u32 n_layers, u32 pos) {
    u32 part = 0;
    for (u32 l = 0; l < n_layers; ++l)
        if (layers.data[l])
            for (u32 j = threadIdx.x; j < pos; j += blockDim.x) part += layers.data[l][j];
    return part;
}

// Draft step `step` of k+1 for row blockIdx.x: consume the token at p = pos_ctr + step (pend,
// then the drafts), append its KV and move its copy of the target's recurrent states on (from the
// round's state at step 0, else from slot step - 1, into slot step); for step < k also predict
// draft[step] and flag a p-min break. Rows of draft_d are max(k, 1) tokens apart. With state_d
// (sampling mode) the step leaves the draft's hash state there instead (a noisy position hashes
// differently), and toy_draft_sample draws draft[step] from the mixture at it.
extern "C" __global__ void __launch_bounds__(BLOCK) toy_draft_step(
        u32 step, u32 k, const u32* pend_d, u32* draft_d, const int* pos_ctr, u32* brk_d, u32* draft_data,
        int* draft_len, u32 capacity, u32 kv_mask, u32 n_layers, u32 seed, u32 vocab, u32 noise_ppm,
        u32 break_below, u32* state_d, const u64* st_live, const u64* st_slots, const u32* st_idx, u32 rec_mask,
        u32 words) {
    __shared__ Layers layers;
    const u32 b = blockIdx.x;
    pend_d += b;
    draft_d += (u64)b * max(k, 1u);
    pos_ctr += b;
    brk_d += BRK_WORDS * b;
    draft_data += (u64)b * capacity;
    draft_len += b;
    const bool lead = threadIdx.x == 0 && step < k;
    const u32 brk = lead ? brk_d[BRK_MARK] : 0;  // loaded up front: its latency overlaps the rest
    const u32 p = (u32)(pos_ctr[0] + (int)step);
    const u32 t = step == 0 ? pend_d[0] : draft_d[step - 1];
    load_layers(layers, n_layers, 0, 0, 0);
    if (p >= capacity) {  // no room (or a garbage position): predict nothing, write nothing
        if (threadIdx.x == 0 && step < k) draft_d[step] = 0;
        return;
    }
    const u32 e = embed(t, p, seed);
    u32 part = 0;
    if (threadIdx.x < __popc(rec_mask) * words) {  // word w of recurrent layer r: its term at p
        const u32 r = threadIdx.x / words, w = threadIdx.x % words;
        const StateRow row = state_row(st_live, st_slots, st_idx, r, b, k + 1, words);
        const u32 prev = step == 0 ? row.from[w] : row.to[(step - 1) * words + w];
        part = recur(prev, e, layers.salt[nth_bit(rec_mask, r)], w);
        row.to[step * words + w] = part;
    }
    if (step < k) {
        for (u32 j = threadIdx.x; j < p; j += blockDim.x) {  // one load per entry, all layers
            const u32 entry = draft_data[j];
            for (u32 l = 0; l < n_layers; ++l)
                if ((kv_mask >> l) & 1u) part += fmix(entry ^ layers.salt[l]);
        }
        if (threadIdx.x < n_layers && !((rec_mask >> threadIdx.x) & 1u))  // this position's term of a layer
            part += fmix(((kv_mask >> threadIdx.x) & 1u ? e : t) ^ layers.salt[threadIdx.x]);
        const bool noisy = fmix(p * 0x9E3779B1u ^ seed ^ 0x5bd1e995u) % 1000000u < noise_ppm;
        const bool breaks = lead && fmix(p ^ seed ^ 0x68e31da4u) % 1000u < break_below;
        const u32 total = block_sum(part);
        if (lead) {
            const u32 pred = fmix(seed ^ total) % vocab;
            if (state_d)
                state_d[b] = seed ^ total ^ (noisy ? 0x5bd1e995u : 0u);
            else
                draft_d[step] = noisy ? (pred + 1) % vocab : pred;
            if (breaks) brk_d[BRK_MARK] = tighter_mark(brk, step + 1);  // a length chosen may stand lower
        }
    }
    if (threadIdx.x == 0) {  // after the reads above: entries [0, p) are never written here
        draft_data[p] = e;
        *draft_len = (int)(p + 1);
    }
}

// Verify trunk of row blockIdx.x: the k+1 tokens of vtok at positions pos_start.., causal; appends
// their KV to every target layer, runs every recurrent layer through them (the state after token i
// to slot i), and writes pred[i], the target's token after vtok[i]. k+1 <= BLOCK.
// In a pipeline, partial_in (if non-null) holds the earlier stages' sums for each token, and a
// stage that is not the last writes its sums (partial_in's included) to partial_out, not pred.
extern "C" __global__ void __launch_bounds__(BLOCK) toy_verify(
        const u32* vtok_d, u32 k1, const int* pos_start_d, u32* pred_d, const u64* tgt_data, const u64* tgt_len,
        u32 n_layers, u32 capacity, u32 seed, u32 vocab, u32 layer0, const u32* partial_in, u32* partial_out,
        const u64* st_live, const u64* st_slots, const u32* st_idx, u32 rec_mask, u32 words) {
    __shared__ Layers layers;
    __shared__ u32 fresh[BLOCK];  // token i's new KV entries, summed over the layers
    __shared__ u32 local[BLOCK];  // token i's terms from layers without KV, and the earlier stages' sums
    __shared__ u32 recurrent[BLOCK];  // token i's recurrent terms, summed over layers and words
    const u32 b = blockIdx.x;
    vtok_d += (u64)b * k1;
    u32* out = partial_out ? partial_out + (u64)b * k1 : pred_d + (u64)b * k1;
    const u32 pos = (u32)pos_start_d[b];
    const u32 i = threadIdx.x;
    const u32 t = i < k1 ? vtok_d[i] : 0;
    const u32 before = partial_in && i < k1 ? partial_in[(u64)b * k1 + i] : 0;
    if (i < k1) recurrent[i] = 0;  // published by load_layers' barrier, before any term is added
    load_layers(layers, n_layers, layer0, tgt_data, (u64)b * capacity);
    if (pos >= capacity) {
        if (i < k1) out[i] = 0;
        return;
    }
    u32 part = history_part(layers, n_layers, pos);
    if (i < k1) {
        const u32 e = embed(t, pos + i, seed);
        u32 f = 0, g = 0;
        for (u32 l = 0; l < n_layers; ++l) {
            if (layers.data[l]) {
                const u32 entry = fmix(e ^ layers.salt[l]);
                f += entry;
                if (pos + i < capacity) layers.data[l][pos + i] = entry;
            } else if (!((rec_mask >> l) & 1u)) {
                g += fmix(t ^ layers.salt[l]);
            }
        }
        fresh[i] = f;
        local[i] = g + before;
    }
    if (i < __popc(rec_mask) * words) {  // word w of recurrent layer r through the tokens, in order
        const u32 r = i / words, w = i % words, layer_salt = layers.salt[nth_bit(rec_mask, r)];
        const StateRow row = state_row(st_live, st_slots, st_idx, r, b, k1, words);
        u32 s = row.from[w];
        for (u32 j = 0; j < k1; ++j) {
            s = recur(s, embed(vtok_d[j], pos + j, seed), layer_salt, w);
            row.to[j * words + w] = s;
            atomicAdd(&recurrent[j], s);
        }
    }
    const u32 history = block_sum(part);  // its barriers also publish fresh[], local[] and recurrent[]
    if (threadIdx.x < 32) {  // warp 0: a running sum over the tokens, 32 at a time
        u32 carry = history;
        for (u32 base = 0; base < k1; base += 32) {
            const u32 j = base + threadIdx.x;
            u32 run = j < k1 ? fresh[j] : 0;
            for (u32 o = 1; o < 32; o <<= 1) {
                const u32 up = __shfl_up_sync(0xffffffffu, run, o);
                if (threadIdx.x >= o) run += up;
            }
            if (j < k1) {
                const u32 total = carry + run + local[j] + recurrent[j];
                out[j] = partial_out ? total : fmix(seed ^ total) % vocab;
            }
            carry += __shfl_sync(0xffffffffu, run, 31);
        }
    }
    if (threadIdx.x < n_layers && tgt_len[threadIdx.x])
        ((int*)tgt_len[threadIdx.x])[b] = (int)min(pos + k1, capacity);
}

// Sampling mode's draft token `step` (< k) of row blockIdx.y, after its toy_draft_step: the draft's
// distribution at the state it left goes to q_d[b][step][0..vocab), and draft[step] is drawn from
// it by the race keyed by (seed_d[b], p + 1, purpose 2), p = pos_ctr + step the position the step
// consumed. The vocabulary is spread over gridDim.x blocks of SAMPLE_BLOCK threads; scratch holds
// one race slot (u64[2]) per row.
#define SAMPLE_BLOCK 256
extern "C" __global__ void __launch_bounds__(SAMPLE_BLOCK) toy_draft_sample(
        u32 step, u32 k, const u32* state_d, const int* pos_ctr, u32* draft_d, float* q_d, const u64* seed_d,
        u32 vocab, float floor, float c0, float c1, float c2, float c3, u64* scratch) {
    const u32 b = blockIdx.y;
    const Mixture m = mixture(state_d[b], vocab, floor, c0, c1, c2, c3);
    float* q = q_d + ((u64)b * max(k, 1u) + step) * vocab;
    const auto weight = [&m, q](u32 v) {  // the draft's law, stored in q_d as it is raced
        const float w = mixture_prob(m, v);
        q[v] = w;
        return w;
    };
    u32 token;
    if (race_draw<SAMPLE_BLOCK>(weight, vocab, seed_d[b], (u32)(pos_ctr[b] + (int)step) + 1u, PURPOSE_DRAFT,
                                scratch + 2 * (u64)b, &token))
        draft_d[(u64)b * max(k, 1u) + step] = token;
}

// Sampling mode's verify: the target's distribution p[r][0..vocab) at each of rows = B(k+1) verify
// positions, from the sums toy_verify wrote to partial_out (row r of `totals`); blockIdx.y is r.
extern "C" __global__ void toy_probs(const u32* totals, u32 rows, u32 seed, u32 vocab, float floor, float c0,
                                     float c1, float c2, float c3, float* p_d) {
    const u32 r = blockIdx.y;
    if (r >= rows) return;
    const Mixture m = mixture(seed ^ totals[r], vocab, floor, c0, c1, c2, c3);
    float* p = p_d + (u64)r * vocab;
    for (u32 v = blockIdx.x * blockDim.x + threadIdx.x; v < vocab; v += gridDim.x * blockDim.x)
        p[v] = mixture_prob(m, v);
}

// Tensor-parallel ranks' greedy verify (memra_cuda/testing/toy/ranks.py): the target's token
// at each of n verify positions from the sums the ranks' toy_verify wrote to partial_out over their
// layers and the all-reduce added up, as toy_verify's last stage finishes its own.
extern "C" __global__ void toy_finish(const u32* totals, u32 n, u32 seed, u32 vocab, u32* pred_d) {
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) pred_d[i] = fmix(seed ^ totals[i]) % vocab;
}

// The model-cost knob: read n_vec 16-byte words of "weights", as a memory-bound model layer would.
extern "C" __global__ void toy_stream_weights(const uint4* __restrict__ weights, u64 n_vec, u32* sink) {
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n_vec; i += (u64)gridDim.x * blockDim.x) {
        const uint4 w = __ldg(weights + i);
        acc.x ^= w.x; acc.y ^= w.y; acc.z ^= w.z; acc.w ^= w.w;
    }
    if ((acc.x & acc.y & acc.z & acc.w) == 0xffffffffu) sink[0] = acc.x;  // keeps the loads alive
}

// ---- Trees (docs/trees.md; docs/toy-model.md, "Trees") -------------------------------------------
// The tree buffers are TreeBufs' (memra_cuda/buffers/tree.py), row b at b * t1 (masks at b * t1 * mask_words):
// node i's token, parent, position (pos_start + depth) and ancestor mask. Both kernels run one block
// per row, node i of the launch on thread i (a level's nodes from thread 0), t1 <= MAX_TREE_NODES.
// The recurrent states have t1 slots a bank (StateRow with k1 = t1): node i's state after its token,
// moved on from its parent's slot (node 0, or a node whose parent is not before it: from the round's
// state).

// The set bits j < limit of node i's ancestor mask (its own bit i excluded): f(j) for each.
template <typename F>
__device__ __forceinline__ void for_ancestors(const u32* mask, u32 mask_words, u32 i, u32 limit, F f) {
    for (u32 w = 0; w < mask_words; ++w) {
        u32 bits = mask[w];
        if (w == i / 32) bits &= ~(1u << (i % 32));
        while (bits) {
            const u32 j = w * 32 + __ffs(bits) - 1;
            bits &= bits - 1;
            if (j < limit) f(j);
        }
    }
}

// Draft level [start, stop) of the tree (a launch a level, one block a row). Each node i appends
// its draft entry E(t_i, p_i) at slot pos_start + i (clamped to the capacity) and moves the draft's
// copy of the recurrent states on from its parent's slot into slot i. Unless `last` (level D), it
// also computes what toy_draft_step computes for the same history: total_i over the committed
// entries [0, pos_start), the entries of its ancestors (mask bits of earlier levels, at slots
// pos_start + a), its own per-layer terms and its recurrent words, and from it (greedy) its
// `cands` candidates, best first, into cand_tok / cand_logp ([B][t1][cands]), or (sampling: hash_d
// non-null) the draft's hash state h_i into hash_d[b][i], for toy_tree_probs.
extern "C" __global__ void __launch_bounds__(BLOCK) toy_tree_draft(
        u32 start, u32 stop, u32 last, u32 t1, u32 mask_words, u32 cands, const u32* tok_d, const u32* parent_d,
        const int* pos_d, const u32* mask_d, const int* pos_start_d, u32* cand_tok, float* cand_logp, u32* hash_d,
        u32* draft_data, int* draft_len, u32 capacity, u32 kv_mask, u32 n_layers, u32 seed, u32 vocab,
        u32 noise_ppm, u32 spread, const u64* st_live, const u64* st_slots, const u32* st_idx, u32 rec_mask,
        u32 words) {
    __shared__ Layers layers;
    __shared__ u32 ancestor[MAX_TREE_NODES];   // the entries of node a (an earlier level), over the KV layers
    __shared__ u32 recurrent[MAX_TREE_NODES];  // node start + n's recurrent words, summed
    const u32 b = blockIdx.x;
    t1 = min(t1, (u32)MAX_TREE_NODES);
    stop = min(stop, t1);
    start = min(start, stop);
    const u32 n_level = stop - start, n = threadIdx.x, i = start + n;
    tok_d += (u64)b * t1;
    parent_d += (u64)b * t1;
    pos_d += (u64)b * t1;
    mask_d += (u64)b * t1 * mask_words;
    draft_data += (u64)b * capacity;
    const u32 pos = (u32)pos_start_d[b];
    if (n < n_level) recurrent[n] = 0;  // published by load_layers' barrier, before any word is added
    load_layers(layers, n_layers, 0, 0, 0);
    if (pos >= capacity) {  // no room (or a garbage position): nothing written but void candidates
        if (!last && n < n_level) {
            if (hash_d) hash_d[(u64)b * t1 + i] = 0;
            else
                for (u32 j = 0; j < cands; ++j) {
                    cand_tok[((u64)b * t1 + i) * cands + j] = 0;
                    cand_logp[((u64)b * t1 + i) * cands + j] = -__int_as_float(0x7f800000);
                }
        }
        return;
    }
    const u32 t = n < n_level ? tok_d[i] : 0, p = n < n_level ? (u32)pos_d[i] : 0;
    const u32 e = embed(t, p, seed);
    if (threadIdx.x < __popc(rec_mask) * words) {  // word w of recurrent layer r through the level's nodes
        const u32 r = threadIdx.x / words, w = threadIdx.x % words, layer_salt = layers.salt[nth_bit(rec_mask, r)];
        const StateRow row = state_row(st_live, st_slots, st_idx, r, b, t1, words);
        for (u32 c = start; c < stop; ++c) {
            const u32 par = parent_d[c];
            const u32 prev = par < start ? row.to[(u64)par * words + w] : row.from[w];
            const u32 s = recur(prev, embed(tok_d[c], (u32)pos_d[c], seed), layer_salt, w);
            row.to[(u64)c * words + w] = s;
            if (!last) atomicAdd(&recurrent[c - start], s);
        }
    }
    if (!last) {
        u32 part = 0;
        for (u32 j = threadIdx.x; j < pos; j += blockDim.x) {  // the committed entries, one load each
            const u32 entry = draft_data[j];
            for (u32 l = 0; l < n_layers; ++l)
                if ((kv_mask >> l) & 1u) part += fmix(entry ^ layers.salt[l]);
        }
        if (threadIdx.x < start) {  // the earlier levels' entries, read back from the cache
            u32 sum = 0;
            if (pos + threadIdx.x < capacity) {
                const u32 entry = draft_data[pos + threadIdx.x];
                for (u32 l = 0; l < n_layers; ++l)
                    if ((kv_mask >> l) & 1u) sum += fmix(entry ^ layers.salt[l]);
            }
            ancestor[threadIdx.x] = sum;
        }
        const u32 history = block_sum(part);  // its barriers also publish ancestor[] and recurrent[]
        if (n < n_level) {
            u32 total = history + recurrent[n];
            for_ancestors(mask_d + (u64)i * mask_words, mask_words, i, start, [&](u32 a) { total += ancestor[a]; });
            for (u32 l = 0; l < n_layers; ++l)
                if (!((rec_mask >> l) & 1u)) total += fmix(((kv_mask >> l) & 1u ? e : t) ^ layers.salt[l]);
            const bool noisy = fmix(p * 0x9E3779B1u ^ seed ^ 0x5bd1e995u) % 1000000u < noise_ppm;
            if (hash_d) {
                hash_d[(u64)b * t1 + i] = seed ^ total ^ (noisy ? 0x5bd1e995u : 0u);
            } else {
                const u32 pred = fmix(seed ^ total) % vocab;
                const u32 rho = noisy ? 1u + fmix(total ^ 0x1b873593u) % spread : 0u;  // pred's rank (0: none)
                const u32 gap = 500u + fmix(total ^ 0x2545f491u) % 2000u;
                u32* tok = cand_tok + ((u64)b * t1 + i) * cands;
                float* logp = cand_logp + ((u64)b * t1 + i) * cands;
                for (u32 j = 0; j < cands; ++j) {
                    u32 c;
                    if (j == 0) {
                        c = noisy ? (pred + 1) % vocab : pred;
                    } else if (j == rho) {
                        c = pred;
                    } else {
                        c = fmix(total ^ ((j + 1) * 0x27d4eb2fu)) % vocab;
                        if (c == pred) c = (pred + 2) % vocab;
                    }
                    tok[j] = c;
                    logp[j] = -(float)(j * gap) / 1000.0f;
                }
            }
        }
    }
    if (n < n_level && pos + i < capacity) draft_data[pos + i] = e;  // after the reads: slots before this level's
    if (threadIdx.x == 0) draft_len[b] = (int)min(pos + stop, capacity);
}

// Sampling mode's draft distributions of level [start, stop): q_d[b][i][0..vocab) = the draft's
// mixture at the hash state toy_tree_draft left in hash_d[b][i] (toy_draft_sample's weights).
// blockIdx.y is b * (stop - start) + (i - start); the vocabulary is spread over gridDim.x blocks.
extern "C" __global__ void toy_tree_probs(const u32* hash_d, u32 t1, u32 start, u32 stop, u32 batch, u32 vocab,
                                          float floor, float c0, float c1, float c2, float c3, float* q_d) {
    const u32 n_level = stop - start;
    if (stop > t1 || start >= stop || blockIdx.y >= batch * n_level) return;
    const u32 b = blockIdx.y / n_level, i = start + blockIdx.y % n_level;
    const Mixture m = mixture(hash_d[(u64)b * t1 + i], vocab, floor, c0, c1, c2, c3);
    float* q = q_d + ((u64)b * t1 + i) * vocab;
    for (u32 v = blockIdx.x * blockDim.x + threadIdx.x; v < vocab; v += gridDim.x * blockDim.x)
        q[v] = mixture_prob(m, v);
}

// The tree verify of row blockIdx.x: every node i at once, attending to the committed entries
// [0, pos_start) and to its ancestors (the bits of its mask but its own): total_i = history + the
// ancestors' fresh entries + its own terms of layers without KV + its recurrent words (each
// recurrent layer moved on from its parent's slot into slot i). Writes every KV layer's entry of
// node i at slot pos_start + i (clamped to the capacity), lengths min(pos_start + t1, capacity),
// and pred_d[b][i] = fmix(seed ^ total_i) % vocab, or (sampling: totals_d non-null) total_i to
// totals_d[b][i] for toy_probs.
extern "C" __global__ void __launch_bounds__(BLOCK) toy_tree_verify(
        u32 t1, u32 mask_words, const u32* tok_d, const u32* parent_d, const int* pos_d, const u32* mask_d,
        const int* pos_start_d, u32* pred_d, u32* totals_d, const u64* tgt_data, const u64* tgt_len, u32 n_layers,
        u32 capacity, u32 seed, u32 vocab, const u64* st_live, const u64* st_slots, const u32* st_idx,
        u32 rec_mask, u32 words) {
    __shared__ Layers layers;
    __shared__ u32 fresh[MAX_TREE_NODES];      // node i's new KV entries, summed over the layers
    __shared__ u32 local[MAX_TREE_NODES];      // node i's terms from layers without KV
    __shared__ u32 recurrent[MAX_TREE_NODES];  // node i's recurrent words, summed over layers and words
    const u32 b = blockIdx.x, i = threadIdx.x;
    t1 = min(t1, (u32)MAX_TREE_NODES);
    tok_d += (u64)b * t1;
    parent_d += (u64)b * t1;
    pos_d += (u64)b * t1;
    mask_d += (u64)b * t1 * mask_words;
    u32* out = totals_d ? totals_d + (u64)b * t1 : pred_d + (u64)b * t1;
    const u32 pos = (u32)pos_start_d[b];
    if (i < t1) recurrent[i] = 0;  // published by load_layers' barrier, before any term is added
    load_layers(layers, n_layers, 0, tgt_data, (u64)b * capacity);
    if (pos >= capacity) {
        if (i < t1) out[i] = 0;
        return;
    }
    u32 part = history_part(layers, n_layers, pos);
    const u32 t = i < t1 ? tok_d[i] : 0;
    if (i < t1) {
        const u32 e = embed(t, (u32)pos_d[i], seed);
        u32 f = 0, g = 0;
        for (u32 l = 0; l < n_layers; ++l) {
            if (layers.data[l]) {
                const u32 entry = fmix(e ^ layers.salt[l]);
                f += entry;
                if (pos + i < capacity) layers.data[l][pos + i] = entry;  // slots past the reads above
            } else if (!((rec_mask >> l) & 1u)) {
                g += fmix(t ^ layers.salt[l]);
            }
        }
        fresh[i] = f;
        local[i] = g;
    }
    if (i < __popc(rec_mask) * words) {  // word w of recurrent layer r through the nodes, parents first
        const u32 r = i / words, w = i % words, layer_salt = layers.salt[nth_bit(rec_mask, r)];
        const StateRow row = state_row(st_live, st_slots, st_idx, r, b, t1, words);
        for (u32 c = 0; c < t1; ++c) {
            const u32 par = parent_d[c];
            const u32 prev = par < c ? row.to[(u64)par * words + w] : row.from[w];
            const u32 s = recur(prev, embed(tok_d[c], (u32)pos_d[c], seed), layer_salt, w);
            row.to[(u64)c * words + w] = s;
            atomicAdd(&recurrent[c], s);
        }
    }
    const u32 history = block_sum(part);  // its barriers also publish fresh[], local[] and recurrent[]
    if (i < t1) {
        u32 total = history + local[i] + recurrent[i] + fresh[i];
        for_ancestors(mask_d + (u64)i * mask_words, mask_words, i, t1, [&](u32 a) { total += fresh[a]; });
        out[i] = totals_d ? total : fmix(seed ^ total) % vocab;
    }
    if (threadIdx.x < n_layers && tgt_len[threadIdx.x])
        ((int*)tgt_len[threadIdx.x])[b] = (int)min(pos + t1, capacity);
}
