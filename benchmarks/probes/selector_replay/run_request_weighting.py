import sys, copy; sys.path.insert(0, __import__("os").path.dirname(__file__))
from sim import *
from flashspec.select.registry import make_selector
def pri(arms):
    base = {'draft@4': 3.6, 'ngram@4': 1.21}
    return {i: base.get(a, 1.52) for i, a in enumerate(arms) if a != "target@0"}
th = lambda seed: (lambda n: make_selector("thompson", n, seed=seed))
def view(k):
    def v(dom):
        s = make_selector('thompson', dom.num_arms, seed=0); s.counts=list(dom.counts); s.means=list(dom.means); s.squares=list(dom.squares); s._max_reward=dom._max_reward; s._start_counts = list(dom.counts); s._start_means = list(dom.means); s._start_sq = list(dom.squares)
        for a in range(s.num_arms):
            n = s.counts[a]
            if n > k:
                s.squares[a] *= k / n; s.counts[a] = k
        s._k_counts = list(s.counts); s._k_means = list(s.means); s._k_sq = list(s.squares)
        s._rng.seed(dom._rng.random())
        return s
    return v
def merge(dom, req):
    # add the request's own observations (beyond its start) into the domain's statistics
    for a in range(dom.num_arms):
        n1 = req.counts[a] - req._k_counts[a]
        if n1 <= 0: continue
        # request-only mean/sq: invert Welford combine of (k-state) + (request-only)
        nk, mk, sk = req._k_counts[a], req._k_means[a], req._k_sq[a]
        n, m, sq = req.counts[a], req.means[a], req.squares[a]
        m1 = (n*m - nk*mk)/n1
        s1 = sq - sk - nk*n1/n*(mk-m1)**2
        N, M, S = dom.counts[a], dom.means[a], dom.squares[a]
        T = N + n1; d = m1 - M
        dom.means[a] = M + d*n1/T; dom.squares[a] = S + s1 + d*d*N*n1/T; dom.counts[a] = T
    dom._max_reward = max(dom._max_reward, req._max_reward)
B = ["ngram@4", "feature-general@4", "target@0"]
A = [a for a in ARMS if a != "draft@4"]
for T in ["t0","t0.7"]:
    P = load(T)
    many(T+" 3 arms, per-request fresh", P, make_sel=th, arms=B, priors=pri(B), request_view=lambda d: th(0)(d.num_arms))
    for k in (2, 5, 10, 20):
        many(T+f" 3 arms, domain prior k={k}", P, make_sel=th, arms=B, priors=pri(B), request_view=view(k), merge=merge)
    many(T+f" 6 arms, domain prior k=5", P, make_sel=th, arms=A, priors=pri(A), request_view=view(5), merge=merge)
