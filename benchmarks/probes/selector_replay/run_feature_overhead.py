import sys; sys.path.insert(0, __import__("os").path.dirname(__file__))
import sim
from sim import *
from flashspec.select.registry import make_selector
def pri(arms, f=1.52):
    base = {'draft@4': 3.6, 'ngram@4': 1.21}
    return {i: base.get(a, f) for i, a in enumerate(arms) if a != "target@0"}
th = lambda seed: (lambda n: make_selector("thompson", n, seed=seed))
B = ["ngram@4", "feature-general@4", "target@0"]
for T in ["t0","t0.7"]:
    P = load(T)
    for ov in (2.25/2.09, 1.0):
        sim.FEATURE_OVERHEAD = ov
        many(T+f" current overhead {ov:.3f}", P, make_sel=th, priors=pri(ARMS, 1.52*ov/1.077))
        many(T+f" 3 arms overhead {ov:.3f}", P, make_sel=th, arms=B, priors=pri(B, 1.52*ov/1.077))
