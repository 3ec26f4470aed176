import sys, copy; sys.path.insert(0, __import__("os").path.dirname(__file__))
from sim import *
from flashspec.select.registry import make_selector
def pri(arms):
    base = {'draft@4': 3.6, 'ngram@4': 1.21}
    return {i: base.get(a, 1.52) for i, a in enumerate(arms) if a != "target@0"}
th = lambda seed: (lambda n: make_selector("thompson", n, seed=seed))
B = ["ngram@4", "feature-general@4", "target@0"]
for T in ["t0","t0.7"]:
    P = load(T)
    for d in (0.05, 0.2, 1e6):
        many(T+f" 3 arms δ={d}", P, make_sel=th, arms=B, priors=pri(B), guard_kw={"slack": d})
    for d in (1e6,):
        many(T+f" 7 arms δ={d}", P, make_sel=th, priors=pri(ARMS), guard_kw={"slack": d})
