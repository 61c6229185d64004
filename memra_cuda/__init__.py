"""memra_cuda: driver-level CUDA for inference engines, built around round-stream speculative
decoding: M rounds of draft + verify queued on one stream, one host readback per burst.

The root holds what an engine that plugs its model in needs; the rest lives in the layers it
comes from, each importing only those below it: `driver` (CUDA, knowing nothing of
speculation), `buffers` (the device state of a burst and the tables a round rolls back),
`kernels` (the launchers of the committed PTX), `rounds` (a round as an object, RoundStream's
modes, the device loop), `comm` (NCCL ranks) and, at the edge, `torch` (the PyTorch engine)
and `testing` (the kernels' numpy contract and the toy model). Every error: `errors`.

New here: the README's quick start (the toy model decoded on GPU 0; `python -m memra_cuda` runs
it as a demo), then docs/README.md, which orders the contract's pages: docs/model-side.md (what
your model supplies), docs/round-stream.md and docs/buffers.md (what runs it); a PyTorch engine
starts at docs/torch.md (`memra_cuda.torch`). The pages are the checkout's docs/, and an
installed wheel carries them as memra_cuda/docs/.
"""
from .buffers.acceptance import Greedy, Sampling
from .buffers.capacity import UNCHECKED, kv_capacity
from .buffers.geometry import Geometry
from .buffers.stream_bufs import StreamBufs
from .buffers.tables import Cache, KVLayer, StateLayer, kv_data_table, kv_len_ptr_table, state_copy_table
from .buffers.tree import Candidates, DynamicTree, TreeBufs, TreeShape
from .driver import DeviceBuffer, Engine, Event, Graph, MemraError, Module, Stream, compile_ptx
from .rounds.round import ChainRound, Stages, chain
from .rounds.stream import Mode, RoundStream
from .rounds.tree_round import TreeRound

__version__ = "0.4.0.dev0"  # the one place the version lives: pyproject.toml reads it (tool.hatch.version)

__all__ = [
    "Engine", "Stream", "DeviceBuffer", "Event", "Graph", "Module", "compile_ptx", "MemraError",
    "Geometry", "StreamBufs", "Cache", "KVLayer", "kv_len_ptr_table", "kv_capacity", "UNCHECKED",
    "StateLayer", "state_copy_table", "kv_data_table",
    "Greedy", "Sampling", "RoundStream", "Mode", "ChainRound", "TreeRound", "Stages", "chain",
    "TreeShape", "DynamicTree", "TreeBufs", "Candidates",
]
