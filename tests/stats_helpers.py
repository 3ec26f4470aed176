"""Statistics shared by the distribution tests (SPEC.md §6)."""

from __future__ import annotations

import numpy as np
from scipy import stats

ALPHA = 1e-3  # significance level of every goodness-of-fit test


def chi2_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square p-value of ``observed`` counts against the law ``probs``; cells with
    expected count < 5 are pooled into one. Observations in zero-probability cells give 0."""
    observed = np.asarray(observed, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    n = observed.sum()
    expected = probs / probs.sum() * n
    small = expected < 5
    obs_cells = list(observed[~small])
    exp_cells = list(expected[~small])
    pooled_obs, pooled_exp = observed[small].sum(), expected[small].sum()
    if pooled_exp == 0.0:
        if pooled_obs > 0:
            return 0.0
    else:
        obs_cells.append(pooled_obs)
        exp_cells.append(pooled_exp)
    if len(obs_cells) < 2:
        return 1.0
    return float(stats.chisquare(obs_cells, exp_cells).pvalue)
