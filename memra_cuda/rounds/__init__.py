"""The round machinery: a round as an object (ChainRound, TreeRound, over Stages), the pace of
bursts, RoundStream's five modes, and device mode's loop with the token feed it fills and the
schedule by which the host looks at it."""
from .device_loop import DeviceLoop, Landed, RoundCapError, TokenFeed
from .pace import Pace
from .round import ChainRound, Round, Stages, Step, chain
from .schedule import Schedule
from .stream import MODES, Mode, RoundStream
from .tree_round import TreeRound

__all__ = ["ChainRound", "DeviceLoop", "Landed", "MODES", "Mode", "Pace", "Round", "RoundCapError", "RoundStream",
           "Schedule", "Stages", "Step", "TokenFeed", "TreeRound", "chain"]
