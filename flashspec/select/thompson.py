"""Thompson sampling: draw a mean for every arm from its posterior, play the largest draw.

Two conjugate models (SPEC.md, §bandits):

* ``model="beta"`` (the default for ``reward="acceptance"``): every proposed draft is a
  Bernoulli trial that succeeds when it is accepted, with a common per-arm acceptance rate
  ``θ_i ~ Beta(α₀, β₀)``. A step with ``a`` accepted of ``p`` proposed multiplies the
  likelihood by ``θ^a (1 − θ)^(p − a)``, so the posterior is
  ``Beta(α₀ + Σ a, β₀ + Σ (p − a))``; both parameters stay ``>= α₀, β₀ > 0``.
* ``model="gaussian"`` (the default for ``reward="throughput"``): the step reward, normalised
  ``y = x / M`` (``M`` the running maximum, as for UCB), is ``N(μ_i, 1/τ_i)`` with
  ``(μ_i, τ_i) ~ NormalGamma(μ₀, κ₀, α₀, β₀)``. After ``n`` rewards with mean ``ȳ`` and
  sum of squared deviations ``S``: ``κ = κ₀ + n``, ``μ = (κ₀ μ₀ + n ȳ) / κ``,
  ``α = α₀ + n / 2``, ``β = β₀ + S / 2 + κ₀ n (ȳ − μ₀)² / (2 κ)``. A draw is
  ``τ ~ Gamma(shape α, rate β)``, then ``μ ~ N(μ, 1 / (κ τ))``.
"""

from __future__ import annotations

import math
from typing import Any

from .base import BaseSelector, _count, _real, positive

__all__ = ["ThompsonSelector"]

MODELS = ("beta", "gaussian")
# Gaussian prior in normalised units (rewards in [0, 1]): centre 0.5, one pseudo-observation,
# prior precision ~ Exp(rate 0.25) (mean 4, i.e. σ ≈ 0.5): wide enough that an unplayed arm is
# soon tried, weak enough that a few real rewards dominate.
GAUSSIAN_PRIOR = {"prior_mean": 0.5, "prior_kappa": 1.0, "prior_alpha": 1.0, "prior_beta": 0.25}


