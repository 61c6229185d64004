"""memra_cuda.chain, a round's draft chain or verify trunk made of launches: what it is given is
checked when it is made (no driver needed), its launches issued in order; a pipeline's Stages,
checked as they are made; and RoundStream.step's refusal of the modes that generate, which needs
no driver either."""
from __future__ import annotations

import re

import pytest

from memra_cuda import chain


def test_a_chain_issues_its_launches_in_order():
    issued: list[int] = []
    step = chain([lambda: issued.append(0), lambda: issued.append(1)])
    step()
    step()
    assert issued == [0, 1, 0, 1]


@pytest.mark.parametrize(("given", "message"), [
    (print, "chain takes a list of launches .callables., not <built-in function print>: chain\\(\\[launch\\]\\)"),
    (5, "chain takes a list of launches"),
    ("ab", "chain takes a list of launches"),
    ([print, 5], "chain's launch 1 is not callable: 5"),
    ({print, repr}, "chain takes a list of launches"),  # issued in its hashes' order, the launches' addresses
    (frozenset({print}), "chain takes a list of launches"),
    ({print: "first"}, "chain takes a list of launches"),
    ({print: 0}.keys(), "chain takes a list of launches"),
])
def test_a_chain_of_what_is_no_list_of_launches_is_refused_when_it_is_made(given, message):
    """chain(fn), one callable where a list is asked, met "'function' object is not iterable";
    a launch that is no callable raised only when the round first issued it."""
    with pytest.raises(TypeError, match=message):
        chain(given)


@pytest.mark.parametrize(("engines", "message"), [
    ("abc", "^Stages' engines must be a list, a tuple or a 1-D array of Engines, not 'abc'$"),
    (7, "^Stages' engines must be a list, a tuple or a 1-D array of Engines, not 7$"),
    ({None}, "^Stages' engines must be a list, a tuple or a 1-D array of Engines, not "),
    ([None], "^Stages' engine 0 must be an Engine, not None$"),
    (("stage 0", "stage 1"), "^Stages' engine 0 must be an Engine, not 'stage 0'$"),
])
def test_a_pipelines_stages_are_engines_checked_when_they_are_made(engines, message):
    """Stages("abc", capacity=5) was taken as three engines, one a character, and Stages(7, ...)
    too, which failed only in the Round, at tuple(7)."""
    from memra_cuda import Stages
    with pytest.raises(TypeError, match=message):
        Stages(engines, capacity=5)


def test_a_pipelines_stages_keep_their_engines_as_a_tuple():
    """A list of engines was kept as given: the frozen Stages was unhashable, and the caller's
    list, changed later, changed the stages. No device is needed: an Engine is checked by type."""
    from memra_cuda import Stages
    from memra_cuda.driver.engine import Engine
    engines = [object.__new__(Engine), object.__new__(Engine)]
    stages = Stages(engines, capacity=5)
    engines.append(object.__new__(Engine))
    assert type(stages.engines) is tuple and len(stages.engines) == 2 and stages.engines[0] is engines[0]
    assert hash(stages) == hash(Stages(tuple(engines[:2]), capacity=5))
    assert Stages((), round_tail=lambda: None, capacity=5).engines == ()


class Untouched:
    """Buffers or kernels a round must not ask anything of before it has checked its steps."""

    def __getattr__(self, name):
        raise AssertionError(f"the round asked for .{name} before it checked its steps")


def launch():
    """A launch, as chain() takes them."""


@pytest.mark.parametrize(("steps", "message"), [
    (dict(draft_chain=[launch, launch]), "draft_chain must be a callable that queues the model's work .chain"),
    (dict(verify_trunk=None), "verify_trunk must be a callable"),
    (dict(narrower={1: launch}), "narrower.1. must be a pair .draft_chain, verify_trunk. of width 1"),
    (dict(narrower={1: (launch, [launch])}), "narrower.1.'s verify_trunk must be a callable"),
    (dict(narrower=[(launch, launch)]), "narrower maps widths below k"),
    (dict(seed_gather=[launch]), "seed_gather must be a callable"),  # issued after the chooser's launch, else
])
def test_a_chain_rounds_steps_that_are_no_callables_are_refused_before_anything_else(steps, message):
    """A list of launches given as the draft chain (chain() of them was meant) was taken, and
    raised only when the round first issued it: after the length chooser's and the seed gather's
    launches were queued (the chooser moving each row's statistics on by a round that never ran),
    or inside a graph's capture. The round's steps are checked first now, as TreeRound's are,
    before anything is asked of the buffers or the kernels."""
    from memra_cuda import ChainRound, Greedy
    given = {**dict(draft_chain=launch, verify_trunk=launch, draft_d=None, acceptance=Greedy(None),
                    rollback_tables=[]), **steps}
    with pytest.raises(TypeError, match=message):
        ChainRound(Untouched(), Untouched(), **given)


