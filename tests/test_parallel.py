"""Tensor-parallel targets on the CPU (SPEC.md §9): two processes on the gloo backend.

``tests/parallel_worker.py`` runs as two ranks (started like ``torchrun`` would: ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, with a ``file://`` rendezvous instead of a port), shards tiny
float32 Llama, Qwen2 (q/k/v biases) and Qwen3 (q/k norms, tied head, a vocabulary of 127 that
does not split evenly) targets over both, and decodes. Here we check that

* greedy outputs equal single-process ``SpeculativeEngine`` and ``model.generate`` outputs
  token for token, target-only and with a model drafter and the n-gram drafter;
* both ranks produce identical tokens when sampling, with a seed and without (rank 0's seed),
  and with a learning selector timed by each rank's own clock;
* a model whose heads do not split raises a ``ValueError`` that says so.

The NCCL/CUDA path is the same code with another backend: ``torchrun ... -m flashspec bench tp``.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flashspec import SpeculativeEngine
from flashspec.models.parallel import check_shardable, shard_model

import parallel_worker as worker

WORLD_SIZE = 2
WORKER = Path(__file__).with_name("parallel_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Run the two ranks once; what each of them wrote."""
    out = tmp_path_factory.mktemp("tensor_parallel")
    env = {**os.environ, "WORLD_SIZE": str(WORLD_SIZE), "FLASHSPEC_TEST_INIT": f"file://{out / 'rendezvous'}",
           "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(out)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                         cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(WORLD_SIZE)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} failed (exit {p.returncode}):\n{log[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


@functools.lru_cache(maxsize=None)
def single_process(arch: str, kind: str) -> list[list[int]]:
    """The same request decoded by one process with the whole target."""
    model = worker.target(arch)
    engine = SpeculativeEngine(model, worker.drafter(arch, kind, model), device="cpu")
    out = engine.generate(worker.PROMPTS, max_new_tokens=worker.NEW_TOKENS, num_draft_tokens=worker.GAMMA,
                          eos_token_id=[])
    return out.sequences


@functools.lru_cache(maxsize=None)
def hf_greedy(arch: str, prompt: tuple[int, ...]) -> list[int]:
    """transformers' greedy ``generate`` with the whole target, one prompt alone."""
    model = worker.target(arch)
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=worker.NEW_TOKENS,
                             do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("kind", worker.DRAFTERS)
@pytest.mark.parametrize("arch", worker.ARCHS)
def test_greedy_equals_single_process(ranks, arch, kind):
    expected = [hf_greedy(arch, tuple(p)) for p in worker.PROMPTS]
    assert single_process(arch, kind) == expected  # the reference itself is HF's greedy output
    for rank in ranks:
        assert rank[arch][f"greedy/{kind}"] == expected, f"rank {rank['rank']}, {arch}, drafter {kind}"


@pytest.mark.parametrize("arch", worker.ARCHS)
def test_each_rank_holds_half_the_heads(ranks, arch):
    heads, kv_heads, cache_shape = ranks[0][arch]["heads"]
    assert (heads, kv_heads) == (2, 1)  # 4 query heads, 2 key/value heads, 2 ranks
    assert cache_shape[1] == 1  # the KV cache holds this rank's key/value head only


@pytest.mark.parametrize("arch", worker.ARCHS)
def test_transformers_generate_runs_on_the_sharded_model(ranks, arch):
    for rank in ranks:
        assert rank[arch]["hf_generate"] == hf_greedy(arch, tuple(worker.PROMPTS[2]))


def test_load_tensor_parallel_from_a_checkpoint(ranks):
    for rank in ranks:
        assert rank["loaded"] == [hf_greedy("llama", tuple(p)) for p in worker.PROMPTS]


def test_ranks_agree_on_every_output(ranks):
    """Sampling with a seed, without one, and under a learning selector timed by each rank's
    own clock: identical tokens (and arm choices) on both ranks."""
    first, second = ({k: v for k, v in r.items() if k != "rank"} for r in ranks)
    assert first == second
    for arch in worker.ARCHS:
        case = first[arch]
        assert case["sampled/seed"] != case["greedy/model"]  # it did sample
        assert sum(case["ucb1/arms"].values()) > 0


def test_seeded_sampling_equals_single_process(ranks):
    """With the same seed, a sharded target draws what the whole one draws: the uniforms are the
    same and the logits differ by float32 rounding only (a different draw would need a uniform
    within ~1e-7 of a CDF step; with these fixed seeds none is)."""
    model = worker.target("llama")
    engine = SpeculativeEngine(model, worker.drafter("llama", "model", model), device="cpu")
    out = engine.generate(worker.PROMPTS, seed=7, max_new_tokens=worker.NEW_TOKENS, num_draft_tokens=worker.GAMMA,
                          eos_token_id=[], **worker.SAMPLING)
    assert ranks[0]["llama"]["sampled/seed"] == out.sequences


def test_indivisible_heads_raise_value_error(ranks):
    for rank in ranks:
        assert "num_key_value_heads (1) is not divisible by 2" in rank["indivisible"]
    llama3_8b = SimpleNamespace(num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336)
    check_shardable(llama3_8b, 8)
    with pytest.raises(ValueError, match="num_attention_heads \\(32\\) is not divisible by 3"):
        check_shardable(llama3_8b, 3)
    with pytest.raises(ValueError, match="intermediate_size \\(14336\\) is not divisible by 3"):
        check_shardable(SimpleNamespace(num_attention_heads=6, num_key_value_heads=3, intermediate_size=14336), 3)


def test_shard_model_needs_a_process_group():
    if torch.distributed.is_initialized():
        pytest.skip("this process already belongs to a process group")
    with pytest.raises(ValueError, match="init_tensor_parallel"):
        shard_model(worker.target("llama"))


def test_bench_tp_chi_square_matches_the_tests_helper():
    """The GPU benchmark's χ² (no scipy on the GPU image) agrees with the tests' scipy one."""
    from stats_helpers import chi2_pvalue as reference

    from flashspec.bench.tp import chi2_pvalue

    gen = torch.Generator().manual_seed(0)
    law = torch.softmax(torch.randn(4096, generator=gen) * 2, dim=0).double()
    for n, skew in ((20_000, 0.0), (20_000, 0.3), (500, 0.0)):
        tilted = torch.softmax(law.log() * (1 + skew), dim=0)
        counts = torch.bincount(torch.multinomial(tilted, n, replacement=True, generator=gen), minlength=4096)
        assert abs(chi2_pvalue(counts, law) - reference(counts.numpy(), law.numpy())) < 1e-9
