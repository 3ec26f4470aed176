import json, lzma, collections, statistics as st
for run in ["benchmarks/results/never_slower_h200_s25", "benchmarks/results/never_slower_h200_s26"]:
  for T in ["t0"]:
    d = json.load(lzma.open(f"{run}/never_slower_{T}/e2e.json.xz"))
    calls = d["cells"][0]["calls"]
    for sysname in sorted({c["system"] for c in calls if "auto" in c["system"]}):
        by = collections.defaultdict(list)
        for c in calls:
            if c["system"] != sysname: continue
            last = {}
            for i, (arm, s) in enumerate(zip(c["arms"], c["step_seconds"])):
                if arm.startswith("feature"):
                    gap = i - last[arm] - 1 if arm in last else None
                    key = "first" if gap is None else ("0" if gap == 0 else "1-3" if gap <= 3 else "4-7" if gap <= 7 else "8-15" if gap <= 15 else "16+")
                    by[key].append(s * 1e3)
                last[arm] = i
        print(run[-8:], T, sysname, {k: (len(v), round(st.median(v), 3)) for k, v in sorted(by.items())})
