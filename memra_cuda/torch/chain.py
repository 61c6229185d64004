"""Speculative decoding by chains: k drafts a round, verified in one forward of the target."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..buffers.acceptance import Acceptance, Greedy, Sampling
from ..buffers.lengths import DraftLengths
from ..buffers.tables import kv_len_ptr_table
from ..driver.engine import Engine
from ..driver.values import as_size
from ..kernels.spec import SpecKernels
from ..rounds.stream import RoundStream
from .decoder import RoundDecoder
from .sampling import SamplingParams


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
    """

    def __init__(self, model: Any, draft: Any, *, k: int = 4, m_rounds: int = 16, capacity: int = 1024,
                 batch: int = 1, sampling: SamplingParams | None = None,
                 draft_sampling: SamplingParams | None = None, state_rollback: str = "copy",
                 on_engine: Callable[[Engine], None] | None = None, compiled: bool | None = None):
        k = as_size(k, "k")  # a chain drafts at least one token a round
        super().__init__(model, draft, k=k, verified=k, m_rounds=m_rounds, batch=batch, capacity=capacity,
                         sampling=sampling, draft_sampling=draft_sampling, state_rollback=state_rollback,
                         on_engine=on_engine, compiled=compiled)
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
            table = kv_len_ptr_table(self.engine, self.target.kv.cache() + self.draft.kv.cache(),
                                     pos_ctr=bufs.pos_ctr_d)
            # every width costs alike, so the chooser keeps the width at k and caps each row at its
            # request's most draft length (Request.max_draft; docs/lengths.md)
            self.lengths = DraftLengths(bufs, [1.0] * (k + 1), 0.0)
            self.rounds = RoundStream(bufs, kernels=spec, draft_chain=self.draft_chain, verify_trunk=self.verify_trunk,
                                      draft_d=self.draft_d, acceptance=acceptance, rollback_tables=[table],
                                      state_tables=self.state_tables(), lengths=self.lengths)
            self._warm_up()

    def draft_chain(self) -> None:
        """k draft steps of every row, the first folding in the last round's deepest draft."""
        views = self.views
        positions = views.pos_ctr.long() + self.steps  # [B][k+1]: where each draft step's input sits
        # Where the last round accepted no draft, vtok[0] is the token behind the pending one
        # (that round's own pending token, or the prompt's, which a prefill writes there),
        # appended again unchanged.
        lone = (views.done != 0) | (positions[:, :1] == 0)
        token = self._draft_token(0, self._folded_logits(views.pend, positions[:, :1], lone))
        for step in range(1, self.k):
            token = self._draft_token(step, self.draft.logits(token, positions[:, step:step + 1]))

    def _draft_token(self, step: int, logits: torch.Tensor) -> torch.Tensor:
        """Draft token `step` of every row ([B][1]) from the draft's logits there ([B][1][V])."""
        if self.draft_sampling is None:
            torch.argmax(logits, -1, out=self.draft_d[:, step:step + 1])
        else:
            self.q_d[:, step].copy_(self.draft_sampling.probs(logits[:, 0]))
            self.draws[step]()
        return self.draft_d[:, step:step + 1]

    def verify_trunk(self) -> None:
        """The target over the k + 1 tokens of every row: its greedy tokens or its probabilities."""
        self._verdict(self.target.logits(self.views.vtok, self.views.pos_start.long() + self.steps))  # [B][k+1][V]

    def _prefilled(self, index: torch.Tensor, prompts: Sequence[Sequence[int]]) -> None:
        """reset zeroes acc_d, so the first draft step reads vtok_d[0] as the token behind the
        pending one: the prompt's last but one."""
        behind = torch.tensor([prompt[-2] if len(prompt) > 1 else 0 for prompt in prompts], device="cuda")
        self.views.vtok[index, 0] = behind.to(torch.int32)
