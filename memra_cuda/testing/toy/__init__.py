"""The toy language model (docs/toy-model.md): a hash-based target whose next token depends on
every KV entry, and a draft that is wrong where told to be, as PTX kernels (ToyLM) and in numpy
(numpy_loop); on two GPUs of one process (pipeline) and over NCCL ranks (ranks). The demo
(`python -m memra_cuda`) and the benchmarks decode it, and a test of one's own kernels or engine
can drive round-stream with it where a real model is not the point; round-stream knows nothing
of it."""
from .lm import (COST_8B_05B, STATE_ROLLBACKS, ToyCost, ToyLM, ToyModel, ToySampling, ToyStates, target_greedy)

__all__ = ["COST_8B_05B", "STATE_ROLLBACKS", "ToyCost", "ToyLM", "ToyModel", "ToySampling", "ToyStates",
           "target_greedy"]
