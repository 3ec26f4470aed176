import math, random
class PerRequest:
    """Per arm: tokens a step, a request's own mean shrunk to its domain's (weight w steps);
    seconds a step from the domain; play the best estimate of tokens per second, with a
    UCB bonus on the request's own count."""
    def __init__(self, n, seed=0, w=4.0, bonus=0.5, prior_tokens=2.5, target=None, cost_priors=None):
        self.cost_priors = cost_priors or {}
        self.n = n; self.w = w; self.bonus = bonus; self.prior = prior_tokens; self.target = n - 1 if target is None else target
        self.dt = [0.0]*n; self.ds = [0]*n; self.dsec = [0.0]*n
        self.rng = random.Random(seed); self.start_request()
    def start_request(self):
        self.rt = [0.0]*self.n; self.rs = [0]*self.n; self.t = 0
    def end_request(self):
        for a in range(self.n):
            self.dt[a] += self.rt[a]; self.ds[a] += self.rs[a]
        self.start_request()
    def update(self, arm, obs):
        self.rt[arm] += obs.tokens; self.rs[arm] += 1; self.dsec[arm] += obs.seconds; self.t += 1
        self._sec_n = getattr(self, "_sec_n", [0]*self.n); self._sec_n[arm] += 1
    def _sec(self, a):
        sn = getattr(self, "_sec_n", [0]*self.n)
        if sn[a]: return self.dsec[a] / sn[a]
        base = self.dsec[self.target] / sn[self.target] if sn[self.target] else 1.5e-3
        return base * (1.0 if a == self.target else self.cost_priors.get(a, 1.4))
    def est(self, a):
        if a == self.target: return 1.0
        dm = (self.dt[a] + self.prior) / (self.ds[a] + 1)
        return (self.w * dm + self.rt[a]) / (self.w + self.rs[a])
    def select(self):
        best, arm = -1, self.target
        for a in range(self.n):
            v = self.est(a) / self._sec(a)
            if a != self.target:
                v *= 1 + self.bonus * math.sqrt(math.log(self.t + 2) / (self.w + self.rs[a]))
            if v > best: best, arm = v, a
        return arm
