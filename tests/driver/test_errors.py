"""One base for every error of memra_cuda's own: each class memra_cuda.errors lists is a
MemraError, and every exception class the package defines, in any module, is listed there (so
`from memra_cuda.errors import ...` reaches each, and `except MemraError` catches each)."""
from __future__ import annotations

import ast
import builtins
import importlib
import inspect
from pathlib import Path

import pytest

import memra_cuda
from memra_cuda import errors
from memra_cuda.errors import MemraError

PACKAGE = Path(memra_cuda.__file__).resolve().parent
OPTIONAL = {"torch", "transformers", "tokenizers", "safetensors", "matplotlib", "triton"}  # extras the core never needs


def modules() -> tuple[list[object], list[Path]]:
    """Every module of the package, imported; and the files of those that need an optional
    dependency this machine lacks (CI has neither torch nor transformers)."""
    imported, unimported = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(("memra_cuda", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
        try:
            imported.append(importlib.import_module(name))
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] not in OPTIONAL:
                raise
            unimported.append(path)
    return imported, unimported


def defined_exceptions() -> dict[str, type]:
    imported, _ = modules()
    return {cls.__name__: cls for module in imported for _, cls in inspect.getmembers(module, inspect.isclass)
            if issubclass(cls, BaseException) and cls.__module__ == module.__name__}


def test_every_listed_error_is_a_memra_error():
    assert errors.__all__, "memra_cuda.errors lists the errors"
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert inspect.isclass(cls) and issubclass(cls, MemraError), f"{name} is not a MemraError"


def test_every_exception_class_of_the_package_is_listed():
    defined = defined_exceptions()
    assert {"MemraError", "CudaError", "RankRefused", "NvrtcUnavailable"} <= defined.keys()
    assert sorted(defined.keys() - set(errors.__all__)) == [], "define them under MemraError and list them"
    assert all(getattr(errors, name) is cls for name, cls in defined.items()), "one class a name"


def test_no_module_skipped_for_an_optional_dependency_defines_an_exception():
    """Where torch is missing its modules cannot be imported: read them instead, so a class
    deriving from an exception there is not missed."""
    _, unimported = modules()
    exception_names = {name for name, value in vars(builtins).items()
                       if isinstance(value, type) and issubclass(value, BaseException)} | set(errors.__all__)
    found = [f"{path.name}: {node.name}" for path in unimported
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(node, ast.ClassDef)
             and any(isinstance(base, (ast.Name, ast.Attribute)) and ast.unparse(base).split(".")[-1]
                     in exception_names for base in node.bases)
             and node.name not in errors.__all__]
    assert not found, found


def test_rank_refused_is_a_memra_error_and_a_permission_error():
    from memra_cuda.comm import RankRefused
    assert RankRefused is errors.RankRefused and issubclass(RankRefused, MemraError)
    with pytest.raises(PermissionError):
        raise RankRefused("rank 0 refused rank 1")