@pytest.mark.parametrize(("mode", "message"), [
    ("overlap", r'"overlap" keeps two bursts.*generate\(\) \(one row\) or generate_batch\(\), or step in "graph"'),
    ("device", r'"device" generates until.*generate_batch\(\) or follow\(\), or step in "graph"'),
])
def test_a_step_refuses_the_generating_modes_naming_the_calls_that_run_them(mode, message):
    """Refused before anything is asked of the buffers (no driver needed). The refusal named
    generate() alone, which refuses a batch: a batch's step("overlap") was sent to a call that
    refused it in turn; generate_batch() runs both modes for every row."""
    from memra_cuda import RoundStream
    stream = object.__new__(RoundStream)  # nothing built: the mode is refused first
    with pytest.raises(ValueError, match=message):
        stream.step(mode)


@pytest.mark.parametrize(("levels", "error", "message"), [
    ({launch, print, repr}, TypeError, "^draft_levels must be a list, a tuple or a 1-D array of callables, one a level "
                                       r"\(level 0 the root\), not "),
    ((step for step in [launch] * 3), TypeError, "^draft_levels must be a list, a tuple or a 1-D array of "),
    ({0: launch, 1: launch, 2: launch}, TypeError, "^draft_levels must be a list, a tuple or a 1-D array of "),
    (launch, TypeError, "^draft_levels must be a list, a tuple or a 1-D array of "),
    ([launch, launch, None], TypeError, "^draft level 2 must be a callable that queues the model's work, not None$"),
    ([launch, "level 1", launch], TypeError, "^draft level 1 must be a callable"),
    ([launch] * 2, ValueError, r"^a tree of depth 2 takes 3 draft levels \(callables, level 0 the root\), not 2$"),
])
def test_a_tree_rounds_draft_levels_are_a_list_of_callables_checked_before_anything_else(levels, error, message):
    """draft_levels went through list(): a set of the levels' steps was taken in its hashes' order
    (the steps' addresses), so the levels were issued in an order of the allocator's, silently; a
    generator was taken, a mapping's keys were, and one callable given bare met "'function'
    object is not iterable". A level that is no callable was "takes 3 draft levels ..., not 3",
    though 3 were given. Refused naming what is wrong, before the kernels are loaded."""
    from memra_cuda import Greedy, TreeRound, TreeShape
    from memra_cuda.buffers import TreeBufs
    bufs = object()
    tree = TreeBufs.__new__(TreeBufs)
    tree.bufs, tree.tree = bufs, TreeShape.chain(2)
    with pytest.raises(error, match=message):
        TreeRound(bufs, tree, Untouched(), draft_levels=levels, verify_tree=launch, acceptance=Greedy(None),
                  rollback_tables=[], compact=launch)


@pytest.mark.parametrize(("steps", "message"), [
    (dict(verify_tree=None), "verify_tree must be a callable that queues the model's work, not None"),
    (dict(verify_tree="verify"), "verify_tree must be a callable"),
    (dict(compact=[launch]), "compact must be a callable"),
])
def test_a_tree_rounds_verify_that_is_no_callable_is_refused_before_anything_else(steps, message):
    """verify_tree=None was taken (compact's None, no compaction of one's own, is a choice; a
    verify is not): every round then called None, inside a burst's capture or after the draft's
    levels were queued. Refused with the other steps, before the kernels are loaded."""
    from memra_cuda import Greedy, TreeRound, TreeShape
    from memra_cuda.buffers import TreeBufs
    bufs = object()
    tree = TreeBufs.__new__(TreeBufs)
    tree.bufs, tree.tree = bufs, TreeShape.chain(2)
    given = {**dict(draft_levels=[launch] * 3, verify_tree=launch, acceptance=Greedy(None), rollback_tables=[],
                    compact=launch), **steps}
    with pytest.raises(TypeError, match=message):
        TreeRound(bufs, tree, Untouched(), **given)


