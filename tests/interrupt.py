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
