"""The row layouts of the round-stream buffers, the one Python statement of ptx/layout.cuh.

The kernels and the host index the same words: StreamBufs writes the stop rule into ctl_d and
reads done flags and rings back, the numpy reference (the tests' oracle) updates every row as a
kernel does. Both sides take the word indices from here and ptx/layout.cuh, whose values
tests/kernels/test_ptx.py checks against these, so they cannot drift apart; production code needs no
import of the reference for them. Row b of a buffer of W words per row starts at word b * W. This
module imports nothing from the package, so anything may import it.
"""
from __future__ import annotations

# ctl_d, i32[B][CTL_WORDS]: the stop rule and the round's verdict.
CTL_EOS = 0  # the EOS id, or negative for none
CTL_BUDGET = 1  # tokens still to commit; negative: unlimited
CTL_DONE = 2  # non-zero once the row stopped
CTL_KEEP = 3  # KV entries of the round that survive it (rollback)
CTL_WORDS = 4

# brk_d, u32[B][BRK_WORDS]: this round's cap on acceptance (i + 1: at most i drafts, 0: none; the
# draft's p-min break and the chosen draft length lower it, the smaller cap wins), and caps counted.
BRK_MARK = 0
BRK_COUNT = 1
BRK_WORDS = 2

# acc_d, u32[B][ACC_WORDS]: the drafts accepted this round, and in total (wrapping).
ACC_ROUND = 0
ACC_TOTAL = 1
ACC_WORDS = 2

# rate_d, f32[B][RATE_WORDS] (DraftLengths, docs/lengths.md): a row's running acceptance, the
# drafts it accepted and the rounds that rejected one, each decayed by a fixed factor a round.
RATE_ACCEPTED = 0
RATE_REJECTED = 1
RATE_WORDS = 2

# cost_d, f32[COST_VERIFY + k + 1] (DraftLengths): a draft step's cost, then a verify of w + 1
# tokens' for w = 0..k, in plain steps (COST_VERIFY + 0, a verify of the pending token alone).
COST_DRAFT = 0
COST_VERIFY = 1

# ring_d, u32[B][RING_TOKENS + ring_cap]: the count of committed tokens, then the tokens.
RING_COUNT = 0
RING_TOKENS = 1

# The head of device mode's token feed (mapped pinned memory, device_loop.TokenFeed): a word
# the loop's last node sets once it has ended, the publishes so far, and the newest one's stamp;
# each row's published count, then the tokens and their stamps follow it.
HEAD_ENDED = 0
HEAD_SEQ = 1
HEAD_STAMP = 2
HEAD_WORDS = 4  # one word of padding: the counts start 16 bytes in

# Trees (docs/trees.md): node 0's parent, the rank of a void node (never accepted), and the
# limits the tree kernels are written for: nodes a tree may have (8 mask words of 32 bits),
# draws a sampled node may have drawn for its children, and a dynamic level's offers (width x
# branch, in the grow kernel's shared memory).
ROOT_PARENT = 0xFFFFFFFF
VOID_RANK = 0xFFFFFFFF
MAX_TREE_NODES = 256
MAX_TREE_DRAWS = 8
MAX_TREE_OFFERS = 1024