@pytest.mark.parametrize("kernels", [0, "", "kernels", object(), None])
def test_a_chain_round_takes_spec_kernels_alone_refused_before_anything_is_asked_of_them(kernels):
    """ChainRound's kernels are a SpecKernels: another object met an AttributeError at its first
    launcher ('int' object has no attribute 'prepare_assemble_verify'), naming nothing. Refused
    naming them, once the steps are checked, before the buffers are asked anything."""
    from memra_cuda import ChainRound, Greedy
    with pytest.raises(TypeError, match=rf"^ChainRound's kernels must be a SpecKernels \(SpecKernels\(engine\)\), "
                                        rf"not {re.escape(repr(kernels))}$"):
        ChainRound(Untouched(), kernels, draft_chain=launch, verify_trunk=launch, draft_d=None,
                   acceptance=Greedy(None), rollback_tables=[])


@pytest.mark.parametrize("kernels", [0, "", False, "kernels", object()])
def test_a_tree_round_takes_spec_kernels_or_none_refusing_the_rest(kernels):
    """TreeRound's kernels were `kernels or SpecKernels(engine)`: a falsy value (0, "") was
    replaced by the default, silently, and another met an AttributeError at its first launcher.
    Refused naming them, before the default's module or the tree kernels are loaded."""
    from memra_cuda import Greedy, TreeRound, TreeShape
    from memra_cuda.buffers import Candidates, TreeBufs
    bufs = object()  # its engine is never asked for: the default is not built
    tree = TreeBufs.__new__(TreeBufs)
    tree.bufs, tree.tree = bufs, TreeShape.chain(2)
    with pytest.raises(TypeError, match=r"^TreeRound's kernels must be a SpecKernels \(SpecKernels\(engine\)\), or "
                                        rf"None to build them, not {re.escape(repr(kernels))}$"):
        TreeRound(bufs, tree, kernels, draft_levels=[launch] * 3, verify_tree=launch, acceptance=Greedy(None),
                  candidates=Candidates(None, None), rollback_tables=[], compact=launch)


@pytest.mark.parametrize("kernels", [0, "", [], "kernels", object()])
def test_a_round_stream_takes_spec_kernels_or_none_refusing_the_rest(kernels):
    """RoundStream's kernels were `kernels or SpecKernels(bufs.engine)`: a falsy value was
    replaced by the default, silently, and another met an AttributeError in the round's first
    launcher. Refused naming them, before the default is built (its module loaded)."""
    from memra_cuda import Greedy, RoundStream
    from memra_cuda.buffers import StreamBufs
    with pytest.raises(TypeError, match=r"^RoundStream's kernels must be a SpecKernels \(SpecKernels\(engine\)\), or "
                                        rf"None to build them, not {re.escape(repr(kernels))}$"):
        RoundStream(object.__new__(StreamBufs), draft_chain=launch, verify_trunk=launch, draft_d=None,
                    acceptance=Greedy(None), rollback_tables=[], kernels=kernels)


def test_none_builds_the_default_kernels_of_the_buffers_engine(monkeypatch):
    """None (and None alone) is the default: the SpecKernels of the buffers' engine."""
    from memra_cuda.kernels import spec
    from memra_cuda.rounds.round import as_kernels
    monkeypatch.setattr(spec, "load", lambda engine, name: name)  # no driver: the module is its name
    bufs = type("Bufs", (), {"engine": "engine"})()
    built = as_kernels(None, "RoundStream", bufs)
    assert isinstance(built, spec.SpecKernels) and built.engine == "engine" and built.module == "spec_stream"
    assert as_kernels(built, "ChainRound") is built
    with pytest.raises(TypeError, match="^ChainRound's kernels must be a SpecKernels .SpecKernels.engine.., not None$"):
        as_kernels(None, "ChainRound")
