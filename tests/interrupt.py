"""A KeyboardInterrupt where a user's Ctrl-C lands in a wait: the GPU tests of a burst whose
readback an interrupt cut short (RoundStream.recover, a Server's next step). The device runs as
it would; only the host's wait is cut."""
from __future__ import annotations


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


def interrupt_before(module, source_line: str) -> list[str]:
    """A KeyboardInterrupt raised once, as `module` is about to run its line whose text (stripped)
    is `source_line`: a Ctrl-C landing between two statements of its bookkeeping (Python delivers
    one between any two). A line trace, on this thread alone, removed once it fired; the caller
    removes it where it did not (sys.settrace(None)). Gives the list it appends to once fired."""
    import sys
    lines = open(module.__file__).read().splitlines()
    found = [i + 1 for i, text in enumerate(lines) if text.strip() == source_line]
    assert len(found) == 1, f"{module.__name__} has {len(found)} lines {source_line!r}"
    fired: list[str] = []

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == found[0] and not fired:
            fired.append(source_line)
            sys.settrace(None)
            raise KeyboardInterrupt
        return local

    sys.settrace(lambda frame, event, arg: local if frame.f_code.co_filename == module.__file__ else None)
    return fired
