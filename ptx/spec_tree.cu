// Tree verification: the layer's kernels of a tree round (docs/trees.md, "Kernel contracts"),
// mirrored by memra_cuda/testing/reference_tree.py.
//
// A row's tree is T1 = T + 1 nodes in level order (node 0 the pending token), its fields side by
// side in one allocation (memra_cuda/buffers/tree.py's TreeBufs, the same order): every kernel takes the
// allocation and (T1, W, D, B) and finds the fields with tree_rows. Like the chain's kernels they
// are batched, take only device pointers and launch-time constants (a captured graph replays
// them), and read what the device holds defensively: a parent not before its child, a rank, path
// entry or token past its bounds is clamped or ignored, never used as an index.

#include "layout.cuh"
#include "philox.cuh"
#include "round_tail.cuh"
#include "state.cuh"

#define TREE_THREADS 256  // the block of the draw, judge pass and race kernels (memra_cuda/kernels/tree.py)
#define NO_NODE 4294967295u  // 0xFFFFFFFF: no child accepted (judge), no node
#define JUDGED_WORDS 40  // a node's verdict in the judges' scratch: see spec_tree_judge
#define NO_MASS_TOKEN 0u
#define RESIDUAL_KEY (1ull << 63)

struct TreeRows {
    u32 *tok, *parent, *depth, *rank;
    int* pos;
    u32* mask;
    float* score;
    u32* path;
};

// Row b's fields: tok, parent, depth, rank, pos [B][T1]; mask [B][T1][W]; score [B][T1]; path [B][D+1].
__device__ __forceinline__ TreeRows tree_rows(u32* base, u32 T1, u32 W, u32 D, u32 B, u32 b) {
    const u64 n = (u64)B * T1;
    TreeRows t;
    t.tok = base + (u64)b * T1;
    t.parent = base + n + (u64)b * T1;
    t.depth = base + 2 * n + (u64)b * T1;
    t.rank = base + 3 * n + (u64)b * T1;
    t.pos = (int*)(base + 4 * n) + (u64)b * T1;
    t.mask = base + 5 * n + (u64)b * T1 * W;
    t.score = (float*)(base + (5 + W) * n) + (u64)b * T1;
    t.path = base + (6 + W) * n + (u64)b * (D + 1);
    return t;
}

// A probability as the tree kernels read it: NaN, negative and infinite values are 0.
__device__ __forceinline__ float tree_prob(float x) { return x > 0.f && x < __int_as_float(0x7f800000) ? x : 0.f; }

__device__ __forceinline__ bool is_finite(float x) { return x - x == 0.f; }

// 10. Node 0 is the pending token at pos_start = pos_ctr; vtok[0] too (the commit reads vtok[1..]).
//     Rows of vtok are k + 1 = D + 1 words: TreeBufs gives a tree only buffers whose k is its depth.
extern "C" __global__ void spec_tree_begin(u32* tree, u32 T1, u32 W, u32 D, u32 B, const u32* pend_d,
                                           const int* pos_ctr, int* pos_start_d, u32* vtok_d) {
    for (u32 b = blockIdx.x * blockDim.x + threadIdx.x; b < B; b += gridDim.x * blockDim.x) {
        const TreeRows t = tree_rows(tree, T1, W, D, B, b);
        const u32 pend = pend_d[b];
        const int pos = pos_ctr[b];
        t.tok[0] = pend;
        t.parent[0] = ROOT_PARENT;
        t.depth[0] = 0;
        t.rank[0] = 0;
        t.pos[0] = pos;
        t.score[0] = 0.f;
        for (u32 w = 0; w < W; ++w) t.mask[w] = w == 0;
        pos_start_d[b] = pos;
        vtok_d[(u64)b * (D + 1)] = pend;
    }
}

// Node c of level `level` becomes a child of p (its mask p's and its own bit), or a void node.
__device__ __forceinline__ void place_node(const TreeRows& t, u32 W, u32 c, u32 p, u32 level, int pos_start, u32 tok,
                                           u32 rank, float score) {
    t.tok[c] = tok;
    t.parent[c] = p;
    t.depth[c] = level;
    t.rank[c] = rank;
    t.pos[c] = (int)((u32)pos_start + level);
    t.score[c] = rank == VOID_RANK ? -__int_as_float(0x7f800000) : score;
    for (u32 w = 0; w < W; ++w) t.mask[(u64)c * W + w] = t.mask[(u64)p * W + w] | (w == c / 32 ? 1u << (c % 32) : 0u);
}

