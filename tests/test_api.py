"""The public surface that needs no GPU: modes as an enum that takes the strings, what a Round
checks before any device work."""
from __future__ import annotations

import numpy as np
import pytest

import memra_cuda
from memra_cuda import Mode, Stages
from memra_cuda.rounds import MODES
from memra_cuda.rounds.stream import as_mode


def test_modes_are_an_enum_that_takes_the_strings():
    assert MODES == ("readback", "eager", "graph", "overlap", "device")
    for name in MODES:
        assert as_mode(name) is Mode(name) and as_mode(Mode(name)) is Mode(name)
        assert Mode(name) == name  # a Mode is the string it names
    for bad in ("Graph", "", None, 3):
        with pytest.raises(ValueError, match="mode must be one of"):
            as_mode(bad)


def test_the_constructor_shows_acceptance_required_and_hides_nothing_in_kwargs():
    """help(RoundStream): what a user chooses, `acceptance` among the required keywords,
    nothing hidden in **kwargs or taken by position but the buffers."""
    import inspect

    params = inspect.signature(memra_cuda.RoundStream).parameters
    assert params["acceptance"].default is inspect.Parameter.empty
    assert params["acceptance"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "kernels" in params and not {"round_tail", "capacity"} & set(params)
    assert not any(p.kind in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL) for p in params.values())
    assert [name for name, p in params.items() if p.kind is not inspect.Parameter.KEYWORD_ONLY] == ["bufs"]


def test_pipeline_stages_name_the_capacity_of_their_caches():
    """The other stages roll back in round_tail, out of the capacity check's sight: their
    capacity is given, or UNCHECKED by name, never left out. An Engine is checked by its type: one
    made without its device (__new__) stands for a stage."""
    from memra_cuda.driver.engine import Engine
    stage = [object.__new__(Engine)]
    with pytest.raises(ValueError, match="capacity"):
        Stages(stage)
    with pytest.raises(ValueError, match="capacity"):
        Stages((), round_tail=lambda: None)
    assert Stages(stage, capacity=memra_cuda.UNCHECKED).capacity is memra_cuda.UNCHECKED
    assert type(Stages(stage, capacity=np.int64(64)).capacity) is int
    for bad in (0, -5):  # the rule of a table's capacity: a burst could never be checked against these
        with pytest.raises(ValueError, match="capacity must be None, UNCHECKED or an int of at least 1"):
            Stages(stage, capacity=bad)
    assert Stages(()).capacity is None
    # a tail that is no callable was taken, and raised at every round, after its commit and rollback
    with pytest.raises(TypeError, match="round_tail must be a callable that queues the other stages' work"):
        Stages(stage, round_tail=[lambda: None], capacity=64)


def test_a_round_refuses_kernels_of_another_engine_and_a_lone_table_before_any_device_work():
    """Round's first checks need no device: kernels must be the buffers' engine's, and
    rollback_tables is a list of tables, not one (an AddressTable of no device memory)."""
    from types import SimpleNamespace

    from memra_cuda.rounds.round import Round, _kv_tables
    from memra_cuda.buffers.tables import AddressTable

    bufs = SimpleNamespace(engine=object())
    with pytest.raises(ValueError, match="kernels belong to"):
        Round(bufs, SimpleNamespace(engine=object()), lambda: (), rollback_tables=[],
              state_tables=(), capture=None, stages=None)
    class Lone(AddressTable):
        def __init__(self) -> None:  # names no memory: nothing to allocate
            pass

        def __repr__(self) -> str:
            return "Lone()"

    with pytest.raises(TypeError, match=r"list of tables, not one table: \[Lone\(\)\]"):
        _kv_tables(bufs, Lone())


