import sys, math; sys.path.insert(0, __import__("os").path.dirname(__file__))
from sim import *
from flashspec.select.registry import make_selector
def pri(arms):
    base = {'draft@4': 3.6, 'ngram@4': 1.21}
    return {i: base.get(a, 1.52) for i, a in enumerate(arms) if a != "target@0"}
class Elim:
    """Thompson, minus arms whose upper confidence bound is below the target-only arm's mean."""
    def __init__(self, n, seed, z=2.0, min_n=8):
        self.t = make_selector("thompson", n, seed=seed); self.z = z; self.min_n = min_n; self.n = n
    def alive(self, a):
        t = self.t; base = self.n - 1
        if a == base or t.counts[a] < self.min_n or not t.counts[base]: return True
        se = math.sqrt(t.squares[a] / (t.counts[a] - 1) / t.counts[a])
        return t.means[a] + self.z * se >= t.means[base]
    def select(self):
        for _ in range(20):
            a = self.t.select()
            if self.alive(a): return a
        return self.n - 1
    def update(self, a, o): self.t.update(a, o)
A = [a for a in ARMS if a != "draft@4"]
B = ["ngram@4", "feature-general@4", "target@0"]
for T in ["t0","t0.7"]:
    P = load(T)
    for z in (1.0, 2.0):
        many(T+f" elim z={z} 7 arms", P, make_sel=lambda s, z=z: (lambda n: Elim(n, s, z)), priors=pri(ARMS))
    many(T+f" elim z=2 3 arms", P, make_sel=lambda s: (lambda n: Elim(n, s, 2.0)), arms=B, priors=pri(B))
