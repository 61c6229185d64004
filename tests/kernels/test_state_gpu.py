"""Recurrent state rollback (kernels 8 and 9, ptx/spec_stream.cu) on the GPU, against
memra_cuda.testing.reference, with the harness of test_kernels_gpu.py: per case every buffer is written
at random, the kernel launched, and every buffer read back and compared word for word with the
reference run on host copies.

Every live state, slot array and index sits in an arena of its own between guard words, and
the arenas are compared whole, so a write past a buffer (or into a layer's slots, or into a
null entry's index) shows up as a difference. Keeps run through every value 0..k+1 on every row,
then at random with values past k+1 and garbage; rows of keep 0 are done rows, as acceptance
leaves them. Tables mix layers of several widths (1, and widths that are no multiple of the
block), null entries and 4-byte types other than u32. Targeted tests cover grids that must
stride, hand-worked values between sentinels, and what the tables and launchers refuse.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import Cache, Greedy, RoundStream, StateLayer, StreamBufs, kv_len_ptr_table, state_copy_table
from memra_cuda.buffers import StateIndexTable, StateTable, state_copy_table_range, state_flip_table
from memra_cuda.kernels import SpecKernels
from memra_cuda.testing import reference as ref
from memra_cuda.testing.reference import DONE, KEEP
from test_kernels_gpu import BATCHES, LARGE_CASES, PAST_ONE_GRID, SENTINEL, Rig, cases, pick
from test_state import ctl_rows

pytestmark = pytest.mark.gpu

KS = (0, 1, 4)
CONFIGS = [(k, batch) for k in KS for batch in BATCHES]
GUARD = 2  # words before and after every live state, slot array and index window
# One table's layers: None has no state; 33 is past a warp, 300 past the 256-thread block (two
# blocks a row), neither a multiple of the block.
WIDTHS = (1, None, 33, 300, None, 7)
INDEX_ENTRIES = (True, False, True, True)  # a flip table's entries; False: null
TYPES = (np.uint32, np.float32, np.int32)  # any 4-byte words: the arenas are compared as u32


@pytest.fixture(scope="module")
def spec(engine):
    return SpecKernels(engine)


def set_keeps(rng: np.random.Generator, case: int, k: int, ctl: np.ndarray, batch: int) -> None:
    """Row b's keep: in even cases (b + case / 2) % (k + 2), so every keep 0..k+1 meets every row;
    in odd ones at random, past k + 1 and garbage among them. A row of keep 0 is done."""
    rows = ctl.reshape(batch, -1)
    for b in range(batch):
        keep = (b + case // 2) % (k + 2) if case % 2 == 0 else pick(
            rng, [0, 1, k, k + 1, k + 2, int(rng.integers(0, k + 2)), 2**31 - 1, -1, -2**31])
        rows[b, KEEP] = keep
        if keep == 0:
            rows[b, DONE] = 1


def ctl_of(keeps: Sequence[int]) -> np.ndarray:
    """ctl_d rows of these keeps, a row of keep 0 done."""
    return ctl_rows(*keeps, done=tuple(b for b, keep in enumerate(keeps) if keep == 0))


# -- 8. state_copy -----------------------------------------------------------------------------

def spans(batch: int, k: int, width: int) -> tuple[slice, slice]:
    """Where a layer's live state and slots sit in its arena: [guard, live, guard, slots, guard]."""
    live = slice(GUARD, GUARD + batch * width)
    return live, slice(live.stop + GUARD, live.stop + GUARD + batch * (k + 1) * width)