def test_the_engine_carries_its_frameworks_policy_and_the_core_asks_nothing_else():
    """Issue 39, item 5: the capture and scope of a round come from its engine's Framework (an
    engine from memra_cuda.torch.engine() carries torch's), never from sniffing the objects it
    is handed; the core's source names no foreign module."""
    import inspect

    import memra_cuda.rounds.round as round_module
    from memra_cuda.driver.framework import DRIVER, Framework

    source = inspect.getsource(round_module)
    assert "__module__" not in source and "torch" not in source.replace("memra_cuda.torch.engine()", "")
    with pytest.raises(TypeError, match="framework must be a Framework"):
        memra_cuda.Engine(0, framework="torch")  # refused before the driver is asked
    assert DRIVER == Framework() and DRIVER.capture is None and DRIVER.loop_capture is None


def test_the_face_is_what_a_user_needs_each_name_documented_and_no_builtin_shadowed():
    """Issue 39, item 3: at most 30 names, each with a docstring of its own (a constant's is its
    class's), none a builtin's (`from memra_cuda import *` must not replace compile, say)."""
    import builtins

    names = memra_cuda.__all__
    assert len(names) <= 30 and len(set(names)) == len(names), names
    assert not [name for name in names if hasattr(builtins, name)]
    undocumented = [name for name in names if not (getattr(memra_cuda, name).__doc__ or "").strip()]
    assert not undocumented, undocumented


@pytest.mark.parametrize("package", ["memra_cuda", "memra_cuda.torch"])
def test_what_an_exported_class_offers_is_documented(package):
    """help() on a class of the face shows a line for each public method and property: those of
    memra_cuda's own classes had none for DeviceBuffer.ptr, nbytes and owns_memory, Stream.closed,
    the trees' nodes and depth, FlipState's methods and others. Inherited ones count (CopyState's
    store is LiveState's)."""
    import importlib
    import inspect

    if package == "memra_cuda.torch":
        pytest.importorskip("torch", reason="needs PyTorch (pip install '.[torch]' in the checkout)")
    module = importlib.import_module(package)
    bare = []
    for name in module.__all__:
        cls = getattr(module, name)
        if not inspect.isclass(cls):
            continue
        for attr in dir(cls):
            owner = next((k for k in cls.__mro__ if attr in vars(k)), None)
            if attr.startswith("_") or owner is None or not owner.__module__.startswith("memra_cuda"):
                continue
            found = inspect.getattr_static(cls, attr)
            if isinstance(found, property):
                doc = next((p.__doc__ for k in cls.__mro__ if isinstance(p := vars(k).get(attr), property)
                            and p.__doc__), None)
            elif isinstance(found, (staticmethod, classmethod)) or inspect.isfunction(found):
                doc = inspect.getdoc(getattr(cls, attr))
            else:
                continue
            if not (doc or "").strip():
                bare.append(f"{name}.{attr}")
    assert not bare, f"undocumented: {bare}"


def test_no_deprecation_layer_is_left():
    """Issue 39, item 2: 0.3.0 dropped every alias, moved-name hook, legacy parameter and
    deprecated method (CHANGELOG.md has the migration table); none may creep back."""
    import ast
    from pathlib import Path

    found = []
    for path in sorted(Path(memra_cuda.__file__).parent.rglob("*.py")):
        source = path.read_text("utf-8")
        tree = ast.parse(source)
        if "DeprecationWarning" in source or "deprecated" in source.lower():
            found.append(f"{path.name}: mentions a deprecation")
        for node in tree.body:  # a module-level __getattr__ finds names a module no longer has
            if isinstance(node, (ast.FunctionDef, ast.Assign)) and "__getattr__" in ast.unparse(node).split("(")[0]:
                found.append(f"{path.name}: a module __getattr__")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(getattr(f, "name", "") == "__getattr__" for f in node.body):
                found.append(f"{path.name}: {node.name}.__getattr__ (aliases hide typos from static tools)")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = [a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)]
                if node.args.vararg and node.args.vararg.arg == "legacy" or any("legacy" in p for p in params):
                    found.append(f"{path.name}: {node.name} takes a legacy parameter")
    assert not found, found
