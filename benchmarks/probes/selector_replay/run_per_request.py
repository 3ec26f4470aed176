import sys; sys.path.insert(0, __import__("os").path.dirname(__file__))
import sim
from sim import *
from per_request import PerRequest
sim.FEATURE_OVERHEAD = 1.0
def pri(arms, f=1.42):
    base = {'draft@4': 3.6, 'ngram@4': 1.21}
    return {i: base.get(a, f) for i, a in enumerate(arms) if a != "target@0"}
B = ["ngram@4", "feature-general@4", "target@0"]
for T in ["t0","t0.7"]:
    P = load(T)
    for kw in [dict(w=4, bonus=0.5), dict(w=4, bonus=0.2), dict(w=8, bonus=0.3), dict(w=2, bonus=0.3), dict(w=4, bonus=0.0)]:
        many(T+f" per-request {kw}", P, seeds=1, make_sel=lambda s, kw=kw: (lambda n: PerRequest(n, s, cost_priors=pri(ARMS), **kw)), priors=pri(ARMS))
    many(T+f" per-request 3 arms w4 b.3", P, seeds=1, make_sel=lambda s: (lambda n: PerRequest(n, s, w=4, bonus=0.3, cost_priors=pri(B))), arms=B, priors=pri(B))
