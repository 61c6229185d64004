// Recurrent state rollback (hybrid models), shared by the chain's kernels 8 and 9
// (spec_stream.cu) and the tree's 16 and 17 (spec_tree.cu): a layer whose state cannot be rolled
// back by a length keeps the state after each of the round's verify tokens in a slot (n_slots a
// bank), and rollback makes one slot per row the live state. Which slot is the kind of round's:
// a chain's keep - 1 (the last kept token), a tree's the accepted path's last node. `slot_of(b)`
// gives it, or n_slots where row b rolls nothing back (a done row); it is always < n_slots else.
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;

// Copy: table holds n_entries records of 3 words, (live, slots, row_words), live [B][row_words]
// and slots [B][n_slots][row_words] 32-bit words, a zero live address standing for a layer
// without state. Row b's live state becomes its slot slot_of(b). blockIdx.x strides over the
// (entry, row) pairs, blockIdx.y and the threads over the row's words.
template <typename SlotOf>
__device__ __forceinline__ void state_copy_rows(const u64* table, u32 n_entries, u32 B, u32 n_slots, SlotOf slot_of) {
    for (u64 pair = blockIdx.x; pair < (u64)n_entries * B; pair += gridDim.x) {
        const u32 entry = (u32)(pair / B), b = (u32)(pair % B), slot = slot_of(b);
        u32* live = (u32*)table[3 * (u64)entry];
        if (!live || slot >= n_slots) continue;
        const u64 row_words = table[3 * (u64)entry + 2];
        const u32* src = (const u32*)table[3 * (u64)entry + 1] + ((u64)b * n_slots + slot) * row_words;
        u32* dst = live + (u64)b * row_words;
        for (u64 i = blockIdx.y * (u64)blockDim.x + threadIdx.x; i < row_words; i += (u64)gridDim.y * blockDim.x)
            dst[i] = src[i];
    }
}

// Flip: each non-zero entry of idx_ptrs points at a u32[B], the slot of 2 n_slots, two banks,
// that row b's model reads as its live state; the verify wrote its states to the other bank. Row
// b's index becomes that bank's slot slot_of(b); a garbage index (>= 2 n_slots) counts as bank 1,
// so the new one is always in range.
template <typename SlotOf>
__device__ __forceinline__ void state_flip_rows(const u64* idx_ptrs, u32 n_ptrs, u32 B, u32 n_slots, SlotOf slot_of) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < (u64)n_ptrs * B; i += (u64)gridDim.x * blockDim.x) {
        const u32 entry = (u32)(i / B), b = (u32)(i % B), slot = slot_of(b);
        u32* idx = (u32*)idx_ptrs[entry];
        if (idx && slot < n_slots) idx[b] = (1 - min(idx[b] / n_slots, 1u)) * n_slots + slot;
    }
}
