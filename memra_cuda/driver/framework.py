"""Framework: how the framework that owns an engine's memory wants work captured and scoped.

A framework with an allocator of its own (PyTorch) must know when a capture is running, or the
memory it hands out during the capture is given to later tensors and overwritten at every
replay; its operations must run on the engine's stream. Only that framework knows how, so the
stream carries the policy it was made with (`memra_cuda.torch.engine()` gives torch's) and the
layers above ask the engine, never the objects they are handed.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Framework:
    """`capture` captures a burst's graph (a graph.Capture; None: the driver's stream capture);
    `loop_capture` turns device mode's loop builder into the Capture of its WHILE nodes, which a
    framework's own graph API cannot build (None: graph.loops); `scope` is entered around the
    model's work, once a burst (default: nothing; torch's makes the engine's stream current)."""

    capture: Callable[..., tuple[Any, Any]] | None = None
    loop_capture: Callable[..., Callable[..., tuple[Any, Any]]] | None = None
    scope: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext


DRIVER = Framework()  # no framework: the driver's own capture, no scope
