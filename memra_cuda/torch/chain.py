"""Speculative decoding by chains: k drafts a round, verified in one forward of the target."""
from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..buffers.acceptance import Acceptance, Greedy, Sampling
from ..buffers.geometry import Geometry
from ..buffers.lengths import DraftLengths
from ..buffers.tables import kv_len_ptr_table
from ..driver.engine import Engine
from ..driver.values import as_flag, as_size
from ..kernels.spec import SpecKernels
from ..rounds.stream import RoundStream
from ..rounds.switch import Widths
from .decoder import RoundDecoder, fold
from .kv import Room
from .sampling import SamplingParams
from .timing import captured, replay_ms
from .uploads import uploaded


MEASURED_REPLAYS = 20  # replays of each width's body timed, in each of MEASURED_PASSES
MEASURED_PASSES = 3  # the widths timed in turn this many times, each keeping its fastest pass


def chain_start(pend: torch.Tensor, pos_ctr: torch.Tensor, done: torch.Tensor, vtok: torch.Tensor,
                accepted: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chain round's draft inputs from its buffers (RoundViews'; `steps` 0..k): the first
    step's tokens and positions ([B][2] each, fold's), and where each step's input sits ([B][k+1],
    from the pending token's). Where the last round accepted no draft, vtok[0] is the token behind
    the pending one (that round's own pending token, or the prompt's, which a prefill writes
    there), appended again unchanged. Compiled with the draft's step (LayerStack.compiled): a
    kernel or two where op by op it was fourteen."""
    positions = pos_ctr.long() + steps  # [B][k+1]
    lone = (done != 0) | (positions[:, :1] == 0)
    return (*fold(pend, positions[:, :1], lone, vtok, accepted), positions)


class SpeculativeLlama(RoundDecoder):
    """A target and a draft model of `batch` rows wired to a RoundStream of chains on one torch
    stream (see RoundDecoder for the models, generate_batch and serve).

    The draft chain runs k draft steps from each row's pending token at its pos_ctr; the verify
    trunk runs the target over vtok at pos_start. Both read every position from round-stream's
    device buffers and write straight into the buffers it reads: greedy, int64 ids (argmax's
    own type) to `draft_d` ([B][k]) and `pred_d` ([B][k+1]); with `sampling`, the target's
    probabilities to `p_d` ([B][k+1][V]), the draft's (`draft_sampling`, default the same) to
    `q_d` ([B][k][V]), and each draft token drawn from them by round-stream's position-keyed
    race (spec_draft_sample), so a request's tokens depend on its seed alone. The RoundStream is
    torch-backed, so the callables need no stream of their own.

    The draft's KV of the last draft token is missing after a round that accepted every draft.
    Instead of a (k+1)-th draft step for it every round (docs/model-side.md), the first step
    appends the token behind the pending one along with it: vtok_d[acc_d[0]] at pos_ctr - 1,
    which is that draft or, in any other round, a token whose entry it rewrites unchanged. A step
    over two tokens costs little more than over one.

    `widths` (below k) adds bodies of those widths: each round, the length chooser picks the
    width whose body commits the most tokens a unit of time for the batch's rows (their
    acceptance so far, each body's time measured here before any capture), and a burst graph
    runs that body (a SWITCH node, CUDA 12.8+: memra_cuda.rounds.switch): W draft steps and a
    verify of W + 1 tokens a row; at 0, the plain step (the draft's first step still takes the
    pending token into its cache). Every row is capped at the width, so the output is the same
    whatever the width. Each width compiles its own steps.

    `skip_done` has the burst graphs skip a round's draft and verify once every row is done, and
    size a burst to cover the rows' need (RoundStream's; CUDA 12.4+; no `widths`, whose SWITCH it
    does not join, and no hybrid target, whose state rollback reads what the skipped verify writes).
    """

    def __init__(self, model: Any, draft: Any, *, k: int = 4, m_rounds: int = 16, capacity: int | Room = 1024,
                 batch: int = 1, sampling: SamplingParams | None = None,
                 draft_sampling: SamplingParams | None = None, state_rollback: str = "copy",
                 on_engine: Callable[[Engine], None] | None = None, compiled: bool | None = None,
                 widths: Sequence[int] = (), skip_done: bool = False):
        # a chain drafts at least one token a round; no drafts at all is the plain loop
        k = as_size(k, "k (no drafts: GraphedGreedy, or a request's max_draft=0)")
        built = Widths.beside(k, widths)  # refused before anything is made
        if as_flag(skip_done, "skip_done") and len(built.widths) > 1:
            raise ValueError("skip_done takes no widths: a round of bodies by width runs a SWITCH of them, not an IF")
        super().__init__(model, draft, Geometry(k, m_rounds, batch), capacity=capacity,
                         sampling=sampling, draft_sampling=draft_sampling, state_rollback=state_rollback,
                         on_engine=on_engine, compiled=compiled, skip_done=skip_done)
        batch = self.batch
        with torch.cuda.stream(self.stream):
            bufs = self.bufs
            self.draft_d = torch.zeros(batch, k, dtype=torch.long, device="cuda")
            self.steps = torch.arange(k + 1, device="cuda")
            spec = SpecKernels(self.engine)
            vocab = model.config.vocab_size
            acceptance: Acceptance
            if sampling is None:
                self.pred_d = torch.zeros(batch, k + 1, dtype=torch.long, device="cuda")
                acceptance = Greedy(self.pred_d)
            else:
                self.p_d = torch.zeros(batch, k + 1, vocab, device="cuda")
                self.q_d = torch.zeros(batch, k, vocab, device="cuda")
                self.draws = [spec.prepare_draft_sample(bufs, self.q_d, self.seed_d, self.draft_d, step, vocab)
                              for step in range(k)]
                acceptance = Sampling(self.p_d, self.q_d, self.seed_d, vocab)
            self.start = self.draft.compiled(chain_start)
            table = kv_len_ptr_table(self.engine, self.target.kv.cache() + self.draft.kv.cache(),
                                     pos_ctr=bufs.pos_ctr_d)
            # every width costs alike until measured (_measure_widths), so the chooser keeps the width
            # at the widest and caps each row at its request's most draft length (Request.max_draft;
            # docs/lengths.md)
            self.widths = built
            self.lengths = DraftLengths(bufs, built.costs({width: 1.0 for width in built.widths}), 0.0)
            narrower = {width: (functools.partial(self.draft_chain, width), functools.partial(self.verify_trunk, width))
                        for width in built.widths if width < k}
            self.rounds = RoundStream(bufs, kernels=spec, draft_chain=self.draft_chain, verify_trunk=self.verify_trunk,
                                      draft_d=self.draft_d, acceptance=acceptance, rollback_tables=[table],
                                      state_tables=self.state_tables(), lengths=self.lengths,
                                      narrower=narrower or None, choose_beside=not narrower,
                                      skip_done=self.skip_done)
            self._warm_up()
            self.width_ms: dict[int, float] = {}  # each width's body, device milliseconds (with `widths`)
            if narrower:
                self._measure_widths()

    def _measure_widths(self) -> None:
        """Each width's body (its draft chain and verify) timed on the device, as a CUDA graph
        replayed, and given to the chooser as that width's cost (draft_cost 0: a body's time is
        its whole cost); each compiled first by an eager run, so no compile is left for a capture.
        The widths are timed in turn, MEASURED_PASSES times, each keeping its fastest: a body
        timed once, alone, took whatever else the GPU ran then as its own cost. (A width's body
        need not cost more than a narrower one's: at one row width 0's target step attends by
        SDPA over the whole cache, a verify by flex over what the rows hold.)
        Every row at half the cache (attention over what a row holds costs more as it grows): the
        rows are vacant, and the next prefill writes over what this wrote. What every width's
        round shares (the chooser, acceptance, commit, rollback: a few small kernels) is not in
        these times, which leans the choice a little toward the narrower widths. Its time goes into
        setup_seconds."""
        begun = time.perf_counter()
        with torch.cuda.stream(self.stream):
            self.views.pos_ctr.fill_(self.target.kv.capacity // 2)
            self.views.pos_start.fill_(self.target.kv.capacity // 2)
            graphs = {width: captured(functools.partial(self._body, width), self.stream)
                      for width in self.widths.widths}
            times = dict.fromkeys(graphs, math.inf)
            for _ in range(MEASURED_PASSES):  # in turn: what else ran on the GPU meanwhile weighs on each alike
                for width, graph in graphs.items():
                    times[width] = min(times[width], replay_ms(graph, self.stream, MEASURED_REPLAYS))
            narrowest = times[self.widths.widths[0]]
            self.width_ms.update(times)
            self.lengths.set_costs(self.widths.costs({width: ms / narrowest for width, ms in times.items()}), 0.0)
        self.setup_seconds += time.perf_counter() - begun

    def _body(self, width: int) -> None:
        """A round's draft chain and verify at `width` (a body of the SWITCH, timed alone)."""
        self.draft_chain(width)
        self.verify_trunk(width)

    def draft_chain(self, width: int | None = None) -> None:
        """k draft steps of every row (`width`'s, for a narrower body), the first folding in the
        last round's deepest draft; at width 0 that step alone, its logits unused: the draft's
        cache still takes the pending token, as every round's does."""
        width = self.k if width is None else width
        views = self.views
        tokens, first, positions = self.start(views.pend, views.pos_ctr, views.done, views.vtok, views.accepted,
                                              self.steps)
        logits = self.draft.logits(tokens, first, last=True)  # [B][1][V]
        if width == 0:
            return
        token = self._draft_token(0, logits)
        for step in range(1, width):
            token = self._draft_token(step, self.draft.logits(token, positions[:, step:step + 1]))

    def _draft_token(self, step: int, logits: torch.Tensor) -> torch.Tensor:
        """Draft token `step` of every row ([B][1]) from the draft's logits there ([B][1][V])."""
        if self.draft_law is None:
            torch.argmax(logits, -1, out=self.draft_d[:, step:step + 1])
        else:
            self.draft_law(self.q_d[:, step], logits[:, 0])
            self.draws[step]()
        return self.draft_d[:, step:step + 1]

    def verify_trunk(self, width: int | None = None) -> None:
        """The target over the k + 1 tokens of every row (`width` + 1, for a narrower body): its
        greedy tokens or its probabilities."""
        verified = self.k + 1 if width is None else width + 1
        self._verdict(self.target.logits(self.views.vtok[:, :verified],  # [B][verified][V]
                                         self.views.pos_start + self.steps[:verified]))

    def _prefilled(self, index: torch.Tensor, prompts: Sequence[Sequence[int]]) -> None:
        """reset zeroes acc_d, so the first draft step reads vtok_d[0] as the token behind the
        pending one: the prompt's last but one."""
        self.views.vtok[index, 0] = uploaded([prompt[-2] if len(prompt) > 1 else 0 for prompt in prompts],
                                             torch.int32, "cuda")
