"""A switch of bodies by width on the GPU (memra_cuda.rounds.switch): a graph whose conditional
SWITCH node runs the body of the width the length chooser's width_d holds, the narrowest wider
one for a width with no body of its own, k's for a width past k; the width read at each launch,
so one graph follows the device's value. Skipped, with the reason, where the driver has no
SWITCH nodes (CUDA 12.8+)."""
from __future__ import annotations

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import StreamBufs
from memra_cuda.buffers import DraftLengths
from memra_cuda.driver.graph import Graph, loops
from memra_cuda.rounds.switch import Widths, WidthSwitch

pytestmark = pytest.mark.gpu


@pytest.fixture
def lengths(engine, switches):
    return DraftLengths(StreamBufs(engine, Geometry(4, 1, 1)), [1.0] * 5, 0.0)


def test_the_switch_runs_the_body_of_the_chosen_width_or_the_narrowest_wider_one(engine, lengths):
    widths = Widths(4, (0, 2, 4))
    switch = WidthSwitch(lengths, widths)
    ran = engine.zeros(np.uint32, 2, label="which body ran, and a word after the switch")
    bodies = [engine.prepare_set_u32(ran, 0, 100 + body) for body in range(len(widths.widths))]

    def build(builder):
        builder.issue(engine.prepare_set_u32(ran, 0, 7))
        switch.add(builder, bodies)
        builder.issue(engine.prepare_set_u32(ran, 1, 55))

    graph = Graph(engine, lambda: None, capture=loops(build))
    for width, body in [(0, 0), (1, 1), (2, 1), (3, 2), (4, 2), (2**31, 2)]:
        engine.copy_htod(lengths.width_d, np.array([width], np.uint32))
        engine.memset(ran, 0)
        graph.launch()
        assert engine.dtoh(ran).tolist() == [100 + body, 55], f"width {width}"


def test_a_switch_refuses_bodies_that_are_not_one_a_width(engine, lengths):
    switch = WidthSwitch(lengths, Widths(4, (1, 4)))
    with pytest.raises(ValueError, match=r"one body for each of the widths \(1, 4\), not 3"):
        Graph(engine, lambda: None, capture=loops(lambda builder: switch.add(builder, [lambda: None] * 3)))
    with pytest.raises(ValueError, match="Widths of k = 4"):
        WidthSwitch(lengths, Widths(3, (3,)))
