import sys; sys.path.insert(0, __import__("os").path.dirname(__file__))
import sim
from sim import *
sim.FEATURE_OVERHEAD = 1.0
def pri(arms, f=1.42):
    base = {'draft@4': 3.6, 'ngram@4': 1.21}
    return {i: base.get(a, f) for i, a in enumerate(arms) if a != "target@0"}
class Fixed:
    def __init__(self, arm): self.arm = arm
    def select(self): return self.arm
    def update(self, a, o): pass
for T in ["t0","t0.7"]:
    P = load(T)
    for kw in [dict(slack=0.01), dict(slack=0.02), dict(slack=0.05), dict(slack=0.01, grace=3), dict(slack=0.01, grace=8), dict(slack=1e6)]:
        res = []
        for p in P:
            best = max((a for a in ARMS if a != "target@0"), key=lambda a: -sum(p["traces"][a][2]))
            res += run([p], make_sel=lambda n, best=best: Fixed(ARMS.index(best)), priors=pri(ARMS), guard_kw=kw)
        low, below, cells = summary([res])
        print(T, "oracle", kw, round(low,3), below, {d: round(m,3) for d,(m,n) in cells.items()}, flush=True)
