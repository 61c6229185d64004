// Tiny kernels for the driver layer's own tests and the bench's measurements.

// x[i] += 1 for i < n.
extern "C" __global__ void probe_increment(unsigned* x, unsigned n) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1u;
}

// One argument, one store: a launch whose cost is all launch.
extern "C" __global__ void probe_touch(unsigned* x) {
    if (threadIdx.x == 0) x[0] += 1u;
}

// Busy for `cycles` clock cycles, then x[0] += 1: work that is still running when the host looks,
// for tests of what must wait for queued work (a borrowed buffer's free, joined streams).
extern "C" __global__ void probe_spin(unsigned* x, unsigned long long cycles) {
    const long long start = clock64();
    while ((unsigned long long)(clock64() - start) < cycles) {
    }
    if (threadIdx.x == 0) x[0] += 1u;
}

// Holds its stream until the host writes go[0] (mapped host memory), or for at most `most` clock
// cycles: work queued behind it is still queued when the host looks, whatever the machine's load
// (a spin of fixed cycles could end while the host was descheduled, the suites sharing one GPU and
// its cores), and a test that fails before it says go holds its stream for `most`, not for ever.
extern "C" __global__ void probe_gate(volatile unsigned* go, unsigned long long most) {
    const long long start = clock64();
    while (go[0] == 0u && (unsigned long long)(clock64() - start) < most) {
    }
}

// The device's clock against the host's: flag is mapped host memory, u32 [go, answered, waiting].
// The kernel says it is waiting, spins until the host says go, stores %globaltimer (ns) and
// answers; the host's time halfway between go and the answer is the same instant, to within half
// the round trip (~1.2 µs on the H200).
extern "C" __global__ void probe_clock(volatile unsigned* flag, volatile unsigned long long* device_ns) {
    flag[2] = 1u;
    __threadfence_system();
    while (flag[0] == 0u) {
    }
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    device_ns[0] = t;
    __threadfence_system();
    flag[1] = 1u;
}
