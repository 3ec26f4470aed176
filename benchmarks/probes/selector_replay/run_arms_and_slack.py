import sys; sys.path.insert(0, __import__("os").path.dirname(__file__))
from sim import *
from flashspec.select.registry import make_selector
def pri(arms):
    base = {'draft@4': 3.6, 'ngram@4': 1.21}
    return {i: base.get(a, 1.52) for i, a in enumerate(arms) if a != "target@0"}
th = lambda seed: (lambda n: make_selector("thompson", n, seed=seed))
for T in ["t0","t0.7"]:
    P = load(T)
    many(T+" current", P, make_sel=th, priors=pri(ARMS))
    A = [a for a in ARMS if a != "draft@4"]
    many(T+" no draft", P, make_sel=th, arms=A, priors=pri(A))
    B = ["ngram@4", "feature-general@4", "target@0"]
    many(T+" ngram+fgeneral", P, make_sel=th, arms=B, priors=pri(B))
    many(T+" current δ=0.02", P, make_sel=th, priors=pri(ARMS), guard_kw={"slack": 0.02})
    many(T+" ngram+fgeneral δ=0.02", P, make_sel=th, arms=B, priors=pri(B), guard_kw={"slack": 0.02})
