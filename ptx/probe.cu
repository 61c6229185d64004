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
