import math, random
class Hier:
    """Thompson on per-step throughput with a per-request random effect (empirical Bayes)."""
    def __init__(self, n, seed=0, prior_tau_frac=0.5, min_requests=2, within_prior_n=2.0, optimism=1.0):
        self.n = n; self.rng = random.Random(seed)
        self.req_means = [[] for _ in range(n)]  # per finished request: (mean, count)
        self.w_n = [0]*n; self.w_ss = [0.0]*n  # pooled within-request sums of squares
        self.max = 1.0; self.prior_tau_frac = prior_tau_frac; self.min_requests = min_requests
        self.within_prior_n = within_prior_n; self.optimism = optimism
        self.start_request()
    def start_request(self):
        self.cnt = [0]*self.n; self.mean = [0.0]*self.n; self.ss = [0.0]*self.n
    def end_request(self):
        for a in range(self.n):
            if self.cnt[a]:
                self.req_means[a].append((self.mean[a], self.cnt[a]))
                self.w_n[a] += self.cnt[a] - 1; self.w_ss[a] += self.ss[a]
        self.start_request()
    def update(self, arm, obs):
        x = obs.tokens / obs.seconds
        self.max = max(self.max, x)
        c = self.cnt[arm] + 1; d = x - self.mean[arm]; self.mean[arm] += d / c; self.ss[arm] += d * (x - self.mean[arm]); self.cnt[arm] = c
    def _within_var(self, a):
        n = self.w_n[a] + max(self.cnt[a] - 1, 0); ss = self.w_ss[a] + self.ss[a]
        prior = (0.5 * self.max) ** 2  # a wide prior on the per-step spread
        return (ss + self.within_prior_n * prior) / (n + self.within_prior_n)
    def _domain(self, a):
        """(mean, between-request variance) of the arm's request means; optimistic before any."""
        rm = self.req_means[a]
        if not rm:
            return self.max * self.optimism, (self.prior_tau_frac * self.max) ** 2
        w = sum(c for _, c in rm); mu = sum(m * c for m, c in rm) / w
        k = len(rm)
        s2 = self._within_var(a)
        if k < self.min_requests:
            tau2 = (self.prior_tau_frac * self.max) ** 2
        else:
            var = sum((m - mu) ** 2 for m, _ in rm) / (k - 1)
            tau2 = max(var - s2 * sum(1 / c for _, c in rm) / k, 1e-4 * mu * mu)
        return mu, tau2
    def posterior(self, a):
        mu, tau2 = self._domain(a); s2 = self._within_var(a); n = self.cnt[a]
        prec = 1 / tau2 + n / s2
        m = (mu / tau2 + n * self.mean[a] / s2) / prec
        return m, 1 / prec
    def select(self):
        best, arm = -math.inf, 0
        for a in range(self.n):
            m, v = self.posterior(a)
            draw = self.rng.gauss(m, math.sqrt(v))
            if draw > best: best, arm = draw, a
        return arm
