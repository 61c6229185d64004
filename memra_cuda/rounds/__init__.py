"""The round machinery: a round as an object (ChainRound, TreeRound, over Stages), the pace of
bursts, RoundStream's five modes, device mode's loop with the token feed it fills and the
schedule by which the host looks at it, and a Server: continuous batching over any decoder's
slots."""
from .device_loop import DeviceLoop, Landed, RoundCapError, TokenFeed
from .pace import Pace
from .round import ChainRound, Round, Stages, Step, chain
from .schedule import Schedule
from .serving import Burst, Decoder, Progress, Request, RequestRefused, Served, Server
from .stream import MODES, Mode, RoundStream
from .tree_round import TreeRound

__all__ = ["Burst", "ChainRound", "Decoder", "DeviceLoop", "Landed", "MODES", "Mode", "Pace", "Progress", "Request",
           "RequestRefused", "Round", "RoundCapError", "RoundStream", "Schedule", "Served", "Server", "Stages", "Step",
           "TokenFeed", "TreeRound", "chain"]
