"""Trace-driven replay of the auto selector + guard on session 25's H200 fixed-arm traces (scratch)."""
import json, lzma, bisect, statistics as st, sys, random, collections
sys.path.insert(0, ".")
from flashspec.select.guard import Guard
from flashspec.select.registry import make_selector
from flashspec.select.base import Observation

ARMS = ['draft@4', 'ngram@4', 'feature-general@4', 'feature-code@4', 'feature-prose@4', 'feature-chat@4', 'target@0']

def load(T):
    d = json.load(lzma.open(f"benchmarks/results/never_slower_h200_s25/never_slower_{T}/e2e.json.xz"))
    calls = d["cells"][0]["calls"]
    by = collections.defaultdict(dict)
    for c in calls:
        by[(c["group"], c["domain"])][c["system"].replace("flashspec ", "").replace("flashspec", "target@0")] = c
    prompts = []
    for (g, dom), m in sorted(by.items()):
        traces = {}
        for arm in ARMS:
            c = m[arm if arm != "target@0" else "target@0"]
            pos, p = [], 0
            for t in c["step_tokens"]:
                pos.append(p); p += t
            traces[arm] = (pos, c["step_tokens"], c["step_seconds"])
        prompts.append(dict(group=g, domain=dom, traces=traces, base=m["target@0"], auto=m["auto"]))
    return prompts

FEATURE_OVERHEAD = 2.25 / 2.09
DRAFT_CATCHUP = 2.8e-3

def outcome(pr, arm, x, prev_arm):
    if arm == "target@0":
        pos, tok, sec = pr["traces"][arm]; i = min(int(x), len(sec) - 1)
        return 1, sec[max(i, 1)]
    pos, tok, sec = pr["traces"][arm]
    i = max(bisect.bisect_right(pos, x) - 1, 0)
    s = sec[max(i, 1)]
    t = max(1, int(round(pos[i] + tok[i] - x)))  # the rest of the run that covers x (no inspection bias)
    if arm == "feature-general@4" and False: pass
    if arm.startswith("feature"): s *= FEATURE_OVERHEAD
    if arm == "draft@4" and prev_arm != "draft@4": s += DRAFT_CATCHUP
    return t, s

def run(prompts, make_sel, guard_kw=None, arms=ARMS, new_tokens=256, sync=8, seed=0, priors=None, request_view=None, merge=None):
    """Replays every prompt in order with per-domain selector states; ratio per call."""
    sels = {}
    base_arm = arms.index("target@0")
    gammas = [0 if a == "target@0" else 4 for a in arms]
    drafters = [None if a == "target@0" else i for i, a in enumerate(arms)]
    out = []
    for pr in prompts:
        sel = sels.setdefault(pr["domain"], make_sel(len(arms)))
        if request_view is not None:
            domain_sel, sel = sel, request_view(sel)
        g = Guard(gammas, base_arm, priors=priors, arm_drafters=drafters,
                  catch_up_priors={(arms.index("draft@4"), b): DRAFT_CATCHUP / 1.48e-3 for b in (16, 32, 64, 128, 256, 512)} if "draft@4" in arms else {},
                  **(guard_kw or {}))
        g.prefill(pr["base"]["first_token_seconds"], 300)
        x = 1; seconds = 0.0; launched = []; observed = 0; prev = None; since = None; counts = collections.Counter()
        def launch():
            nonlocal prev
            arm, w = g.choose(sel.select, lambda a: (16 if arms[a] == "draft@4" and prev != arms[a] else 0), getattr(sel, "rank", None))
            launched.append((arm, w)); prev_arm = prev; prev = arms[arm]
            return arm, w, prev_arm
        def poll(upto):
            nonlocal observed
            for (arm, w, tok, s) in results[observed:upto]:
                g.observe(arm, tok, s, 1, w)
                tok = int(tok); sel.update(arm, Observation(accepted=min(max(tok - 1, 0), gammas[arm]), proposed=gammas[arm], tokens=tok, seconds=s))
            observed = upto
        results = []
        while x < new_tokens:
            if since is None or since >= sync:
                arm, w, pa = launch()
                tok, s = outcome(pr, arms[arm], x, pa); tok = min(tok, new_tokens - x)
                results.append((arm, w, tok, s)); x += tok; seconds += s; counts[arms[arm]] += 1
                poll(len(results) - 1); since = 1
                continue
            arm, w, pa = launch()
            tok, s = outcome(pr, arms[arm], x, pa); tok = min(tok, new_tokens - x)
            results.append((arm, w, tok, s)); x += tok; seconds += s; counts[arms[arm]] += 1
            since += 1
        if merge is not None:
            merge(domain_sel, sel)
        if hasattr(sel, "end_request"):
            sel.end_request()
        if hasattr(sel, "begin_request"):
            sel.begin_request()
        base = sum(pr["base"]["step_seconds"]) + pr["base"]["first_token_seconds"]
        mine = seconds + pr["base"]["first_token_seconds"]
        fixed = {a: base / (sum(pr["traces"][a][2]) * (FEATURE_OVERHEAD if a.startswith("feature") and False else 1) + pr["base"]["first_token_seconds"]) for a in ARMS}
        out.append(dict(domain=pr["domain"], group=pr["group"], ratio=base / mine, real=base / (pr["auto"]["seconds"] - 0) * (1), fixed=fixed, counts=counts))
    return out

def summary(outs):
    """Per-seed lists of calls -> (lowest, below, per-domain mean over seeds of median/best)."""
    lows, belows, cells = [], [], collections.defaultdict(list)
    for out in outs:
        lows.append(min(o["ratio"] for o in out)); belows.append(sum(o["ratio"] < 0.97 for o in out))
        for dom in ["code", "prose", "chat"]:
            rs = [o for o in out if o["domain"] == dom]
            med = st.median(o["ratio"] for o in rs)
            best = max(st.median(o["fixed"][a] for o in rs) for a in ARMS if a != "target@0")
            cells[dom].append(med / best)
    return min(lows), sum(belows), {d: (st.mean(v), min(v)) for d, v in cells.items()}

def many(label, P, seeds=8, **kw):
    outs = [run(P, seed=seed, **{k: (v(seed) if k == "make_sel" else v) for k, v in kw.items()}) for seed in range(seeds)]
    low, below, cells = summary(outs)
    print(f"{label:44s} low {low:.3f} below {below:2d}  " + "  ".join(f"{d} {m:.2f} (min {n:.2f})" for d, (m, n) in cells.items()), flush=True)
    return outs

def report(out, label):
    lines = []
    lowest = min(o["ratio"] for o in out)
    below = sum(o["ratio"] < 0.97 for o in out)
    cells = []
    for dom in ["code", "prose", "chat"]:
        rs = [o for o in out if o["domain"] == dom]
        med = st.median(o["ratio"] for o in rs)
        best = max(st.median(o["fixed"][a] for o in rs) for a in ARMS if a != "target@0")
        cells.append(f"{dom} {med:.2f}/{best:.2f}={med/best:.2f}")
    print(f"{label:40s} low {lowest:.3f} below {below}  " + "  ".join(cells))
