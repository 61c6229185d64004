"""The PTX boundary: typed launchers of the committed kernels (ptx/*.cu) over the buffers, and
the kernels' ABI. SpecKernels launches the chain's kernels (spec_stream, spec_sample), TreeKernels
the tree's (spec_tree); each checks its buffers when it prepares a launch, never in the per-round
path. SIGNATURES (signatures.py) declares every kernel's parameters, names and types, as its
source does: the modules the launchers load (signatures.load) check every prepare against it."""
from .signatures import SIGNATURES
from .spec import SpecKernels
from .tree import SampledCandidates, TreeKernels

__all__ = ["SIGNATURES", "SampledCandidates", "SpecKernels", "TreeKernels"]
