"""The PTX boundary: typed launchers of the committed kernels (ptx/*.cu) over the buffers.
SpecKernels launches the chain's kernels (spec_stream, spec_sample), TreeKernels the tree's
(spec_tree); each checks its buffers when it prepares a launch, never in the per-round path."""
from .spec import SpecKernels
from .tree import SampledCandidates, TreeKernels

__all__ = ["SampledCandidates", "SpecKernels", "TreeKernels"]
