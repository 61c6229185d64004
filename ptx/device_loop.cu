// The decider of device-resident generation (docs/device-mode.md, "Its kernels"): the kernel
// that ends every pass of a conditional WHILE node running the rounds, and the one before each
// loop. It sets the loop's condition on the device, so the host is out of the loop.
//
// cudaGraphSetConditional is declared here, not included: NVRTC has no declaration of its own,
// and the driver links the call when it loads the PTX (no relocatable code, no cudadevrt). It
// needs a driver with conditional graph nodes (CUDA 12.4+), which is why this kernel has a
// module of its own: spec_stream.ptx stays loadable everywhere.
#include "layout.cuh"

typedef unsigned int u32;
typedef unsigned long long u64;

extern "C" __device__ void cudaGraphSetConditional(u64 handle, unsigned int value);

// loop_d is u32[2]: the most rounds this launch may run (the cap, written by the host before
// the launch), then the rounds run so far (zeroed by the launch's first node); `ran` adds the
// rounds of the pass that just ended (0 before a loop).
//
// The loop runs another pass of `body` rounds while some row is live and the cap leaves room
// for the whole pass. `paced` (device-side pacing, as Pace on the host) asks more: that some
// live row is expected to need `body` rounds more, at the tokens per round it committed so far
// (pub_d: its tokens in this launch; acc_d's total: its accepted drafts since its reset, so
// the estimate is exact for a request that starts with the launch), or at one before it
// committed any. A row with no budget always may. One block.
//
// Whatever loop_d holds, the loop ends: the rounds are counted in 64 bits, saturating at
// 2**32 - 1, so rounds + body never wraps below the cap (in u32, a cap word near 2**32 or a
// count word near it wrapped the test, and a loop of live rows never ended).
extern "C" __global__ void spec_loop_decide(const int* ctl_d, const u32* pub_d, const u32* acc_d, u32 B,
                                            u32* loop_d, u64 handle, u32 ran, u32 body, u32 paced) {
    int live = 0, long_way = 0;
    for (u32 b = threadIdx.x; b < B; b += blockDim.x) {
        const int* ctl = ctl_d + CTL_WORDS * b;
        if (ctl[CTL_DONE] != 0) continue;
        live = 1;
        const int budget = ctl[CTL_BUDGET];
        const u64 got = pub_d[b], accepted = acc_d[ACC_WORDS * b + ACC_TOTAL];
        const u64 rounds = got > accepted ? got - accepted : 0;  // rounds that committed `got`
        long_way |= budget < 0 || (rounds ? (u64)budget * rounds >= (u64)body * got : (u32)budget >= body);
    }
    live = __syncthreads_or(live);
    long_way = __syncthreads_or(long_way);
    if (threadIdx.x == 0) {
        const u64 rounds = min((u64)loop_d[1] + ran, 0xFFFFFFFFull);
        loop_d[1] = (u32)rounds;
        cudaGraphSetConditional(handle, (paced ? long_way : live) && rounds + body <= loop_d[0] ? 1u : 0u);
    }
}

// The gate of a round's model work in a burst graph (docs/capacity.md, "Rounds past the end"):
// the conditional IF node after this kernel runs the round's draft and verify while some row is
// live, and skips them once every row is done, so a burst that runs past its rows' ends costs
// its rounds' small kernels, not their forwards. The round's own kernels around the node take a
// done row's path as ever. One block.
extern "C" __global__ void spec_rows_live(const int* ctl_d, u32 B, u64 handle) {
    int live = 0;
    for (u32 b = threadIdx.x; b < B; b += blockDim.x) live |= ctl_d[CTL_WORDS * b + CTL_DONE] == 0;
    live = __syncthreads_or(live);
    if (threadIdx.x == 0) cudaGraphSetConditional(handle, live ? 1u : 0u);
}

// The switch of a round's bodies by width (docs/lengths.md, "Running the chosen width"):
// the conditional SWITCH node after this kernel runs body body_of[W] of its bodies, W the width
// the length chooser wrote to width_d[0] this round (past k read as k). body_of is u32[k + 1],
// written by the host: for each width, the body of the narrowest width at least as wide, so a
// width with no body of its own runs a wider one (its rows capped at their lengths, which keeps
// it exact) and every width runs one. It needs a driver with SWITCH nodes (CUDA 12.8+). One
// thread.
extern "C" __global__ void spec_select_width(const u32* width_d, const u32* body_of, u32 k, u64 handle) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        const u32 width = width_d[0];
        cudaGraphSetConditional(handle, body_of[width < k ? width : k]);
    }
}