// 11. Level `level` ([start, stop)) from the candidates of level - 1 ([prev_start, prev_stop)), one
//     block a row. Candidates are [B][T1][K]: tokens (32 or 64 bit), logq and sel (f32). Static
//     (shape non-null: parents, then ranks, then child counts, u32[T1] each) or dynamic (width =
//     stop - start, branch). The dynamic offers' scores live in shared memory: at most
//     MAX_TREE_OFFERS (DynamicTree checks a later level's width * branch against it; level 1's,
//     the root's branch best first, are cut to it, keeping a width of at most 255 the best).
template <typename Tok>
__device__ void tree_grow(u32* tree, u32 T1, u32 W, u32 D, u32 B, u32 level, u32 prev_start, u32 prev_stop,
                          u32 start, u32 stop, const Tok* cand_tok, const float* cand_logq, const float* cand_sel,
                          u32 K, const u32* shape, u32 branch, const int* pos_start_d) {
    __shared__ float offer[MAX_TREE_OFFERS];
    __shared__ u32 chosen[MAX_TREE_OFFERS];
    for (u32 b = blockIdx.x; b < B; b += gridDim.x) {
        const TreeRows t = tree_rows(tree, T1, W, D, B, b);
        const int pos_start = pos_start_d[b];
        const u64 row = (u64)b * T1;
        if (shape) {
            for (u32 c = start + threadIdx.x; c < stop; c += blockDim.x) {
                const u32 p = shape[c], r = shape[T1 + c];
                if (p >= c) {  // a garbage shape: a void node under the root
                    place_node(t, W, c, 0, level, pos_start, 0, VOID_RANK, 0.f);
                    continue;
                }
                const u64 at = (row + p) * K + r;
                const float logq = r < K ? cand_logq[at] : 0.f;
                const bool live = t.rank[p] != VOID_RANK && r < K && is_finite(logq);
                place_node(t, W, c, p, level, pos_start, live ? (u32)cand_tok[at] : 0u, live ? r : VOID_RANK,
                           t.score[p] + logq);
            }
        } else {
            const u32 kb = min(branch, K), offers = min((prev_stop - prev_start) * kb, (u32)MAX_TREE_OFFERS);
            const u32 width = stop - start;
            for (u32 o = threadIdx.x; o < offers; o += blockDim.x) {
                const u32 p = prev_start + o / kb, j = o % kb;
                const float sel = cand_sel[(row + p) * K + j];
                offer[o] = t.rank[p] != VOID_RANK && is_finite(sel) ? t.score[p] + sel : -__int_as_float(0x7f800000);
            }
            __syncthreads();
            for (u32 o = threadIdx.x; o < offers; o += blockDim.x) {  // chosen: among the `width` best
                const float s = offer[o];
                u32 better = 0;
                for (u32 x = 0; x < offers && better < width; ++x) better += offer[x] > s || (offer[x] == s && x < o);
                chosen[o] = is_finite(s) && better < width;
            }
            __syncthreads();
            for (u32 o = threadIdx.x; o < offers; o += blockDim.x) {  // placed in (p, j) order
                if (!chosen[o]) continue;
                u32 before = 0;
                for (u32 x = 0; x < o; ++x) before += chosen[x];
                const u32 p = prev_start + o / kb, j = o % kb;
                const u64 at = (row + p) * K + j;
                place_node(t, W, start + before, p, level, pos_start, (u32)cand_tok[at], j, t.score[p] + cand_logq[at]);
            }
            u32 placed = 0;
            for (u32 x = 0; x < offers; ++x) placed += chosen[x];
            for (u32 c = start + placed + threadIdx.x; c < stop; c += blockDim.x)
                place_node(t, W, c, 0, level, pos_start, 0, VOID_RANK, 0.f);
            __syncthreads();  // the next row reuses the offers
        }
    }
}

extern "C" __global__ void spec_tree_grow(u32* tree, u32 T1, u32 W, u32 D, u32 B, u32 level, u32 prev_start,
                                          u32 prev_stop, u32 start, u32 stop, const u32* cand_tok,
                                          const float* cand_logq, const float* cand_sel, u32 K, const u32* shape,
                                          u32 branch, const int* pos_start_d) {
    tree_grow(tree, T1, W, D, B, level, prev_start, prev_stop, start, stop, cand_tok, cand_logq, cand_sel, K, shape,
              branch, pos_start_d);
}

extern "C" __global__ void spec_tree_grow_t64(u32* tree, u32 T1, u32 W, u32 D, u32 B, u32 level, u32 prev_start,
                                              u32 prev_stop, u32 start, u32 stop, const u64* cand_tok,
                                              const float* cand_logq, const float* cand_sel, u32 K,
                                              const u32* shape, u32 branch, const int* pos_start_d) {
    tree_grow(tree, T1, W, D, B, level, prev_start, prev_stop, start, stop, cand_tok, cand_logq, cand_sel, K, shape,
              branch, pos_start_d);
}

// A thread's R best keys, best first, in registers: the list is walked with constant indices only.
struct TopKeys {
    u64 key[MAX_TREE_DRAWS];
    __device__ void clear() {
#pragma unroll
        for (u32 j = 0; j < MAX_TREE_DRAWS; ++j) key[j] = 0;
    }
    __device__ void insert(u64 x) {
#pragma unroll
        for (u32 j = 0; j < MAX_TREE_DRAWS; ++j) {
            const u64 here = key[j];
            const bool swap = x > here;
            key[j] = swap ? x : here;
            x = swap ? here : x;
        }
    }
    __device__ void pop() {
#pragma unroll
        for (u32 j = 0; j + 1 < MAX_TREE_DRAWS; ++j) key[j] = key[j + 1];
        key[MAX_TREE_DRAWS - 1] = 0;
    }
};

