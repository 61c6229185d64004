"""memra_cuda inside a PyTorch engine (optional: needs `torch`, and `transformers` for the models;
the core never imports either). docs/torch.md is its page.

What every PyTorch engine of this layer reuses, a module a concept:

- `adapter` — `engine()`, an Engine whose rounds run on torch's stream and capture through
  torch's allocator;
- `views` — tensors on memra's buffers and back, no copy (the words a chain's or a tree's
  callables read);
- `kv` — static KV caches registered as round-stream's KV tables (and KVData for a tree's
  compaction), and a paged layout that compacts itself;
- `state` — recurrent state rolled back by copy or by flipping an index;
- `mask` — a tree's ancestor mask as SDPA's attention mask;
- `stack` — a transformers Llama-family model's layers over those caches, positions read on the
  device; `compiled` — the same as one compiled step over the model's fused weights (`fused`),
  attending by `attention`, what the decoders run where a model fuses; `prefill` — prompts into
  either;
- `decoder` — prefill graphs, a request's admission into a row, generating a batch and serving
  a queue (memra_cuda.rounds.serving's Server), for a target and a draft model; `chain` and
  `tree` its two rounds;
- `greedy` — the target's own greedy decoding, graphed and Hugging Face's, to measure and check
  against; `models` — loading a checkpoint directory, and a self-speculative draft; `parallel` —
  a model's layers split over tensor-parallel ranks; `testing` — random-weight Llamas for the
  tests, the examples and the benchmark, not imported here.
"""
try:  # torch first, so that its absence says how to install it rather than naming a module alone
    import torch  # noqa: F401
except ModuleNotFoundError as exc:
    # Still a ModuleNotFoundError of that name (callers that tolerate a missing extra read exc.name);
    # memra_cuda is on no index, so the extra is installed from the checkout, as the README says.
    raise ModuleNotFoundError(f"memra_cuda.torch needs PyTorch ({exc.name!r} is not installed): in memra_cuda's "
                              f"checkout, install the torch extra: pip install '.[torch]'", name=exc.name) from exc

from .adapter import capture, engine, framework, loop_capture
from .chain import SpeculativeLlama
from .compiled import CompiledStack
from ..rounds.serving import Request, Served
from .decoder import RoundDecoder
from .greedy import GraphedGreedy, hf_generate, hf_greedy
from .kv import PagedKV, Room, StaticKV, capacity_for, head_size
from .mask import TreeMask
from .models import load_model, load_tokenizer, self_draft
from .parallel import shard
from .sampling import SamplingParams
from .stack import Stack
from .state import CopyState, FlipState, LiveState, Recurrent
from .tree import TreeLlama, best_ranks
from .views import RoundViews, TreeViews, buffer, tensor

__all__ = [
    "engine", "framework", "capture", "loop_capture", "buffer", "tensor", "RoundViews", "TreeViews",
    "StaticKV", "PagedKV", "Room", "capacity_for", "head_size", "Recurrent", "LiveState", "CopyState", "FlipState",
    "TreeMask", "Stack", "CompiledStack", "SamplingParams", "Request", "Served", "RoundDecoder", "SpeculativeLlama",
    "TreeLlama", "best_ranks", "GraphedGreedy", "hf_generate", "hf_greedy", "load_model", "load_tokenizer",
    "self_draft", "shard",
]
