import sys; sys.path.insert(0, __import__("os").path.dirname(__file__))
from sim import *
from hier import Hier
def pri(arms):
    base = {'draft@4': 3.6, 'ngram@4': 1.21}
    return {i: base.get(a, 1.52) for i, a in enumerate(arms) if a != "target@0"}
B = ["ngram@4", "feature-general@4", "target@0"]
A = [a for a in ARMS if a != "draft@4"]
for T in ["t0","t0.7"]:
    P = load(T)
    for kw in [dict(), dict(optimism=0.5), dict(prior_tau_frac=0.25)]:
        h = lambda seed, kw=kw: (lambda n: Hier(n, seed=seed, **kw))
        many(T+f" hier 3 arms {kw}", P, make_sel=h, arms=B, priors=pri(B))
        many(T+f" hier 7 arms {kw}", P, make_sel=h, priors=pri(ARMS))
        many(T+f" hier 3 arms δ=1e6 {kw}", P, make_sel=h, arms=B, priors=pri(B), guard_kw={"slack": 1e6})
