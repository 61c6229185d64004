"""Handle: the one base of everything that owns a driver resource or names device memory.

Two rules live here, so no class has its own copy of them:

- **Free once.** The release runs through a `weakref.finalize` that holds the context, never
  the owner, so free(), leaving a `with` block and garbage collection all end in the same
  single release, and the context is alive whenever it runs (as in cuda.core's Buffer).
- **Nothing runs on a stale address.** A launch, a graph or a pointer table copies device
  addresses out of the buffers it was given; the driver will use those copies later. Such a
  holder registers as a *dependent* of each handle it names (weakly: the holder keeps the
  handle alive, not the other way round). When a handle is freed explicitly, its dependents
  are poisoned: from then on they raise ValueError naming the freed handle instead of
  reaching the driver. The check costs the hot path one attribute test.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from .context import PrimaryContext

_Self = TypeVar("_Self", bound="Handle")


class Handle:
    """Usable until freed (or poisoned); freed exactly once."""

    _finalizer: weakref.finalize | None = None
    _dependents: weakref.WeakSet | None = None
    _freed = False
    # Why this handle may no longer be used (None while it may): checked before every use.
    _refusal: str | None = None

    def _own(self, ctx: PrimaryContext, release: str, raw: Any, *, at_exit: bool = True) -> None:
        """Take ownership of `raw`, released by the driver call `release` in `ctx`.

        at_exit=False leaves the release to the context's own teardown when the interpreter
        exits (modules: unloading one at exit gains nothing and can race the context)."""
        self._finalizer = weakref.finalize(self, ctx.finalize, release, raw)
        self._finalizer.atexit = at_exit

    @property
    def freed(self) -> bool:
        """Whether free() has run: every use is refused from then on (ValueError)."""
        return self._freed

    def free(self) -> None:
        """Release what this handle owns (drop what it borrows); idempotent. Everything that
        captured this handle's address refuses to run from now on."""
        if self._freed:
            return
        name = repr(self)
        self._freed = True
        self._refusal = f"{type(self).__name__} used after free"
        if self._finalizer is not None:
            self._finalizer()
        self._notify(f"{name}, which was freed")

    def _retire(self) -> None:
        """Refuse every use from now on and poison the dependents, as free() does, but leave the
        release to this handle's collection: for what something outside memra still uses (an
        array keeping an exported buffer, a consumer of an exported stream's handle)."""
        release, self._finalizer = self._finalizer, None
        Handle.free(self)
        self._finalizer = release

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    # -- dependents -----------------------------------------------------------------------
    def depend(self, dependent: Handle) -> None:
        """Poison `dependent` (held weakly) when this handle is freed or poisoned."""
        if self._dependents is None:
            self._dependents = weakref.WeakSet()
        self._dependents.add(dependent)

    def _notify(self, reason: str) -> None:
        for dependent in list(self._dependents or ()):
            dependent._poison(self, reason)

    def _poison(self, source: Handle, reason: str) -> None:
        """`source`, which this handle uses (its address, its stream), is gone: refuse to run
        from now on."""
        if self._refusal is None:
            self._refusal = f"{type(self).__name__} refuses to run: it uses {reason}"
            self._notify(reason)

    def _usable(self) -> None:
        if self._refusal is not None:
            raise ValueError(self._refusal)
