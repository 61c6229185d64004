"""A KeyboardInterrupt where a user's Ctrl-C lands in a wait: the GPU tests of a burst whose
readback an interrupt cut short (RoundStream.recover, a Server's next step). The device runs as
it would; only the host's wait is cut."""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator


def interrupt_once(monkeypatch, owner, name: str, *, waited: bool = True) -> None:
    """`owner.name`'s next call raises KeyboardInterrupt, once: after the call (`waited`: the wait
    ended, its result unread) or instead of it (the interrupt came inside the wait, which is the
    read). Every later call is the original's."""
    original, cut = getattr(owner, name), []

    def interrupted(*args):
        if cut:
            return original(*args)
        cut.append(name)
        if waited:
            original(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(owner, name, interrupted)


@contextlib.contextmanager
def acting_before(module, source_line: str, action: Callable[[], object]) -> Iterator[list[str]]:
    """Inside the block, `action()` run once as `module` is about to run its line whose text
    (stripped) is `source_line`: another thread's call landing between two statements of its
    bookkeeping (or a Ctrl-C: interrupt_before). A line trace of this thread's, the tracer before
    it (coverage's, a debugger's) back when the block ends. Gives the list it appends to once run."""
    lines = open(module.__file__).read().splitlines()
    found = [i + 1 for i, text in enumerate(lines) if text.strip() == source_line]
    assert len(found) == 1, f"{module.__name__} has {len(found)} lines {source_line!r}"
    fired: list[str] = []
    previous = sys.gettrace()

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == found[0] and not fired:
            fired.append(source_line)
            action()  # untraced: a trace function runs with tracing off
        return local

    sys.settrace(lambda frame, event, arg: local if frame.f_code.co_filename == module.__file__ else None)
    try:
        yield fired
    finally:
        sys.settrace(previous)


def interrupt_before(module, source_line: str) -> contextlib.AbstractContextManager[list[str]]:
    """Inside the block, a KeyboardInterrupt raised once, as `module` is about to run its line
    whose text (stripped) is `source_line`: a Ctrl-C landing between two statements (acting_before)."""
    return acting_before(module, source_line, _interrupt)


def _interrupt() -> None:
    raise KeyboardInterrupt
