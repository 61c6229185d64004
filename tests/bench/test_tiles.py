"""benchmarks/tiles.py without a GPU: the projections it sweeps, the cuts of each stage, a verify's
sum, and its command line."""
from __future__ import annotations

import pytest

from benchmarks import tiles
from benchmarks.steps import SHAPES


def skinny():
    """memra_cuda.torch.skinny, whose Tiles the sweep's cuts are: it needs torch and triton (torch's
    own, on a CUDA machine), skipped with the reason where either is missing."""
    pytest.importorskip("torch", reason="needs PyTorch (pip install '.[torch]' in the checkout)")
    pytest.importorskip("triton", reason="skinny's kernel is Triton's (torch's own on a CUDA machine)")
    from memra_cuda.torch import skinny as module
    return module


def test_the_projections_are_the_fused_weights_of_the_shape():
    """q, k and v one matrix and gate and up another, as memra_cuda.torch.fused fuses them, with K/V
    heads fewer than query heads where the shape has them (Llama 3.2's 8 of 32)."""
    assert tiles.projections(SHAPES["target 12 x 768"]) == {
        "qkv": (2304, 768), "o": (768, 768), "gate_up": (4096, 768), "down": (768, 2048), "head": (8192, 768)}
    llama = tiles.projections(SHAPES["Llama 3.2 1B shape"])  # heads of 64
    assert llama["qkv"] == ((32 + 2 * 8) * 64, 2048) and llama["gate_up"] == (2 * 8192, 2048)
    assert llama["head"] == (128256, 2048)


def test_a_verify_counts_each_layers_four_projections_and_the_head_once():
    target = SHAPES["target 12 x 768"]
    assert tiles.verify_us(target, dict(qkv=1.0, o=2.0, gate_up=3.0, down=4.0, head=5.0)) == 12 * 10.0 + 5.0


def test_the_first_stage_splits_k_only_into_slices_that_each_hold_a_block_of_it():
    """A slice of k past its end only adds zeros: every split leaves each slice at least one block_k
    (768 over 128: at most 6, over 64: all the splits), and each cut is a Tiles skinny takes."""
    Tiles = skinny().Tiles
    cuts = tiles.first_cuts(768)
    assert all(isinstance(cut, Tiles) and cut.split_k <= -(-768 // cut.block_k) for cut in cuts)
    assert {cut.split_k for cut in cuts if cut.block_k == 128} == {1, 2, 3, 4, 6}
    assert {cut.split_k for cut in cuts if cut.block_k == 64} == set(tiles.SPLITS)
    assert len(cuts) == len(set(cuts)) == len(tiles.BLOCK_NS) * (5 + len(tiles.SPLITS))
    assert {cut.split_k for cut in tiles.first_cuts(64)} == {1}  # k of one block: never split


def test_the_second_stage_keeps_the_finalists_slices_and_tries_every_launch():
    best = skinny().Tiles(block_n=32, block_k=64, split_k=3)
    cuts = tiles.second_cuts(best)
    assert len(set(cuts)) == len(tiles.SWAPS) * len(tiles.WARPS) * len(tiles.STAGES)
    assert {(cut.block_n, cut.block_k, cut.split_k) for cut in cuts} == {(32, 64, 3)}
    assert best in cuts  # skinny's own launch among them


def test_the_command_line_refuses_rows_past_a_few_and_a_shape_it_does_not_know(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(tiles, "needs", lambda *args, **kwargs: None)  # the run is stubbed: nothing to need
    monkeypatch.setattr(tiles, "measure", lambda shape, rows: ran.append((shape, rows)) or {})
    assert tiles.main([]) == 0 and ran[-1] == ("target 12 x 768", tiles.ROWS)
    assert tiles.main(["--rows", "1,16", "--shape", "draft 2 x 384"]) == 0 and ran[-1] == ("draft 2 x 384", [1, 16])
    for argv in (["--rows", "0"], ["--rows", "17"], ["--rows", "5,5"], ["--rows", ""], ["--shape", "target"]):
        with pytest.raises(SystemExit) as exited:
            tiles.main(argv)
        assert exited.value.code == 2 and "argument --" in capsys.readouterr().err
    assert len(ran) == 2
