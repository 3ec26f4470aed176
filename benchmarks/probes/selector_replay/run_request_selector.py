import sys; sys.path.insert(0, __import__("os").path.dirname(__file__))
import sim
from sim import *
from flashspec.select import RequestSelector
from flashspec.select.registry import make_selector
sim.FEATURE_OVERHEAD = 1.0
def pri(arms, f=1.42):
    base = {'draft@4': 3.6, 'ngram@4': 1.21}
    return {i: base.get(a, f) for i, a in enumerate(arms) if a != "target@0"}
B = ["ngram@4", "feature-general@4", "target@0"]
for T in ["t0","t0.7"]:
    P = load(T)
    many(T+" thompson 7 arms", P, seeds=4, make_sel=lambda s: (lambda n: make_selector("thompson", n, seed=s)), priors=pri(ARMS))
    many(T+" request 7 arms", P, seeds=4, make_sel=lambda s: (lambda n: RequestSelector(n, seed=s)), priors=pri(ARMS))
    many(T+" request 3 arms", P, seeds=4, make_sel=lambda s: (lambda n: RequestSelector(n, seed=s)), arms=B, priors=pri(B))
    many(T+" thompson 3 arms", P, seeds=4, make_sel=lambda s: (lambda n: make_selector("thompson", n, seed=s)), arms=B, priors=pri(B))
