"""Scratch probe (session 25): how much of the first request's time to first token in
`flashspec bench serve` is the openai client's own first use in the process, and how much the
server's, and what the server's frozen heap changes. A tiny random-weight model on this CPU, a
fresh process per trial; the TTFT phase (`flashspec.bench.serve._ttft`): "without" the offline
client warm-up, "with" it, "with, no freeze" with it but `flashspec.serve.freeze_heap` a no-op;
the oldest-generation garbage collections during the phase (count, longest) are recorded.
Usage: PYTHONPATH=.:tests python benchmarks/probes/ttft_client.py OUT.json [TRIALS]"""
import asyncio
import gc
import json
import time
import subprocess
import sys


def trial(variant: str) -> dict:
    from tiny_models import CharTokenizer, tiny_model

    from flashspec import SpeculativeEngine
    from flashspec.bench import serve as bench
    from flashspec.serve import start_server

    import flashspec.serve as serving

    if variant == "without":
        async def nothing() -> None:
            return None
        bench._warm_client_offline = nothing
    if variant == "with, no freeze":
        serving.freeze_heap = lambda: None
    engine = SpeculativeEngine(tiny_model("llama", seed=0), [], device="cpu")
    engine.tokenizer = CharTokenizer()
    server = start_server(engine, slots=8, max_length=128)
    pauses, began = [], [0.0]

    def watch(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                began[0] = time.perf_counter()
            else:
                pauses.append(time.perf_counter() - began[0])

    gc.callbacks.append(watch)
    try:
        rows = asyncio.run(bench._ttft(server.url, {16: list(range(3, 19)), 40: list(range(3, 43))}, 8, 6, 60))
    finally:
        gc.callbacks.remove(watch)
        server.stop()
    return {"variant": variant, "oldest_generation_collections_s": pauses, "rows": [{k: r[k] for k in ("prompt_tokens", "first_ttft_s", "warm_ttft_s",
                                                            "server_first_ttft_s", "server_warm_ttft_s")} for r in rows]}


if __name__ == "__main__":
    if sys.argv[1] in ("with", "without", "with, no freeze"):
        print(json.dumps(trial(sys.argv[1])))
        sys.exit(0)
    out, trials = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 6
    results = []
    for _ in range(trials):
        for variant in ("without", "with", "with, no freeze"):
            line = subprocess.run([sys.executable, __file__, variant], capture_output=True, text=True,
                                  check=True).stdout.strip().splitlines()[-1]
            results.append(json.loads(line))
    with open(out, "w") as f:
        json.dump({"trials": results}, f, indent=1)
    for variant in ("without", "with", "with, no freeze"):
        pauses = [p for t in results if t["variant"] == variant for p in t["oldest_generation_collections_s"]]
        print(variant, "oldest-generation collections:", len(pauses), "longest %.0f ms" % (max(pauses, default=0) * 1e3))
        firsts = [t["rows"][0] for t in results if t["variant"] == variant]
        print(variant, "16 tokens, first request after start-up: client",
              [round(r["first_ttft_s"] * 1e3, 1) for r in firsts], "warm",
              [round(r["warm_ttft_s"] * 1e3, 1) for r in firsts], "server first",
              [round(r["server_first_ttft_s"] * 1e3, 1) for r in firsts])