// The block's R best keys of `mine` (every thread's list), best first, into out[0..R) (0 past
// the last key), by R rounds of a block maximum whose owner pops it. Every thread calls it.
__device__ void block_top(TopKeys& mine, u32 R, u64* out) {
    for (u32 j = 0; j < R; ++j) {
        const u64 best = block_race_max<TREE_THREADS>(mine.key[0]);
        __shared__ u64 s_best;
        if (threadIdx.x == 0) s_best = best;
        __syncthreads();
        if (s_best && mine.key[0] == s_best) mine.pop();
        if (threadIdx.x == 0) out[j] = s_best;
        __syncthreads();
    }
}

// 12. Sampling: each non-void node p of level - 1 with children draws R tokens without
//     replacement from q[p] by the race at position pos_start + level, node word p - (level - 1):
//     the R largest q(v)/E_v, and notes the R largest q(v). Spread over `slices` blocks a parent
//     (blockIdx.x = parent * slices + slice; blockIdx.y the row): each block folds its best keys
//     into the parent's scratch, and the last block to finish (counted, as race_settle does) merges
//     them into the candidates. scratch: u64[B][T1][slices][2R] keys, u32[B][T1] counts (zero at
//     the first launch, left zero by every launch).
extern "C" __global__ void __launch_bounds__(TREE_THREADS)
spec_tree_draw(u32* tree, u32 T1, u32 W, u32 D, u32 B, u32 level, u32 prev_start, u32 prev_stop, const u32* shape,
               const float* q_d, u32 V, const u64* seed_d, const int* pos_start_d, u32 R, u32 slices, u32* cand_tok,
               float* cand_logq, float* cand_sel, u64* keys, u32* counts) {
    const u32 b = blockIdx.y, p = prev_start + blockIdx.x / slices, slice = blockIdx.x % slices;
    if (b >= B || p >= prev_stop || R == 0 || R > MAX_TREE_DRAWS) return;
    const TreeRows t = tree_rows(tree, T1, W, D, B, b);
    if (t.rank[p] == VOID_RANK || (shape && shape[2 * T1 + p] == 0)) return;  // every block of p alike
    const float* q = q_d + ((u64)b * T1 + p) * V;
    const u64 seed = seed_d[b];
    const u32 a = (u32)pos_start_d[b] + level, node = p - (level - 1);
    TopKeys drawn, largest;
    drawn.clear();
    largest.clear();
    for (u64 v = ((u64)slice * TREE_THREADS + threadIdx.x); v < V; v += (u64)slices * TREE_THREADS) {
        const float w = tree_prob(q[v]);
        if (w > 0.f) {
            const float inv_e = __fdividef(1.f, philox_exponential(seed, a, (u32)v, PURPOSE_DRAFT, node));
            drawn.insert(race_key(w, inv_e, (u32)v));
            largest.insert(race_key(w, 1.f, (u32)v));
        }
    }
    u64* mine = keys + (((u64)b * T1 + p) * slices + slice) * 2 * R;
    block_top(drawn, R, mine);
    block_top(largest, R, mine + R);
    if (threadIdx.x != 0) return;
    __threadfence();
    if (atomic_inc_acq_rel(&counts[(u64)b * T1 + p], slices - 1) != slices - 1) return;
    // The parent's last block: merge every slice's keys, R rounds of a maximum over them. A key
    // naming no entry of V (scratch garbage: its token would index q) is never drawn.
    const u64* all = keys + ((u64)b * T1 + p) * slices * 2 * R;
    const u64 at = ((u64)b * T1 + p) * R;
    for (u32 list = 0; list < 2; ++list) {
        u64 last = ~0ull;
        for (u32 j = 0; j < R; ++j) {
            u64 best = 0;
            for (u32 s = 0; s < slices; ++s)
                for (u32 i = 0; i < R; ++i) {
                    const u64 x = all[(u64)s * 2 * R + list * R + i];
                    if (x < last && x > best && race_token(x) < V) best = x;
                }
            last = best;
            const float logv = best ? logf(tree_prob(q[race_token(best)])) : -__int_as_float(0x7f800000);
            if (list == 0) {
                cand_tok[at + j] = best ? race_token(best) : 0u;
                cand_logq[at + j] = logv;
            } else {
                cand_sel[at + j] = logv;
            }
        }
    }
}

// The ancestor mask agrees with `agree` (a node set) on node i: every node of i's mask is in it.
__device__ __forceinline__ bool all_agree(const u32* mask_i, const u32* agree, u32 W) {
    u32 missing = 0;
    for (u32 w = 0; w < W; ++w) missing |= mask_i[w] & ~agree[w];
    return missing == 0;
}

