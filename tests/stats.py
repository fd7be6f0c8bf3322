"""Goodness-of-fit helpers for the losslessness tests."""

from __future__ import annotations

from collections import Counter

import numpy as np
from scipy import stats


def chi_square_pvalue(counts: Counter, expected_probs: dict, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of observed counts against an exact distribution.

    Outcomes with probability 0 must never be observed (returns 0.0 if one is). Outcomes with a
    small expected count are pooled into one cell so the chi-square approximation holds.
    """
    n = sum(counts.values())
    if any(expected_probs.get(k, 0.0) == 0.0 for k in counts):
        return 0.0
    obs, exp, pooled_obs, pooled_exp = [], [], 0.0, 0.0
    for key, prob in expected_probs.items():
        if prob == 0.0:
            continue
        if n * prob < min_expected:
            pooled_obs += counts.get(key, 0)
            pooled_exp += n * prob
        else:
            obs.append(counts.get(key, 0))
            exp.append(n * prob)
    if pooled_exp > 0:
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    obs_a, exp_a = np.asarray(obs, dtype=float), np.asarray(exp, dtype=float)
    chi2 = float(((obs_a - exp_a) ** 2 / exp_a).sum())
    return float(stats.chi2.sf(chi2, len(obs) - 1))
