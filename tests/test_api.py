"""The public surface that needs no GPU: modes as an enum that still takes the strings, and the
deprecation path of the keywords and typed copies of the first releases."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import memra_cuda
from memra_cuda import MODES, Mode, Sampling, Stages
from memra_cuda.stream import _legacy_budget, _stages, as_mode


def test_modes_are_an_enum_that_takes_the_strings():
    assert MODES == ("readback", "eager", "graph", "overlap", "device")
    for name in MODES:
        assert as_mode(name) is Mode(name) and as_mode(Mode(name)) is Mode(name)
        assert Mode(name) == name  # a Mode is the string it names
    for bad in ("Graph", "", None, 3):
        with pytest.raises(ValueError, match="mode must be one of"):
            as_mode(bad)


def test_the_first_releases_name_of_eager_mode_still_works_with_a_warning():
    with pytest.warns(DeprecationWarning, match='"eager"'):
        assert as_mode("stream") is Mode.EAGER
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert as_mode("eager") is Mode.EAGER


def test_the_first_releases_stage_keywords_map_to_stages_with_a_warning():
    tail = lambda: None  # noqa: E731
    with pytest.warns(DeprecationWarning, match="Stages"):
        assert _stages(["stage"], tail, 9) == Stages(("stage",), tail, 9)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="not both"):
        _stages(Stages(()), tail, 9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _stages(Stages(()), None, None) == Stages(())
        assert _stages(None, None, None) is None


def test_the_constructor_shows_acceptance_required_and_the_old_keywords_by_name():
    """help(RoundStream): what a user chooses, `acceptance` among the required keywords; the
    deprecated keywords named, nothing hidden in **kwargs."""
    import inspect

    params = inspect.signature(memra_cuda.RoundStream).parameters
    assert params["acceptance"].default is inspect.Parameter.empty
    assert params["acceptance"].kind is inspect.Parameter.KEYWORD_ONLY
    assert {"round_tail", "capacity", "kernels"} <= set(params)
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def test_pipeline_stages_name_the_capacity_of_their_caches():
    """The other stages roll back in round_tail, out of the capacity check's sight: their
    capacity is given, or UNCHECKED by name, never left out."""
    with pytest.raises(ValueError, match="capacity"):
        Stages(["stage"])
    with pytest.raises(ValueError, match="capacity"):
        Stages((), round_tail=lambda: None)
    assert Stages(["stage"], capacity=memra_cuda.UNCHECKED).capacity is memra_cuda.UNCHECKED
    assert type(Stages(["stage"], capacity=np.int64(64)).capacity) is int
    for bad in (0, -5):  # the rule of a table's capacity: a burst could never be checked against these
        with pytest.raises(ValueError, match="positive number of KV entries"):
            Stages(["stage"], capacity=bad)
    assert Stages(()).capacity is None


def test_public_names_are_exported():
    for name in ("Engine", "Stream", "DeviceBuffer", "Graph", "Cache", "KVLayer", "StreamBufs", "drain_ring",
                 "kv_len_ptr_table", "kv_len_ptr_table_range", "SpecKernels", "RoundStream", "kv_capacity",
                 "MODES", "Mode", "Greedy", "Sampling", "Stages", "UNCHECKED", "CudaError", "CudaUnavailable",
                 "StateLayer", "StateTable", "state_copy_table", "state_copy_table_range", "state_flip_table"):
        assert name in memra_cuda.__all__ and hasattr(memra_cuda, name), name
    assert np.dtype(np.uint32)  # numpy is the only other runtime dependency


def test_the_first_releases_home_of_sampling_still_finds_it_with_a_warning():
    from memra_cuda import sampling

    with pytest.warns(DeprecationWarning, match="moved"):
        assert sampling.Sampling is Sampling
    with pytest.raises(AttributeError, match="Greedy"):
        sampling.Greedy


@pytest.mark.parametrize("module,old,new", [
    ("stream", "kv_capacity", "capacity.kv_capacity"), ("stream", "CapacityError", "capacity.CapacityError"),
    ("stream", "chain", "round.chain"), ("tables", "UNCHECKED", "capacity.UNCHECKED"),
    ("device_loop", "TokenStream", "device_loop.TokenFeed"), ("sampling", "Sampling", "acceptance.Sampling")])
def test_the_first_releases_names_are_found_where_they_were_with_a_warning(module, old, new):
    import importlib

    home, _, name = new.rpartition(".")
    with pytest.warns(DeprecationWarning, match=old):
        found = getattr(importlib.import_module(f"memra_cuda.{module}"), old)
    assert found is getattr(importlib.import_module(f"memra_cuda.{home}"), name)
    with pytest.raises(AttributeError, match="no_such_name"):
        getattr(importlib.import_module(f"memra_cuda.{module}"), "no_such_name")


def test_a_round_refuses_kernels_of_another_engine_and_a_lone_table_before_any_device_work():
    """Round's first checks need no device: kernels must be the buffers' engine's, and
    rollback_tables is a list of tables, not one (an AddressTable of no device memory)."""
    from types import SimpleNamespace

    from memra_cuda.round import Round, _kv_tables
    from memra_cuda.tables import AddressTable

    bufs = SimpleNamespace(engine=object())
    with pytest.raises(ValueError, match="kernels belong to"):
        Round(bufs, SimpleNamespace(engine=object()), lambda: (), model_buffers=(), rollback_tables=[],
              state_tables=(), capture=None, stages=None)
    class Lone(AddressTable):
        def __init__(self) -> None:  # names no memory: nothing to allocate
            pass

        def __repr__(self) -> str:
            return "Lone()"

    with pytest.raises(TypeError, match=r"list of tables, not one table: \[Lone\(\)\]"):
        _kv_tables(bufs, Lone())


def test_rounds_are_torch_backed_whatever_form_the_tensors_take():
    """Issue 18, cases 1 and 2: a stream is made safe when torch is in play, also where the model's
    buffers reach it as DeviceBuffers adopted from tensors (memra_torch.buffer), not only as
    tensors. (A stand-in class from a module named torch: no torch needed here.)"""
    from types import SimpleNamespace

    from memra_cuda import DeviceBuffer
    from memra_cuda.round import _torch_in_play

    Tensor = type("Tensor", (), {"__module__": "torch"})
    engine = SimpleNamespace(stream_owner=None)
    adopted = DeviceBuffer.wrap(0x10000, np.uint32, 8, keepalive=Tensor())
    plain = DeviceBuffer.wrap(0x10000, np.uint32, 8)
    assert _torch_in_play(engine, Tensor())
    assert _torch_in_play(engine, plain, adopted)
    assert _torch_in_play(engine, plain, adopted.view(2, 4))
    assert not _torch_in_play(engine, plain)
    assert _torch_in_play(SimpleNamespace(stream_owner=Tensor()), plain)


@pytest.mark.parametrize("name, now", [("generate", "generate"), ("generate_batch", "generate_batch"),
                                       ("stream", "follow")])
def test_the_first_releases_start_pos_warns_and_must_be_where_the_rows_are(name, now):
    """generate/generate_batch(start_pos, max_new_tokens) and stream(start_pos, ...) no longer set
    the host's positions (the device's pos_ctr_d would not follow): they warn, name the new form,
    and refuse a start_pos other than where the last reset left the rows, before anything runs."""
    from types import SimpleNamespace
    bufs = SimpleNamespace(batch=2, positions=np.array([5, 9]))
    with pytest.warns(DeprecationWarning, match=rf"{now}\(max_new_tokens\) starts where"):
        assert _legacy_budget(bufs, name, [5, 9], (32,)) == 32
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=r"start_pos \[5, 8\] is not where"):
        _legacy_budget(bufs, name, [5, 8], (32,))
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="takes max_new_tokens"):
        _legacy_budget(bufs, name, [5, 9], (32, 1))