// The row's verdict after the accepted node n: its path (from the parents, D at most), the path's
// tokens in vtok[1..a], acc, the bonus, keep = a + 1, a live row's capped round counted where its
// mark was set, the mark cleared; a done row keeps nothing. One thread.
__device__ void settle_tree_row(const TreeRows& t, u32 T1, u32 D, u32 b, u32 n, u32 bonus, bool done, u32* vtok_d,
                                u32* brk_d, u32* acc_d, u32* last_pred_d, int* ctl_d) {
    u32* acc = acc_d + ACC_WORDS * b;
    int* ctl = ctl_d + CTL_WORDS * b;
    u32* brk = brk_d + BRK_WORDS * b;
    if (!done && brk[BRK_MARK]) brk[BRK_COUNT] += 1;  // a capped round, as a chain's count
    brk[BRK_MARK] = 0;
    if (done) {
        acc[ACC_ROUND] = 0;
        ctl[CTL_KEEP] = 0;
        t.path[0] = 0;
        return;
    }
    u32 a = 0;
    for (u32 x = n; x != 0 && x < T1 && a < D; x = t.parent[x]) ++a;  // n's depth, by its parents
    u32* vtok = vtok_d + (u64)b * (D + 1);
    u32 x = n;
    for (u32 d = a; d > 0; --d, x = t.parent[x]) {
        t.path[d] = x;
        vtok[d] = t.tok[x];
    }
    t.path[0] = 0;
    acc[ACC_ROUND] = a;
    acc[ACC_TOTAL] += a;
    last_pred_d[b] = bonus;
    ctl[CTL_KEEP] = (int)(a + 1);
}

