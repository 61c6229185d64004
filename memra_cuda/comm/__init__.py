"""Ranks on NCCL, one process a GPU (docs/nccl.md): the library (optional: the `nccl` extra), a
rank's place from its launcher's environment and the id exchange, and the Communicator whose
operations queue on an engine's stream and whose watchdog keeps a dead peer from hanging a wait.
Nothing here loads NCCL until a communicator is made."""
from .communicator import Communicator, RankFailure, RanksDiverged, digest
from .library import NcclError, NcclUnavailable, nccl
from .rendezvous import RankRefused, Ranks, exchange_id

__all__ = ["Communicator", "NcclError", "NcclUnavailable", "RankFailure", "RankRefused", "Ranks", "RanksDiverged",
           "digest", "exchange_id", "nccl"]
