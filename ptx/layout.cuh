// The row layouts of the round-stream buffers that Python reads and writes too: StreamBufs,
// the numpy reference and the readback index them with memra_cuda/buffers/layout.py's names, which hold
// these values (tests/kernels/test_ptx.py checks the two agree). Row b of a buffer of W words per row
// starts at word b * W.
#pragma once

// ctl_d, i32[B][CTL_WORDS]: the stop rule and the round's verdict.
#define CTL_EOS 0     // the EOS id, or negative for none
#define CTL_BUDGET 1  // tokens still to commit; negative: unlimited
#define CTL_DONE 2    // non-zero once the row stopped
#define CTL_KEEP 3    // KV entries of the round that survive it (rollback)
#define CTL_WORDS 4

// brk_d, u32[B][BRK_WORDS]: this round's cap on acceptance (i + 1: at most i drafts, 0: none; the
// draft's p-min break and the chosen draft length lower it, the smaller cap wins), and caps counted.
#define BRK_MARK 0
#define BRK_COUNT 1
#define BRK_WORDS 2

// Two caps on a row's acceptance (mark words: i + 1 caps at i drafts, 0 caps nothing) as one,
// the smaller: whoever writes the mark only lowers it, so the order they run in does not matter.
static __device__ __forceinline__ unsigned int tighter_mark(unsigned int mark, unsigned int cap) {
    return mark == 0 ? cap : cap == 0 ? mark : min(mark, cap);
}

// The most drafts a row's acceptance may keep under its mark: `most` (k, or a tree's depth) where
// the mark is 0, else mark - 1 or `most`, the smaller. Every acceptance kernel reads it so.
static __device__ __forceinline__ unsigned int marked_limit(unsigned int mark, unsigned int most) {
    return mark ? min(most, mark - 1) : most;
}

// acc_d, u32[B][ACC_WORDS]: the drafts accepted this round, and in total (wrapping).
#define ACC_ROUND 0
#define ACC_TOTAL 1
#define ACC_WORDS 2

// rate_d, f32[B][RATE_WORDS] (DraftLengths, docs/lengths.md): a row's running acceptance, the
// drafts it accepted and the rounds that rejected one, each decayed by a fixed factor a round.
#define RATE_ACCEPTED 0
#define RATE_REJECTED 1
#define RATE_WORDS 2

// cost_d, f32[COST_VERIFY + k + 1] (DraftLengths): a draft step's cost, then a verify of w + 1
// tokens' for w = 0..k, in plain steps (COST_VERIFY + 0, a verify of the pending token alone).
#define COST_DRAFT 0
#define COST_VERIFY 1

// ring_d, u32[B][RING_TOKENS + ring_cap]: the count of committed tokens, then the tokens.
#define RING_COUNT 0
#define RING_TOKENS 1

// The head of device mode's token feed (mapped pinned memory, device_loop.TokenFeed): a word
// the loop's last node sets once it has ended, the publishes so far, and the newest one's stamp;
// each row's published count, then the tokens and their stamps follow it.
#define HEAD_ENDED 0
#define HEAD_SEQ 1
#define HEAD_STAMP 2
#define HEAD_WORDS 4  // one word of padding: the counts start 16 bytes in

// Trees (docs/trees.md): node 0's parent, the rank of a void node (never accepted), and the
// limits the tree kernels are written for: nodes a tree may have (8 mask words of 32 bits),
// draws a sampled node may have drawn for its children, and a dynamic level's offers (width x
// branch, in the grow kernel's shared memory).
#define ROOT_PARENT 4294967295u  // 0xFFFFFFFF
#define VOID_RANK 4294967295u    // 0xFFFFFFFF
#define MAX_TREE_NODES 256
#define MAX_TREE_DRAWS 8
#define MAX_TREE_OFFERS 1024
