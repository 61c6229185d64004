"""A kernel's parameters by name and type, declared once beside its PTX.

The driver can tell a kernel's parameter sizes (cuFuncGetParamInfo), not their types: a u32
passed where the kernel reads an f32, or an i32 where it reads a u32, has the right size and
arrives as bits the kernel reads as another number. A Signature says what each parameter is, so
a launch prepared with other types is refused at prepare, naming the kernel and the parameter,
and a launcher can take the types from the table instead of repeating them (Module's
`signatures`; the package's own table is memra_cuda.kernels.signatures). Types cannot tell two
u32s apart (k and B swapped arrive as the other's number), names can: a kernel with a Signature
takes its arguments by name (`arguments`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

# A kernel argument's type, as Launch packs it: "ptr" is a device pointer (a DeviceBuffer, a
# __cuda_array_interface__ object, or an int: an address the caller vouches for).
ArgType = Literal["ptr", "u32", "i32", "u64", "i64", "f32", "f64"]
ARG_TYPES: dict[str, np.dtype] = {
    "ptr": np.dtype(np.uint64), "u32": np.dtype(np.uint32), "i32": np.dtype(np.int32), "u64": np.dtype(np.uint64),
    "i64": np.dtype(np.int64), "f32": np.dtype(np.float32), "f64": np.dtype(np.float64)}


def is_arg_type(kind: Any) -> bool:
    """Whether `kind` names a kernel argument's type (a key of ARG_TYPES): a str first, so a list
    or a dict is answered False rather than meeting the `in`'s bare "unhashable type" (a Param's
    type, a launch's declared types: KernelArgs)."""
    return isinstance(kind, str) and kind in ARG_TYPES


@dataclass(frozen=True)
class Param:
    """One parameter: its name in the kernel's source and its type (a key of ARG_TYPES)."""

    name: str
    type: ArgType

    def __post_init__(self) -> None:
        if not (isinstance(self.name, str) and self.name.isidentifier()):
            raise ValueError(f"a parameter's name is an identifier, not {self.name!r}")
        if not is_arg_type(self.type):
            raise ValueError(f"parameter {self.name!r}: unknown type {self.type!r}; use one of {sorted(ARG_TYPES)}")


@dataclass(frozen=True)
class Signature:
    """A kernel's parameters, in order."""

    params: tuple[Param, ...]

    @classmethod
    def of(cls, **params: ArgType) -> Signature:
        """The signature whose parameters are the keywords, in order: Signature.of(x="ptr", n="u32")
        for `kernel(unsigned* x, unsigned n)`."""
        return cls(tuple(Param(name, kind) for name, kind in params.items()))

    @property
    def types(self) -> tuple[ArgType, ...]:
        return tuple(param.type for param in self.params)

    def check(self, kernel: str, types: Sequence[str]) -> None:
        """TypeError unless `types` are this signature's, naming `kernel` and the first parameter
        that differs."""
        if len(types) != len(self.params):
            raise TypeError(f"{kernel} takes {len(self.params)} parameter(s) {self}, not {len(types)}: {list(types)}")
        for param, kind in zip(self.params, types):
            if kind != param.type:
                raise TypeError(f"{kernel}: parameter '{param.name}' is {param.type}, not {kind}")

    def bind(self, kernel: str, values: Mapping[str, Any]) -> tuple[Any, ...]:
        """`values` in this signature's order, taken by their parameters' names; TypeError naming
        `kernel`, the parameters not given and the names it has no parameter of (a misspelt name
        is refused, not dropped)."""
        names = [param.name for param in self.params]
        missing = [name for name in names if name not in values]
        unknown = [name for name in values if name not in names]
        if missing or unknown:
            wrong = [f"{what} {', '.join(which)}" for what, which in (("missing", missing), ("no parameter", unknown))
                     if which]
            raise TypeError(f"{kernel}{self}: {'; '.join(wrong)}")
        return tuple(values[name] for name in names)

    def __str__(self) -> str:
        return f"({', '.join(f'{param.type} {param.name}' for param in self.params)})"


def arguments(kernel: str, signature: Signature | None, values: Sequence[Any],
              named: Mapping[str, Any]) -> tuple[Any, ...]:
    """A launch's arguments in the kernel's order (what Launch.set stores): by name through
    `signature` where the kernel has one, positionally where it has none (a user's PTX loaded
    without a table). Values in order are refused for a kernel with a signature: two u32s
    swapped pass every type check, so an order nothing can check is not taken. TypeError naming
    the kernel for that, for names given to a kernel without a signature, and for mixing both."""
    if signature is None:
        if named:
            raise TypeError(f"{kernel} has no signature in its module's table, so no parameter names: give its "
                            f"arguments in order, not by name ({', '.join(f'{name}=' for name in named)})")
        return tuple(values)
    if values:
        raise TypeError(f"{kernel} takes its arguments by name: {signature}")
    return signature.bind(kernel, named)
