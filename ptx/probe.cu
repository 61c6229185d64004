// Two tiny kernels for the driver layer's own tests and the launch-overhead measurement.

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
