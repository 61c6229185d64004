"""The kernel ABI: every kernel of the committed PTX (ptx/*.cu) by its extern "C" name, with its
parameters' names and types as the source declares them (tests/kernels/test_signatures.py reads
the sources and checks this table against them, both ways).

A module loaded through `load` checks every prepare against this table, so a launcher that
passes a u32 where the kernel reads an f32 is refused at prepare, naming the kernel and the
parameter, and the launchers take their types from here instead of spelling them out.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..driver.signature import ArgType, Signature

if TYPE_CHECKING:
    from ..driver.engine import Engine
    from ..driver.module import Module

__all__ = ["SIGNATURES", "load"]

_sig = Signature.of

# What every tree kernel takes: the tree's fields (TreeBufs' one allocation), T + 1 nodes a row,
# the words of a node's ancestor mask, the depth and the batch.
_TREE: dict[str, ArgType] = {"tree": "ptr", "T1": "u32", "W": "u32", "D": "u32", "B": "u32"}
# The toy's recurrent layers (the bits of rec_mask): their states' tables and a state's words.
_TOY_STATE: dict[str, ArgType] = {"st_live": "ptr", "st_slots": "ptr", "st_idx": "ptr", "rec_mask": "u32",
                                 "words": "u32"}
# The coefficients of the toy's law over the vocabulary (docs/toy-model.md).
_TOY_LAW: dict[str, ArgType] = {"floor": "f32", "c0": "f32", "c1": "f32", "c2": "f32", "c3": "f32"}

_GREEDY = _sig(vtok_d="ptr", pred_d="ptr", k="u32", B="u32", brk_d="ptr", acc_d="ptr", last_pred_d="ptr",
              ctl_d="ptr")
_ASSEMBLE = _sig(pend_d="ptr", draft_d="ptr", k="u32", B="u32", vtok_d="ptr", pos_ctr="ptr", pos_start_d="ptr")
_DRAFT_SAMPLE = _sig(step="u32", k="u32", V="u32", B="u32", q_d="ptr", pos_ctr_d="ptr", seed_d="ptr", draft_d="ptr",
                    scratch="ptr")
_TREE_GROW = _sig(**_TREE, level="u32", prev_start="u32", prev_stop="u32", start="u32", stop="u32", cand_tok="ptr",
                 cand_logq="ptr", cand_sel="ptr", K="u32", shape="ptr", branch="u32", pos_start_d="ptr")
_TREE_GREEDY = _sig(**_TREE, pred_d="ptr", vtok_d="ptr", brk_d="ptr", acc_d="ptr", last_pred_d="ptr", ctl_d="ptr")
# What a greedy round's tail adds to its acceptance's: the commit's ring and the rollback's table.
_TAIL: dict[str, ArgType] = {"pend_d": "ptr", "ring_d": "ptr", "ring_cap": "u32", "len_ptrs": "ptr", "n_ptrs": "u32",
                             "pos_start_d": "ptr"}
_ROUND_TAIL = _sig(vtok_d="ptr", pred_d="ptr", k="u32", B="u32", brk_d="ptr", acc_d="ptr", last_pred_d="ptr",
                  ctl_d="ptr", **_TAIL)
_TREE_ROUND_TAIL = _sig(**_TREE, pred_d="ptr", vtok_d="ptr", brk_d="ptr", acc_d="ptr", last_pred_d="ptr", ctl_d="ptr",
                       **_TAIL)

SIGNATURES: Mapping[str, Signature] = {
    # ptx/spec_stream.cu: the round's bookkeeping (docs/kernels.md)
    "spec_seed_gather": _sig(rows="ptr", n_rows="u32", row_words="u32", B="u32", acc_d="ptr", out="ptr"),
    "spec_assemble_verify": _ASSEMBLE,
    "spec_assemble_verify_t64": _ASSEMBLE,
    "spec_accept_greedy_dc": _GREEDY,
    "spec_accept_greedy_dc_t64": _GREEDY,
    "spec_ring_commit": _sig(vtok_d="ptr", acc_d="ptr", last_pred_d="ptr", ctl_d="ptr", pend_d="ptr", ring_d="ptr",
                            ring_cap="u32", k="u32", B="u32"),
    "spec_ring_publish": _sig(ring_d="ptr", ring_cap="u32", B="u32", pub_d="ptr", seq_d="ptr", out_head="ptr",
                             out_count="ptr", out_tokens="ptr", out_stamps="ptr", out_cap="u32"),
    "spec_rollback_stream": _sig(len_ptrs="ptr", n_ptrs="u32", B="u32", pos_start_d="ptr", ctl_d="ptr"),
    "spec_round_tail_greedy": _ROUND_TAIL,  # 3, 4 and 5 in one launch
    "spec_round_tail_greedy_t64": _ROUND_TAIL,
    "spec_state_copy": _sig(table="ptr", n_entries="u32", B="u32", k="u32", ctl_d="ptr"),
    "spec_state_flip": _sig(idx_ptrs="ptr", n_ptrs="u32", B="u32", k="u32", ctl_d="ptr"),
    "spec_choose_lengths": _sig(ctl_d="ptr", acc_d="ptr", brk_d="ptr", rate_d="ptr", cap_d="ptr", cost_d="ptr",
                               width_d="ptr", k="u32", B="u32", decay="f32", prior="f32"),
    # ptx/spec_sample.cu: stochastic acceptance and the draft's draw
    "spec_accept_sample": _sig(vtok_d="ptr", p_d="ptr", q_d="ptr", V="u32", k="u32", B="u32", brk_d="ptr", acc_d="ptr",
                              last_pred_d="ptr", ctl_d="ptr", pos_start_d="ptr", seed_d="ptr", scratch="ptr"),
    "spec_draft_sample": _DRAFT_SAMPLE,
    "spec_draft_sample_t64": _DRAFT_SAMPLE,
    # ptx/spec_tree.cu: the tree round (docs/trees.md)
    "spec_tree_begin": _sig(**_TREE, pend_d="ptr", pos_ctr="ptr", pos_start_d="ptr", vtok_d="ptr"),
    "spec_tree_grow": _TREE_GROW,
    "spec_tree_grow_t64": _TREE_GROW,
    "spec_tree_draw": _sig(**_TREE, level="u32", prev_start="u32", prev_stop="u32", shape="ptr", q_d="ptr", V="u32",
                          seed_d="ptr", pos_start_d="ptr", R="u32", slices="u32", cand_tok="ptr", cand_logq="ptr",
                          cand_sel="ptr", keys="ptr", counts="ptr"),
    "spec_tree_accept_greedy": _TREE_GREEDY,
    "spec_tree_accept_greedy_t64": _TREE_GREEDY,
    "spec_tree_round_tail_greedy": _TREE_ROUND_TAIL,  # 13, 4 and 5 in one launch
    "spec_tree_round_tail_greedy_t64": _TREE_ROUND_TAIL,
    "spec_tree_judge": _sig(**_TREE, p_d="ptr", q_d="ptr", V="u32", seed_d="ptr", pos_start_d="ptr", ctl_d="ptr",
                           judged="ptr"),
    "spec_tree_judge_pass": _sig(**_TREE, p_d="ptr", q_d="ptr", V="u32", seed_d="ptr", pos_start_d="ptr", judged="ptr",
                                j="u32", slices="u32", partial="ptr", counts="ptr"),
    "spec_tree_race": _sig(**_TREE, p_d="ptr", q_d="ptr", V="u32", seed_d="ptr", pos_start_d="ptr", judged="ptr",
                          vtok_d="ptr", brk_d="ptr", acc_d="ptr", last_pred_d="ptr", ctl_d="ptr", scratch="ptr"),
    "spec_tree_compact": _sig(table="ptr", n_layers="u32", **_TREE, acc_d="ptr", pos_start_d="ptr", ctl_d="ptr"),
    "spec_tree_state_copy": _sig(table="ptr", n_entries="u32", **_TREE, ctl_d="ptr"),
    "spec_tree_state_flip": _sig(idx_ptrs="ptr", n_ptrs="u32", **_TREE, ctl_d="ptr"),
    # ptx/device_loop.cu: device mode's decider
    "spec_loop_decide": _sig(ctl_d="ptr", pub_d="ptr", acc_d="ptr", B="u32", loop_d="ptr", handle="u64", ran="u32",
                            body="u32", paced="u32"),
    "spec_select_width": _sig(width_d="ptr", body_of="ptr", k="u32", handle="u64"),  # a SWITCH of bodies by width
    "spec_rows_live": _sig(ctl_d="ptr", B="u32", handle="u64"),  # the IF gate of a round's model work
    # ptx/toy_lm.cu: the toy model (memra_cuda.testing.toy, docs/toy-model.md)
    "toy_prefill": _sig(tokens="ptr", n="u32", row="u32", capacity="u32", tgt_data="ptr", tgt_len="ptr",
                       n_layers="u32", layer0="u32", draft_data="ptr", draft_len="ptr", seed="u32"),
    "toy_prefill_state": _sig(tokens="ptr", n="u32", row="u32", live="ptr", slots="ptr", idx="ptr", rec_mask="u32",
                             words="u32", k1="u32", seed="u32"),
    "toy_draft_step": _sig(step="u32", k="u32", pend_d="ptr", draft_d="ptr", pos_ctr="ptr", brk_d="ptr",
                          draft_data="ptr", draft_len="ptr", capacity="u32", kv_mask="u32", n_layers="u32",
                          seed="u32", vocab="u32", noise_ppm="u32", break_below="u32", state_d="ptr", **_TOY_STATE),
    "toy_verify": _sig(vtok_d="ptr", k1="u32", pos_start_d="ptr", pred_d="ptr", tgt_data="ptr", tgt_len="ptr",
                      n_layers="u32", capacity="u32", seed="u32", vocab="u32", layer0="u32", partial_in="ptr",
                      partial_out="ptr", **_TOY_STATE),
    "toy_draft_sample": _sig(step="u32", k="u32", state_d="ptr", pos_ctr="ptr", draft_d="ptr", q_d="ptr", seed_d="ptr",
                            vocab="u32", **_TOY_LAW, scratch="ptr"),
    "toy_probs": _sig(totals="ptr", rows="u32", seed="u32", vocab="u32", **_TOY_LAW, p_d="ptr"),
    "toy_finish": _sig(totals="ptr", n="u32", seed="u32", vocab="u32", pred_d="ptr"),
    "toy_stream_weights": _sig(weights="ptr", n_vec="u64", sink="ptr"),
    "toy_tree_draft": _sig(start="u32", stop="u32", last="u32", t1="u32", mask_words="u32", cands="u32", tok_d="ptr",
                          parent_d="ptr", pos_d="ptr", mask_d="ptr", pos_start_d="ptr", cand_tok="ptr",
                          cand_logp="ptr", hash_d="ptr", draft_data="ptr", draft_len="ptr", capacity="u32",
                          kv_mask="u32", n_layers="u32", seed="u32", vocab="u32", noise_ppm="u32", spread="u32",
                          **_TOY_STATE),
    "toy_tree_probs": _sig(hash_d="ptr", t1="u32", start="u32", stop="u32", batch="u32", vocab="u32", **_TOY_LAW,
                          q_d="ptr"),
    "toy_tree_verify": _sig(t1="u32", mask_words="u32", tok_d="ptr", parent_d="ptr", pos_d="ptr", mask_d="ptr",
                           pos_start_d="ptr", pred_d="ptr", totals_d="ptr", tgt_data="ptr", tgt_len="ptr",
                           n_layers="u32", capacity="u32", seed="u32", vocab="u32", **_TOY_STATE),
    # ptx/probe.cu: the driver layer's tests and the bench's measurements
    "probe_increment": _sig(x="ptr", n="u32"),
    "probe_touch": _sig(x="ptr"),
    "probe_spin": _sig(x="ptr", cycles="u64"),
    "probe_gate": _sig(go="ptr", most="u64"),
    "probe_clock": _sig(flag="ptr", device_ns="ptr"),
}


def load(engine: Engine, name: str) -> Module:
    """ptx/<name>.ptx in `engine`, loaded once (Engine.load_ptx), its kernels checked against
    SIGNATURES: every prepare refuses types other than the table's, and may leave them out."""
    return engine.load_ptx(name, SIGNATURES)