class ThompsonSelector(BaseSelector):
    """Thompson sampling with a Beta-Bernoulli (per-draft acceptances) or a normal-gamma
    (continuous reward such as throughput) posterior. Options: ``model``, and the priors
    ``prior_alpha``/``prior_beta`` (beta: default 1, 1 = uniform) or ``prior_mean``,
    ``prior_kappa``, ``prior_alpha``, ``prior_beta`` (gaussian: see ``GAUSSIAN_PRIOR``)."""

    kind = "thompson"

    def __init__(
        self,
        num_arms: int,
        *,
        model: str | None = None,
        prior_alpha: float | None = None,
        prior_beta: float | None = None,
        prior_mean: float | None = None,
        prior_kappa: float | None = None,
        **options: Any,
    ) -> None:
        super().__init__(num_arms, **options)
        if model is None:
            model = "beta" if self.reward == "acceptance" else "gaussian"
        if model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {model!r}.")
        if model == "beta" and self.reward != "acceptance":
            raise ValueError(
                "model='beta' is the posterior of per-draft acceptances: it needs reward='acceptance' "
                "(use model='gaussian' for throughput)."
            )
        self.model = model
        if model == "beta":
            if prior_mean is not None or prior_kappa is not None:
                raise ValueError("prior_mean and prior_kappa belong to model='gaussian'.")
            self.prior_alpha = positive(1.0 if prior_alpha is None else prior_alpha, "prior_alpha")
            self.prior_beta = positive(1.0 if prior_beta is None else prior_beta, "prior_beta")
            self.prior_mean = self.prior_kappa = None
            self.successes = [0] * self.num_arms  # Σ accepted
            self.failures = [0] * self.num_arms  # Σ (proposed − accepted)
        else:
            g = GAUSSIAN_PRIOR
            self.prior_mean = _real(g["prior_mean"] if prior_mean is None else prior_mean, "prior_mean")
            self.prior_kappa = positive(g["prior_kappa"] if prior_kappa is None else prior_kappa, "prior_kappa")
            self.prior_alpha = positive(g["prior_alpha"] if prior_alpha is None else prior_alpha, "prior_alpha")
            self.prior_beta = positive(g["prior_beta"] if prior_beta is None else prior_beta, "prior_beta")
            # Welford statistics of the raw rewards (scaled by 1/M when the posterior is formed).
            self.counts = [0] * self.num_arms
            self.means = [0.0] * self.num_arms
            self.squares = [0.0] * self.num_arms  # Σ (x − mean)²

    def _config(self) -> dict[str, Any]:
        config = {**super()._config(), "model": self.model}
        config.update(prior_alpha=self.prior_alpha, prior_beta=self.prior_beta)
        if self.model == "gaussian":
            config.update(prior_mean=self.prior_mean, prior_kappa=self.prior_kappa)
        return config

    # -- posteriors ----------------------------------------------------------------------

    def posterior(self, arm: int) -> tuple[float, ...]:
        """The posterior parameters of ``arm``: ``(α, β)`` for beta,
        ``(μ, κ, α, β)`` (normalised units) for gaussian."""
        arm = self._check_arm(arm)
        with self._lock:
            return self._posterior(arm)

    def _posterior(self, arm: int) -> tuple[float, ...]:
        if self.model == "beta":
            return (self.prior_alpha + self.successes[arm], self.prior_beta + self.failures[arm])
        n = self.counts[arm]
        m = self.normaliser
        mean = self.means[arm] / m
        squares = max(self.squares[arm], 0.0) / (m * m)
        k0, mu0 = self.prior_kappa, self.prior_mean
        kappa = k0 + n
        mu = (k0 * mu0 + n * mean) / kappa
        alpha = self.prior_alpha + n / 2
        beta = self.prior_beta + squares / 2 + k0 * n * (mean - mu0) ** 2 / (2 * kappa)
        return (mu, kappa, alpha, beta)

    def _draw(self, arm: int) -> float:
        rng = self._rng
        if self.model == "beta":
            return rng.betavariate(self.prior_alpha + self.successes[arm], self.prior_beta + self.failures[arm])
        mu, kappa, alpha, beta = self._posterior(arm)
        tau = rng.gammavariate(alpha, 1.0 / beta)  # shape α, scale 1/β (rate β)
        if tau <= 0.0:  # underflow of a tiny shape: an infinitely wide draw → the prior mean's side
            tau = 5e-324
        return rng.gauss(mu, 1.0 / math.sqrt(kappa * tau))

    def _select(self) -> int:
        return self._argmax([self._draw(i) for i in range(self.num_arms)])

    def _update(self, arm: int, obs, reward: float) -> None:
        if self.model == "beta":
            self.successes[arm] += obs.accepted
            self.failures[arm] += obs.proposed - obs.accepted
            return
        n = self.counts[arm] + 1
        delta = reward - self.means[arm]
        self.means[arm] += delta / n
        self.squares[arm] += delta * (reward - self.means[arm])
        self.counts[arm] = n

    # -- state ---------------------------------------------------------------------------

    def _get_stats(self) -> dict[str, Any]:
        if self.model == "beta":
            return {"successes": list(self.successes), "failures": list(self.failures)}
        return {"counts": list(self.counts), "means": list(self.means), "squares": list(self.squares)}

    def _set_stats(self, stats: dict[str, Any]) -> None:
        if self.model == "beta":
            successes = [_count(v, "successes") for v in stats["successes"]]
            failures = [_count(v, "failures") for v in stats["failures"]]
            if len(successes) != self.num_arms or len(failures) != self.num_arms:
                raise ValueError("malformed selector state: per-arm statistics of the wrong length.")
            self.successes, self.failures = successes, failures
            return
        counts = [_count(v, "counts") for v in stats["counts"]]
        means = [_real(v, "means") for v in stats["means"]]
        squares = [_real(v, "squares") for v in stats["squares"]]
        if not len(counts) == len(means) == len(squares) == self.num_arms or min(squares) < 0:
            raise ValueError("malformed selector state: per-arm statistics of the wrong length or sign.")
        self.counts, self.means, self.squares = counts, means, squares