def check_state_copy(engine, spec, k: int, batch: int, widths: Sequence[int | None],
                     runs: Iterable[tuple[np.random.Generator, str]]) -> None:
    """state_copy over one table of `widths` (None: a layer without state) against the reference."""
    arenas = {f"layer{i}": engine.zeros(np.uint32, 3 * GUARD + batch * (k + 2) * w)
              for i, w in enumerate(widths) if w is not None}
    rig = Rig(engine, k, batch=batch, **arenas)
    layers = []
    for i, w in enumerate(widths):
        if w is None:
            layers.append(None)
            continue
        live, slots = spans(batch, k, w)
        arena, dtype = rig.device[f"layer{i}"], TYPES[i % len(TYPES)]
        layers.append(StateLayer(arena.view(live.start, live.stop - live.start, dtype),
                                 arena.view(slots.start, slots.stop - slots.start, dtype), w, k))
    launch = spec.prepare_state_copy(rig.bufs, state_copy_table(engine, layers))

    def reference(s):
        table = [None if w is None else (*(s[f"layer{i}"][span] for span in spans(batch, k, w)), w)
                 for i, w in enumerate(widths)]
        ref.spec_state_copy(table, k, s["ctl_d"], batch)

    for case, (rng, where) in enumerate(runs):
        state = rig.random_state(rng)
        set_keeps(rng, case, k, state["ctl_d"], batch)
        rig.check(launch, state, reference, where)


@pytest.mark.parametrize("k,batch", CONFIGS)
def test_state_copy_matches_reference(engine, spec, k, batch):
    check_state_copy(engine, spec, k, batch, WIDTHS, cases("state_copy", (k, batch), len(CONFIGS)))


def test_state_copy_spreads_a_wide_row_over_blocks_that_stride(engine, spec):
    """One row of more words than the 1024 blocks of 256 threads the launcher makes cover."""
    check_state_copy(engine, spec, 1, 1, (PAST_ONE_GRID,),
                     islice(cases("state_copy", (1, 1, PAST_ONE_GRID), 1), LARGE_CASES))


def test_state_copy_serves_more_layer_rows_than_blocks(engine, spec):
    """34 layers of 32 rows: 1088 (layer, row) pairs for at most 1024 blocks, which stride on."""
    check_state_copy(engine, spec, 4, 32, (1,) * 33 + (None,),
                     islice(cases("state_copy", (4, 32, 34), 1), LARGE_CASES))


@pytest.mark.parametrize("row_words", (1, 5, 300))
def test_state_copy_writes_the_kept_slot_between_sentinels(engine, spec, row_words):
    """Slot words name their place ((b + 1) << 24 | (i + 1) << 16 | word), live states start as
    the sentinel, and so do the guards: afterwards row b holds slot keep - 1 (keep clamped to
    k + 1; keep 0 and the done row: the sentinel still), and every other word is unchanged."""
    k, batch = 2, 4
    keeps = [1, 0, 3, 2**31 - 1]
    bufs = StreamBufs(engine, Geometry(k, 1, batch))
    b, i, w = np.meshgrid(np.arange(batch), np.arange(k + 1), np.arange(row_words), indexing="ij")
    slots = ((b + 1) << 24 | (i + 1) << 16 | w).astype(np.uint32).reshape(-1)
    live, slot_span = spans(batch, k, row_words)
    words = np.full(slot_span.stop + GUARD, SENTINEL, np.uint32)
    words[slot_span] = slots
    arena = engine.htod(words, np.uint32)
    layer = StateLayer(arena.view(live.start, batch * row_words), arena.view(slot_span.start, slots.size), row_words, k)
    engine.copy_htod(bufs.ctl_d, ctl_of(keeps))
    spec.state_copy(bufs, state_copy_table(engine, [None, layer]))
    want = words.copy()
    for row, keep in enumerate(keeps):
        if keep:
            src = (row * (k + 1) + min(keep, k + 1) - 1) * row_words
            want[live.start + row * row_words:live.start + (row + 1) * row_words] = slots[src:src + row_words]
    got = engine.dtoh(arena)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"row_words={row_words} keeps={keeps}: words {bad[:8].tolist()} are "
                           f"{got[bad[:8]].tolist()}, expected {want[bad[:8]].tolist()}")


# -- 9. state_flip -----------------------------------------------------------------------------

def window(entry: int, batch: int) -> slice:
    """Where index entry j sits in the indices arena: guards between every two."""
    start = GUARD + entry * (batch + GUARD)
    return slice(start, start + batch)


