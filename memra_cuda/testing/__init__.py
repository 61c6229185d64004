"""What users test their own kernels against, and what the demo decodes: the layer's contract in
numpy and a model to drive it with. None of the library's own modules imports it (the demo,
memra_cuda.__main__, decodes its toy).

- `memra_cuda.testing.reference`, `reference_tree`: every kernel of ptx/spec_*.cu as a numpy
  function over the same buffers, clamps included; what the GPU tests compare the kernels with,
  word for word.
- `memra_cuda.testing.philox`: the random numbers of sampling (docs/sampling.md), the very draws the
  kernels make, so a sampled token can be checked, not just its histogram.
- `memra_cuda.testing.toy`: the toy language model (docs/toy-model.md), its kernels on the GPU
  (ToyLM), the same model in numpy (numpy_loop: the whole speculative loop, the output a correct
  decoder must give), and over two GPUs (pipeline) or NCCL ranks (ranks).
Their PyTorch counterpart, random-weight Llamas for the PyTorch engine's tests, examples and
benchmark, is `memra_cuda.torch.testing`: it needs torch and transformers, which nothing outside
memra_cuda.torch imports.
"""
