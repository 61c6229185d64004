"""What the sampling tests share, wherever their folder: Pearson's chi-square without scipy (the
statistic, the 0.001 critical points, cells that keep a large vocabulary's counts full), the laws
of the acceptance theorem, and the draws that once broke it."""
from __future__ import annotations

import numpy as np

from memra_cuda.testing import reference as ref

# -- chi-square, without scipy ---------------------------------------------------------------

# Upper 0.001 points of the chi-square distribution (standard tables), by degrees of freedom.
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def chi_square(tokens: np.ndarray, law: np.ndarray) -> float:
    """Pearson's statistic of the tokens' histogram against the law (every entry positive)."""
    law = np.asarray(law, np.float64) / np.sum(law)
    counts = np.bincount(tokens, minlength=law.size)
    expected = tokens.size * law
    assert counts.size == law.size and expected.min() >= 50, "the chi-square approximation needs full cells"
    return float(np.sum((counts - expected) ** 2 / expected))


def chi2_critical(df: int) -> float:
    """The upper 0.001 point for `df` degrees of freedom: the table where it has one, else
    Wilson and Hilferty's cube-root approximation (within 1% from df = 5 up, and above)."""
    if df in CHI2_999:
        return CHI2_999[df]
    z = 3.090232  # the standard normal's upper 0.001 point
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def assert_distributed_as(tokens: np.ndarray, law: np.ndarray, what: str) -> None:
    """Chi-square goodness of fit at significance 0.001 (df = len(law) - 1)."""
    stat, critical = chi_square(tokens, law), chi2_critical(len(law) - 1)
    assert stat < critical, f"{what}: chi-square {stat:.1f} >= {critical:.1f} ({len(tokens)} draws)"


def cells(law: np.ndarray, draws: int, least: float = 50) -> np.ndarray:
    """A cell index for each entry of `law` (a vocabulary's probabilities): entries taken from
    the likeliest down, each cell closed once `draws` would fill it with `least` expected
    counts, the rest joined to the last; so a chi-square over a large vocabulary has full cells."""
    law = np.asarray(law, np.float64)
    index, cell, mass = np.empty(len(law), np.int64), 0, 0.0
    for entry in np.argsort(-law, kind="stable"):
        index[entry] = cell
        mass += law[entry]
        if mass * draws >= least:
            cell, mass = cell + 1, 0.0
    if mass * draws < least and cell:  # a short last cell joins the one before
        index[index == cell] = cell - 1
    return index


# (seed, absolute position) whose acceptance draw U(seed, position, 0, 0) is the largest U there is,
# 1 - 2**-24: with 24 bits it was 1 - 2**-25, 1.0 in float32, and these rejected drafts with p = q
# on the H200.
TOP_CELL_DRAWS = [(11264, 8), (46, 342)]


# V = 6. Drafts close to the target, far from it, and none (k = 0).
TARGET = np.array([0.05, 0.10, 0.15, 0.20, 0.22, 0.28], np.float32)
CLOSE = np.array([0.06, 0.09, 0.16, 0.19, 0.23, 0.27], np.float32)
FAR = np.array([0.40, 0.30, 0.15, 0.08, 0.05, 0.02], np.float32)
ROWS = 20_000
CROSS_CHECK_ROWS = 200


def theorem_rows(q: np.ndarray, k: int, rows: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """`rows` rows of one round: fixed p = TARGET at every position and q at every draft position,
    a seed and a start position per row, drafts raced from q by the draft's own draws (purpose 2
    at the drafted token's absolute position), fresh state (no break, not done)."""
    seed = rng.integers(0, 2**64, rows, dtype=np.uint64)
    pos_start = rng.integers(0, 2**31 - 64, rows).astype(np.int32)
    positions = pos_start.astype(np.int64)[:, None] + 1 + np.arange(k)
    drafts = np.argmax(ref.race_scores(q, seed[:, None], positions, ref.PURPOSE_DRAFT), axis=-1)
    vtok = np.concatenate([np.full((rows, 1), 3), drafts], axis=1).astype(np.uint32)
    return dict(vtok=vtok, seed=seed, pos_start=pos_start, p=np.tile(TARGET, (rows, k + 1)),
                q=np.tile(q, (rows, max(k, 1))))