def check_state_flip(engine, spec, k: int, batch: int, entries: Sequence[bool],
                     runs: Iterable[tuple[np.random.Generator, str]]) -> None:
    """state_flip over a table of `entries` (False: null) against the reference; every index in
    either bank, at its edges, or garbage."""
    rig = Rig(engine, k, batch=batch, indices=engine.zeros(np.uint32, GUARD + len(entries) * (batch + GUARD)))
    arena = rig.device["indices"]
    table = state_flip_table(engine, [arena.view(window(j, batch).start, batch) if live else None
                                      for j, live in enumerate(entries)])
    launch = spec.prepare_state_flip(rig.bufs, table)

    def reference(s):
        ref.spec_state_flip([s["indices"][window(j, batch)] if live else None for j, live in enumerate(entries)],
                            k, s["ctl_d"], batch)

    for case, (rng, where) in enumerate(runs):
        state = rig.random_state(rng)
        set_keeps(rng, case, k, state["ctl_d"], batch)
        for j in range(len(entries)):
            state["indices"][window(j, batch)] = draw_indices(rng, k, batch)
        rig.check(launch, state, reference, where)


def draw_indices(rng: np.random.Generator, k: int, n: int) -> np.ndarray:
    """n slot indices: half in either bank at random, the rest at the banks' edges or garbage."""
    k1 = k + 1
    edges = np.array([0, k, k1, 2 * k1 - 1, 2 * k1, 2**31, 2**32 - 1], np.uint64)
    odd = np.where(rng.random(n) < 0.5, edges[rng.integers(0, len(edges), n)], rng.integers(0, 2**32, n, np.uint64))
    return np.where(rng.random(n) < 0.5, rng.integers(0, 2 * k1, n, np.uint64), odd).astype(np.uint32)


@pytest.mark.parametrize("k,batch", CONFIGS)
def test_state_flip_matches_reference(engine, spec, k, batch):
    check_state_flip(engine, spec, k, batch, INDEX_ENTRIES, cases("state_flip", (k, batch), len(CONFIGS)))