// 13. Greedy: the deepest node, at most the row's cap deep (marked_limit: the length chosen for
//     it, docs/lengths.md), whose every node on the root path agrees with the target (its
//     token the prediction at its parent), ties to the smaller index. One warp a row: each lane
//     judges nodes lane, lane + 32, ...; a ballot per 32 nodes makes the set of agreeing nodes,
//     and a node qualifies when its ancestor mask lies in that set.
template <typename Tok>
__device__ void tree_accept_greedy_row(u32 b, u32* tree, u32 T1, u32 W, u32 D, u32 B, const Tok* pred_d, u32* vtok_d,
                                       u32* brk_d, u32* acc_d, u32* last_pred_d, int* ctl_d) {
    __shared__ u32 agree[MAX_TREE_NODES / 32];
    const u32 lane = threadIdx.x & 31;
    const TreeRows t = tree_rows(tree, T1, W, D, B, b);
    const Tok* pred = pred_d + (u64)b * T1;
    const u32 cap = marked_limit(brk_d[BRK_WORDS * b + BRK_MARK], D);  // every lane alike
    for (u32 w = 0; w < W; ++w) {
        const u32 i = 32 * w + lane;
        bool ok = i == 0;
        if (i > 0 && i < T1) {
            const u32 p = t.parent[i];
            ok = t.rank[i] != VOID_RANK && p < i && t.tok[i] == (u32)pred[p];
        }
        const u32 bits = __ballot_sync(0xffffffffu, ok);
        if (lane == 0) agree[w] = bits;
    }
    __syncwarp();
    u64 best = 0;  // (depth, ~index) of the deepest qualifying node, smaller index first
    for (u32 i = lane; i < T1; i += 32) {
        const u32 depth = t.depth[i];
        if (depth <= cap && all_agree(t.mask + (u64)i * W, agree, W)) {
            const u64 key = (u64)depth << 32 | (u32)~i;
            best = key > best ? key : best;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(0xffffffffu, best, o);
        best = other > best ? other : best;
    }
    if (lane == 0) {
        const u32 n = ~(u32)best;  // node 0 always qualifies: best is never 0
        const bool done = ctl_d[CTL_WORDS * b + CTL_DONE] != 0;
        settle_tree_row(t, T1, D, b, n, (u32)pred[n < T1 ? n : 0], done, vtok_d, brk_d, acc_d, last_pred_d, ctl_d);
    }
    __syncwarp();  // agree[] is the next row's
}

// A block of one warp a row (agree[] is the block's), blocks striding over the rows.
template <typename Tok>
__device__ void tree_accept_greedy(u32* tree, u32 T1, u32 W, u32 D, u32 B, const Tok* pred_d, u32* vtok_d, u32* brk_d,
                                   u32* acc_d, u32* last_pred_d, int* ctl_d) {
    for (u32 b = blockIdx.x; b < B; b += gridDim.x)
        tree_accept_greedy_row(b, tree, T1, W, D, B, pred_d, vtok_d, brk_d, acc_d, last_pred_d, ctl_d);
}

extern "C" __global__ void spec_tree_accept_greedy(u32* tree, u32 T1, u32 W, u32 D, u32 B, const u32* pred_d,
                                                   u32* vtok_d, u32* brk_d, u32* acc_d, u32* last_pred_d, int* ctl_d) {
    tree_accept_greedy(tree, T1, W, D, B, pred_d, vtok_d, brk_d, acc_d, last_pred_d, ctl_d);
}

extern "C" __global__ void spec_tree_accept_greedy_t64(u32* tree, u32 T1, u32 W, u32 D, u32 B, const u64* pred_d,
                                                       u32* vtok_d, u32* brk_d, u32* acc_d, u32* last_pred_d,
                                                       int* ctl_d) {
    tree_accept_greedy(tree, T1, W, D, B, pred_d, vtok_d, brk_d, acc_d, last_pred_d, ctl_d);
}

// 13 + 4 + 5. A greedy tree round's tail in one launch: for each row, kernel 13's acceptance,
//    then kernel 4's commit and kernel 5's rollback over `len_ptrs` (round_tail.cuh; vtok rows are
//    D + 1 words, so the commit's k is D), a block of one warp a row as kernel 13's. Kernel 15's
//    compaction runs after it: it reads keep, acc[ACC_ROUND], the path and pos_start, which the
//    commit and the rollback leave as the acceptance wrote them, and the commit and the rollback
//    read nothing the compaction writes (the KV entries).
template <typename Tok>
__device__ void tree_round_tail_greedy(u32* tree, u32 T1, u32 W, u32 D, u32 B, const Tok* pred_d, u32* vtok_d,
                                       u32* brk_d, u32* acc_d, u32* last_pred_d, int* ctl_d, u32* pend_d, u32* ring_d,
                                       u32 ring_cap, const u64* len_ptrs, u32 n_ptrs, const int* pos_start_d) {
    for (u32 b = blockIdx.x; b < B; b += gridDim.x) {
        tree_accept_greedy_row(b, tree, T1, W, D, B, pred_d, vtok_d, brk_d, acc_d, last_pred_d, ctl_d);
        commit_and_roll_back_row(b, vtok_d, acc_d, last_pred_d, ctl_d, pend_d, ring_d, ring_cap, D, len_ptrs, n_ptrs,
                                 pos_start_d);
    }
}

extern "C" __global__ void spec_tree_round_tail_greedy(u32* tree, u32 T1, u32 W, u32 D, u32 B, const u32* pred_d,
                                                       u32* vtok_d, u32* brk_d, u32* acc_d, u32* last_pred_d,
                                                       int* ctl_d, u32* pend_d, u32* ring_d, u32 ring_cap,
                                                       const u64* len_ptrs, u32 n_ptrs, const int* pos_start_d) {
    tree_round_tail_greedy(tree, T1, W, D, B, pred_d, vtok_d, brk_d, acc_d, last_pred_d, ctl_d, pend_d, ring_d,
                           ring_cap, len_ptrs, n_ptrs, pos_start_d);
}

extern "C" __global__ void spec_tree_round_tail_greedy_t64(u32* tree, u32 T1, u32 W, u32 D, u32 B,
                                                           const u64* pred_d, u32* vtok_d, u32* brk_d, u32* acc_d,
                                                           u32* last_pred_d, int* ctl_d, u32* pend_d, u32* ring_d,
                                                           u32 ring_cap, const u64* len_ptrs, u32 n_ptrs,
                                                           const int* pos_start_d) {
    tree_round_tail_greedy(tree, T1, W, D, B, pred_d, vtok_d, brk_d, acc_d, last_pred_d, ctl_d, pend_d, ring_d,
                           ring_cap, len_ptrs, n_ptrs, pos_start_d);
}

// 14. Sampling, recursive rejection without replacement. Every node judges its own children,
//     which needs nothing of the path: p and q at a node are the target's and the draft's there
//     whichever path leads to it. A node tries its children one at a time, and each rejection
//     needs the residual's mass Z, a sum over V: spec_tree_judge tests every node's first child,
//     then spec_tree_judge_pass j (j = 1, 2, ...: one launch each) sums Z for the nodes that
//     rejected j children and have more, spread over many blocks a node, and the node's last
//     block tests its next child. Then each row walks from the root through the accepted
//     children to the node where every child was rejected, and races the bonus over that node's
//     last residual (spec_tree_race), spread over many blocks.
//
// A node's verdict (judged, u32[B][T1][JUDGED_WORDS]): [0] the accepted child or NO_NODE, [1] r,
// the children rejected, [2] its children (at most MAX_TREE_DRAWS), [4..6) the q mass rejected
// (f64), then per child i (in rank order) its node at [8 + i] and token at [16 + i], and per
// rejection i the f32 bits of Z_i at [24 + i] (the residual's mass, once summed) and of the q
// mass left, m_i, at [32 + i].
#define V_CHILD 8
#define V_TOKEN 16
#define V_Z 24
#define V_LEFT 32
struct Residual {  // the p and q of a node after its rejections, at one entry v
    float f, g;
};

// p and q at entry v after the first `r` rejections (tokens x, normalisers z, masses left m),
// walked with constant indices (a register array stays in registers).
template <typename Words, typename Floats>
__device__ __forceinline__ Residual residual_at(float p0, float q0, u32 v, u32 r, const Words& x, const Floats& z,
                                                const Floats& m) {
    float f = p0, g = q0;
    bool removed = false;
#pragma unroll
    for (u32 i = 0; i < MAX_TREE_DRAWS; ++i) {
        if (i >= r) break;
        const float res = fmaxf(f - g, 0.f);
        f = z[i] > 0.f ? res / z[i] : f;
        removed = removed || v == x[i];
        g = removed || !(m[i] > 0.f) ? 0.f : q0 / m[i];
    }
    return {f, g};
}

// A node's verdict words, as the judges and the race read them.
struct Verdict {
    u32 x[MAX_TREE_DRAWS];
    float z[MAX_TREE_DRAWS], m[MAX_TREE_DRAWS];
    __device__ void load(const u32* words) {
#pragma unroll
        for (u32 i = 0; i < MAX_TREE_DRAWS; ++i) {
            x[i] = words[V_TOKEN + i];
            z[i] = __uint_as_float(words[V_Z + i]);
            m[i] = __uint_as_float(words[V_LEFT + i]);
        }
    }
};

// Test the node's child i (its verdict in `out`, p and q its laws, f32 per docs/trees.md) after
// i rejections: accepted, or one rejection more (its q mass removed). One thread.
__device__ void test_child(u32* out, u32 i, const float* p, const float* q, u32 V, u64 seed, u32 pos_start,
                           u32 depth) {
    Verdict v;
    v.load(out);
    const u32 c = out[V_CHILD + i], x = out[V_TOKEN + i];
    const float p_x = x < V ? tree_prob(p[x]) : 0.f, q_x = x < V ? tree_prob(q[x]) : 0.f;
    const Residual at = residual_at(p_x, q_x, x, i, v.x, v.z, v.m);
    const float u = philox_uniform(seed, pos_start + depth + 1, 0u, PURPOSE_ACCEPT, c - (depth + 1));
    if (__fmul_rn(u, at.g) < at.f) {
        out[0] = c;
        return;
    }
    double* removed = (double*)(out + 4);
    *removed += (double)q_x;
    out[V_LEFT + i] = __float_as_uint(__double2float_rn(1.0 - *removed));
    out[1] = i + 1;
}

// First: each node (blockIdx.x; blockIdx.y the row) lists its children in rank (draw) order,
// ties by index, and tests the first.
extern "C" __global__ void spec_tree_judge(u32* tree, u32 T1, u32 W, u32 D, u32 B, const float* p_d,
                                           const float* q_d, u32 V, const u64* seed_d, const int* pos_start_d,
                                           const int* ctl_d, u32* judged) {
    const u32 n = blockIdx.x, b = blockIdx.y;
    if (n >= T1 || b >= B) return;
    const TreeRows t = tree_rows(tree, T1, W, D, B, b);
    u32* out = judged + ((u64)b * T1 + n) * JUDGED_WORDS;
    __shared__ u32 s_count, s_child[MAX_TREE_DRAWS], s_rank[MAX_TREE_DRAWS];
    if (threadIdx.x == 0) s_count = 0;
    for (u32 w = threadIdx.x; w < JUDGED_WORDS; w += blockDim.x) out[w] = w == 0 ? NO_NODE : 0u;
    __syncthreads();
    if (ctl_d[CTL_WORDS * b + CTL_DONE] != 0 || t.rank[n] == VOID_RANK) return;
    for (u32 c = n + 1 + threadIdx.x; c < T1; c += blockDim.x) {  // the children, at most MAX_TREE_DRAWS
        if (t.parent[c] == n && t.rank[c] != VOID_RANK) {
            const u32 slot = atomicAdd(&s_count, 1u);
            if (slot < MAX_TREE_DRAWS) s_child[slot] = c, s_rank[slot] = t.rank[c];
        }
    }
    __syncthreads();
    const u32 r = min(s_count, (u32)MAX_TREE_DRAWS);
    if (threadIdx.x < r) {  // each child counts those before it
        const u32 c = s_child[threadIdx.x], k = s_rank[threadIdx.x];
        u32 before = 0;
        for (u32 j = 0; j < r; ++j) before += s_rank[j] < k || (s_rank[j] == k && s_child[j] < c);
        out[V_CHILD + before] = c;
        out[V_TOKEN + before] = t.tok[c];
    }
    if (threadIdx.x == 0) out[2] = r;
    __threadfence_block();
    __syncthreads();
    if (threadIdx.x == 0 && r > 0)
        test_child(out, 0, p_d + ((u64)b * T1 + n) * V, q_d + ((u64)b * T1 + n) * V, V, seed_d[b],
                   (u32)pos_start_d[b], t.depth[n]);
}

// Pass j: Z_j of each node that rejected j children and has another, over `slices` blocks a node
// (blockIdx.x = node * slices + slice, blockIdx.y the row): each block sums its share of V in f64
// into partial[b][node][slice]; the node's last block (counted, as race_settle does) adds them
// in slice order (the same sum in every launch: no atomics in the sum), and tests child j.
#define PASS_PER_THREAD 4
extern "C" __global__ void __launch_bounds__(TREE_THREADS)
spec_tree_judge_pass(u32* tree, u32 T1, u32 W, u32 D, u32 B, const float* p_d, const float* q_d, u32 V,
                     const u64* seed_d, const int* pos_start_d, u32* judged, u32 j, u32 slices, double* partial,
                     u32* counts) {
    const u32 n = blockIdx.x / slices, slice = blockIdx.x % slices, b = blockIdx.y;
    if (n >= T1 || b >= B) return;
    u32* out = judged + ((u64)b * T1 + n) * JUDGED_WORDS;
    if (out[0] != NO_NODE || out[1] != j || j >= min(out[2], (u32)MAX_TREE_DRAWS)) return;  // alike in every block
    __shared__ Verdict v;
    if (threadIdx.x == 0) v.load(out);
    __syncthreads();
    const float* p = p_d + ((u64)b * T1 + n) * V;
    const float* q = q_d + ((u64)b * T1 + n) * V;
    double sum = 0.0;  // the residual's mass with p and q after j - 1 rejections
    const u64 stride = (u64)slices * TREE_THREADS * PASS_PER_THREAD;
    for (u64 base = (u64)slice * TREE_THREADS * PASS_PER_THREAD + threadIdx.x; base < V; base += stride) {
        float pv[PASS_PER_THREAD], qv[PASS_PER_THREAD];
#pragma unroll
        for (u32 k = 0; k < PASS_PER_THREAD; ++k) {  // the loads first: their latency overlaps
            const u64 at = base + k * TREE_THREADS;
            pv[k] = at < V ? tree_prob(p[at]) : 0.f;
            qv[k] = at < V ? tree_prob(q[at]) : 0.f;
        }
#pragma unroll
        for (u32 k = 0; k < PASS_PER_THREAD; ++k) {
            const Residual at = residual_at(pv[k], qv[k], (u32)(base + k * TREE_THREADS), j - 1, v.x, v.z, v.m);
            sum += (double)fmaxf(at.f - at.g, 0.f);
        }
    }
    __shared__ double s_sum[TREE_THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (threadIdx.x % 32 == 0) s_sum[threadIdx.x / 32] = sum;
    __syncthreads();
    if (threadIdx.x != 0) return;
    for (u32 w = 1; w < TREE_THREADS / 32; ++w) sum += s_sum[w];
    double* mine = partial + ((u64)b * T1 + n) * slices;
    mine[slice] = sum;
    __threadfence();
    if (atomic_inc_acq_rel(&counts[(u64)b * T1 + n], slices - 1) != slices - 1) return;
    double z = 0.0;
    for (u32 s = 0; s < slices; ++s) z += ((volatile double*)mine)[s];
    out[V_Z + j - 1] = __float_as_uint(__double2float_rn(z));
    const TreeRows t = tree_rows(tree, T1, W, D, B, b);
    test_child(out, j, p, q, V, seed_d[b], (u32)pos_start_d[b], t.depth[n]);
}

// 14'. The walk and the bonus race: every block of row b walks the verdicts from node 0 (the
//      row's cap of steps at most: marked_limit, D where no length was chosen) to the stop node n,
//      races its slice of V over n's residual after its r - 1 first rejections (residual key:
//      max(f - g, 0), which outranks f itself), or over p itself where the walk stopped at the cap
//      (n's children not judged: r = 0), and the row's last block settles the row. scratch
//      u64[B][2] as race_settle takes it.
extern "C" __global__ void __launch_bounds__(TREE_THREADS)
spec_tree_race(u32* tree, u32 T1, u32 W, u32 D, u32 B, const float* p_d, const float* q_d, u32 V, const u64* seed_d,
               const int* pos_start_d, const u32* judged, u32* vtok_d, u32* brk_d, u32* acc_d, u32* last_pred_d,
               int* ctl_d, u64* scratch) {
    const u32 b = blockIdx.y;
    if (b >= B) return;
    const TreeRows t = tree_rows(tree, T1, W, D, B, b);
    const bool done = ctl_d[CTL_WORDS * b + CTL_DONE] != 0;
    const u32 cap = marked_limit(brk_d[BRK_WORDS * b + BRK_MARK], D);
    u32 n = 0, d = 0;
    for (; d < cap; ++d) {
        const u32 child = judged[((u64)b * T1 + n) * JUDGED_WORDS];
        if (child >= T1 || child <= n || t.parent[child] != n) break;
        n = child;
    }
    const u32* verdict = judged + ((u64)b * T1 + n) * JUDGED_WORDS;
    const u32 r = d < cap ? min(verdict[1], (u32)MAX_TREE_DRAWS) : 0u;  // at the cap, p itself
    Verdict verdict_of_n;
    verdict_of_n.load(verdict);
    u64 best = 0;
    if (!done) {
        const float* p = p_d + ((u64)b * T1 + n) * V;
        const float* q = q_d + ((u64)b * T1 + n) * V;
        const u64 seed = seed_d[b];
        const u32 a = (u32)pos_start_d[b] + t.depth[n] + 1, node = n - t.depth[n];
        for (u64 v = (u64)blockIdx.x * TREE_THREADS + threadIdx.x; v < V; v += (u64)gridDim.x * TREE_THREADS) {
            const float p0 = tree_prob(p[v]);
            const Residual at = r ? residual_at(p0, tree_prob(q[v]), (u32)v, r - 1, verdict_of_n.x, verdict_of_n.z,
                                                 verdict_of_n.m)
                                   : Residual{p0, 0.f};
            if (at.f > 0.f) {
                const float inv_e = __fdividef(1.f, philox_exponential(seed, a, (u32)v, PURPOSE_SAMPLE, node));
                const u64 residual_key = r ? race_key(fmaxf(at.f - at.g, 0.f), inv_e, (u32)v) : 0ull;
                best = race_max(best, residual_key ? residual_key | RESIDUAL_KEY : race_key(at.f, inv_e, (u32)v));
            }
        }
    }
    best = block_race_max<TREE_THREADS>(best);
    if (threadIdx.x != 0 || !race_settle(best, scratch + 2 * (u64)b, &best)) return;
    settle_tree_row(t, T1, D, b, n, best ? race_token(best) : NO_MASS_TOKEN, done, vtok_d, brk_d, acc_d, last_pred_d,
                    ctl_d);
}

// 15. KV compaction over a table of n_layers records (K base, V base, row stride, position
//     stride, bytes, capacity: bytes and strides multiples of 4). Block (layer, buffer, row) moves
//     the row's path entries d = 1..a, slot pos_start + path[d] to pos_start + d, in increasing d;
//     each thread owns the same words of every entry, so depth d's read comes before any later
//     depth's write of those words without a barrier. A done row (keep 0) moves nothing.
extern "C" __global__ void spec_tree_compact(const u64* table, u32 n_layers, u32* tree, u32 T1, u32 W, u32 D, u32 B,
                                             const u32* acc_d, const int* pos_start_d, const int* ctl_d) {
    for (u64 job = blockIdx.x; job < (u64)n_layers * 2 * B; job += gridDim.x) {
        const u32 layer = (u32)(job / (2 * B)), which = (u32)(job / B % 2), b = (u32)(job % B);
        const u64* rec = table + 6 * (u64)layer;
        const u64 base = rec[which];
        if (!base || ctl_d[CTL_WORDS * b + CTL_KEEP] == 0) continue;
        const u64 row_stride = rec[2], pos_stride = rec[3], words = rec[4] / 4, capacity = rec[5];
        const TreeRows t = tree_rows(tree, T1, W, D, B, b);
        const u32 a = min(acc_d[ACC_WORDS * b + ACC_ROUND], D);
        const u64 pos_start = (u64)(u32)pos_start_d[b];
        u32* row = (u32*)(base + b * row_stride);
        for (u32 d = 1; d <= a; ++d) {
            const u32 node = t.path[d];
            const u64 src = pos_start + node, dst = pos_start + d;
            if (node >= T1 || node == d || src >= capacity || dst >= capacity) continue;
            const u32* from = row + src * (pos_stride / 4);
            u32* to = row + dst * (pos_stride / 4);
            for (u64 w = threadIdx.x; w < words; w += blockDim.x) to[w] = from[w];
        }
    }
}

// 16, 17. Recurrent state (ptx/state.cuh), T1 slots a bank: the path's last node's slot is kept.
struct PathSlot {
    const u32* tree;
    u32 T1, W, D, B;
    const int* ctl_d;
    __device__ u32 operator()(u32 b) const {
        const u32 keep = min((u32)ctl_d[CTL_WORDS * b + CTL_KEEP], D + 1);
        if (keep == 0) return T1;  // nothing to roll back
        const u32 node = tree_rows((u32*)tree, T1, W, D, B, b).path[keep - 1];
        return min(node, T1 - 1);
    }
};

extern "C" __global__ void spec_tree_state_copy(const u64* table, u32 n_entries, const u32* tree, u32 T1, u32 W, u32 D,
                                                u32 B, const int* ctl_d) {
    state_copy_rows(table, n_entries, B, T1, PathSlot{tree, T1, W, D, B, ctl_d});
}

extern "C" __global__ void spec_tree_state_flip(const u64* idx_ptrs, u32 n_ptrs, const u32* tree, u32 T1, u32 W, u32 D,
                                                u32 B, const int* ctl_d) {
    state_flip_rows(idx_ptrs, n_ptrs, B, T1, PathSlot{tree, T1, W, D, B, ctl_d});
}