def test_state_flip_serves_more_index_rows_than_one_grid_has_threads(engine, spec):
    batch = 32
    entries = (True,) * (PAST_ONE_GRID // batch + 1)
    check_state_flip(engine, spec, 4, batch, entries, islice(cases("state_flip", (4, batch, len(entries)), 1),
                                                             LARGE_CASES))


def test_state_flip_by_hand_between_sentinels(engine, spec):
    """k = 2 (banks {0, 1, 2} and {3, 4, 5}), one row a keep, one index a model: every word but
    the live indices keeps the sentinel."""
    k = 2
    rows = [(0, 1, 3), (0, 3, 5), (4, 3, 2), (5, 1, 0), (3, 0, 3), (7, 2, 1), (2**32 - 1, 0, 2**32 - 1), (1, -1, 5)]
    batch = len(rows)
    bufs = StreamBufs(engine, Geometry(k, 1, batch))
    words = np.full(window(0, batch).stop + GUARD, SENTINEL, np.uint32)
    words[window(0, batch)] = [idx for idx, _, _ in rows]
    arena = engine.htod(words, np.uint32)
    engine.copy_htod(bufs.ctl_d, ctl_of([keep for _, keep, _ in rows]))
    spec.state_flip(bufs, state_flip_table(engine, [arena.view(window(0, batch).start, batch), None]))
    want = words.copy()
    want[window(0, batch)] = [new for _, _, new in rows]
    assert engine.dtoh(arena).tolist() == want.tolist()


# -- the tables, and what they and the launchers refuse ---------------------------------------

def state_layers(engine, batch: int, k: int, widths: Sequence[int | None]) -> list[StateLayer | None]:
    return [None if w is None else StateLayer(engine.zeros(np.float32, batch * w, label=f"live {i}"),
                                              engine.zeros(np.float32, batch * (k + 1) * w, label=f"slots {i}"), w, k)
            for i, w in enumerate(widths)]


def records(layers: Sequence[StateLayer | None]) -> list[int]:
    return [word for layer in layers
            for word in ((0, 0, 0) if layer is None else (layer.live_d.ptr, layer.slots_d.ptr, layer.row_words))]


def test_state_copy_tables_hold_a_record_a_layer_and_ranges_take_their_layers(engine):
    layers = state_layers(engine, 3, 2, WIDTHS)
    table = state_copy_table(engine, layers)
    assert isinstance(table, StateTable) and (table.batch, table.k) == (3, 2)
    assert engine.dtoh(table, np.uint64).tolist() == records(layers)
    assert all(table.holds(layer.live_d) and table.holds(layer.slots_d) for layer in layers if layer is not None)
    assert engine.dtoh(state_copy_table_range(engine, layers, range(1, 4)), np.uint64).tolist() == records(layers[1:4])
    assert engine.dtoh(state_copy_table_range(engine, layers, (4, 6)), np.uint64).tolist() == records(layers[4:6])
    assert state_copy_table(engine, [None]).batch is None
    for stage in (range(0, 7), (5, 7), range(-1, 2), (3, 2), range(0, 4, 2)):
        with pytest.raises(ValueError, match="layer"):
            state_copy_table_range(engine, layers, stage)


def test_state_tables_refuse_mixed_shapes_and_shared_memory(engine):
    with pytest.raises(ValueError, match="same batch B and k"):
        state_copy_table(engine, state_layers(engine, 3, 2, (4,)) + state_layers(engine, 2, 2, (4,)))
    with pytest.raises(ValueError, match="same batch B and k"):
        state_copy_table(engine, state_layers(engine, 3, 2, (4,)) + state_layers(engine, 3, 1, (4,)))
    with pytest.raises(ValueError, match="at least one entry"):
        state_copy_table(engine, [])
    arena = engine.zeros(np.uint32, 40)
    twice = StateLayer(arena.view(0, 4), arena.view(4, 12), 2, 2)
    with pytest.raises(ValueError, match="overlap"):
        state_copy_table(engine, [twice, None, twice])
    with pytest.raises(ValueError, match="overlap"):  # the live state inside its own slots
        state_copy_table(engine, [StateLayer(arena.view(8, 4), arena.view(4, 12), 2, 2)])
    idx = engine.zeros(np.uint32, 3)
    for indices in ([idx, idx], [arena.view(0, 3), arena.view(2, 3)]):
        with pytest.raises(ValueError, match="overlap"):
            state_flip_table(engine, indices)
    for indices in ([engine.zeros(np.int32, 3)], [idx, engine.zeros(np.uint32, 4)]):
        with pytest.raises(ValueError, match=r"u32\[B\]"):
            state_flip_table(engine, indices)


def test_launchers_refuse_tables_of_another_round_or_kind(engine, spec):
    """Checked once, when the launch is prepared: the batch and k of the round, and the kind of
    table (a KV length table and a state index table never stand in for each other)."""
    bufs = StreamBufs(engine, Geometry(2, 1, 3))
    copy_table = state_copy_table(engine, state_layers(engine, 3, 2, (5, None)))
    flip_table = state_flip_table(engine, [engine.zeros(np.uint32, 3)])
    lengths = kv_len_ptr_table(engine, Cache.allocate(engine, (True,), capacity=8, batch=3), bufs.pos_ctr_d)
    spec.prepare_state_copy(bufs, copy_table)
    spec.prepare_state_flip(bufs, flip_table)
    for (k, batch), named in (((2, 2), "B=2 and k=2"), ((1, 3), "B=3 and k=1"), ((3, 3), "B=3 and k=3")):
        with pytest.raises(ValueError, match=f"the round has {named}"):
            spec.prepare_state_copy(StreamBufs(engine, Geometry(k, 1, batch)), copy_table)
    with pytest.raises(ValueError, match=r"u32\[2\]"):
        spec.prepare_state_flip(StreamBufs(engine, Geometry(2, 1, 2)), flip_table)
    for table in (flip_table, lengths):
        with pytest.raises(TypeError, match="StateTable"):
            spec.prepare_state_copy(bufs, table)
    for table in (copy_table, lengths):
        with pytest.raises(TypeError, match="StateIndexTable"):
            spec.prepare_state_flip(bufs, table)
    with pytest.raises(ValueError, match="i32"):
        spec.prepare_rollback(bufs, flip_table)
    with pytest.raises(TypeError, match="PointerTable"):
        spec.prepare_rollback(bufs, copy_table)


def test_freeing_a_state_buffer_poisons_its_table_and_launches(engine, spec):
    bufs = StreamBufs(engine, Geometry(1, 1))
    live, slots, idx = (engine.zeros(np.uint32, n, label=name) for n, name in ((4, "live"), (8, "slots"), (1, "idx")))
    copy_table = state_copy_table(engine, [StateLayer(live, slots, 4, 1)])
    flip_table = state_flip_table(engine, [idx])
    launches = [spec.prepare_state_copy(bufs, copy_table), spec.prepare_state_flip(bufs, flip_table)]
    for launch in launches:
        launch()
    engine.synchronize()
    slots.free()
    idx.free()
    for use, name in ((launches[0], "slots"), (lambda: copy_table.ptr, "slots"), (launches[1], "idx"),
                      (lambda: flip_table.ptr, "idx")):
        with pytest.raises(ValueError, match=name):
            use()
    assert isinstance(flip_table, StateIndexTable) and flip_table.capacity is None


def test_round_stream_takes_state_tables_of_either_kind_and_refuses_the_rest(engine, spec):
    """state_tables= is where the state rollback goes, checked when the stream is built: a KV
    length table there, a state index table among the rollback tables, or a state table of
    another batch, refused before any round is queued."""
    bufs = StreamBufs(engine, Geometry(2, 1, 3))
    lengths = kv_len_ptr_table(engine, Cache.allocate(engine, (True,), capacity=8, batch=3), bufs.pos_ctr_d)
    copy_table = state_copy_table(engine, state_layers(engine, 3, 2, (5, None)))
    flip_table = state_flip_table(engine, [engine.zeros(np.uint32, 3)])
    draft_d, pred_d = engine.zeros(np.uint32, 3 * 2), engine.zeros(np.uint32, 3 * 3)
    wiring = dict(draft_chain=lambda: None, verify_trunk=lambda: None, draft_d=draft_d, acceptance=Greedy(pred_d))
    rounds = RoundStream(bufs, kernels=spec, rollback_tables=[lengths], state_tables=[copy_table, flip_table],
                         **wiring)
    assert rounds.round.commit.kernel.name == "spec_round_tail_greedy"  # accept, commit and the lengths' rollback
    assert [launch.kernel.name for launch in rounds.round.after_commit] == ["spec_state_copy", "spec_state_flip"]
    with pytest.raises(TypeError, match="state_copy_table"):
        RoundStream(bufs, kernels=spec, rollback_tables=[lengths], state_tables=[lengths], **wiring)
    for table in (flip_table, copy_table):
        with pytest.raises(TypeError, match="state tables go in state_tables"):
            RoundStream(bufs, kernels=spec, rollback_tables=[lengths, table], **wiring)
    with pytest.raises(TypeError, match="a list of tables"):
        RoundStream(bufs, kernels=spec, rollback_tables=[lengths], state_tables=flip_table, **wiring)
    with pytest.raises(ValueError, match="the round has B=3"):
        RoundStream(bufs, kernels=spec, rollback_tables=[lengths],
                    state_tables=[state_copy_table(engine, state_layers(engine, 2, 2, (5,)))], **wiring)
    with pytest.raises(ValueError, match=r"u32\[3\]"):
        RoundStream(bufs, kernels=spec, rollback_tables=[lengths],
                    state_tables=[state_flip_table(engine, [engine.zeros(np.uint32, 2)])], **wiring)
    # Memory named twice would be rolled back twice a round, and a second flip undoes the first.
    index = flip_table.targets[0]
    for twice in ([flip_table, flip_table], [flip_table, state_flip_table(engine, [None, index])],
                  [copy_table, state_copy_table(engine, [copy_table.layers[0]])]):
        with pytest.raises(ValueError, match="overlap"):
            RoundStream(bufs, kernels=spec, rollback_tables=[lengths], state_tables=twice, **wiring)
    with pytest.raises(ValueError, match=r"u32\[B\]"):  # however it is built
        StateIndexTable(engine, [engine.zeros(np.int32, 3)])
