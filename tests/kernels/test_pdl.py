"""flashspec.kernels.pdl: programmatic dependent launch changes when the decode kernels start, never what
they compute (SPEC §3)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashspec.kernels import pdl

CUDA = torch.cuda.is_available()
# The repository root: the working directory of the child interpreters (a deleted current directory
# makes `import torch` abort in oneMKL, so never inherit one).
ROOT = Path(__file__).resolve().parents[2]


def test_off_where_it_cannot_run():
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_options(torch.device("cpu")) == {}


def test_switch_off_means_plain_launches(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert not pdl.enabled(torch.device("cuda", 0))  # decided before any CUDA query
    assert pdl.launch_options(torch.device("cuda", 0)) == {}


def test_bit_exact_kernels_launch_plainly(monkeypatch):
    """Bit-exact mode never uses PDL (SPEC §14: measured slower there); the default does where it can."""
    monkeypatch.setattr(pdl, "_supported", lambda index: True)
    monkeypatch.setattr(pdl, "ENABLED", True)
    cuda = torch.device("cuda", 0)
    assert pdl.enabled(cuda) and pdl.launch_options(cuda) == {"launch_pdl": True}
    assert not pdl.enabled(cuda, exact=True)
    assert pdl.launch_options(cuda, exact=True) == {}


@pytest.mark.parametrize("value,expected", [(None, "True"), ("1", "True"), ("0", "False")])
def test_environment_variable(value, expected):
    env = {k: v for k, v in os.environ.items() if k != "FLASHSPEC_PDL"}
    if value is not None:
        env["FLASHSPEC_PDL"] = value
    out = subprocess.run([sys.executable, "-c", "from flashspec.kernels import pdl; print(pdl.ENABLED)"],
                         env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected


def test_environment_variable_refuses_other_values():
    env = dict(os.environ, FLASHSPEC_PDL="yes")
    out = subprocess.run([sys.executable, "-c", "import flashspec.kernels.pdl"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode != 0
    assert "FLASHSPEC_PDL must be 1" in out.stderr and "'yes'" in out.stderr


def _forward_logits(lm, width: int) -> list[torch.Tensor]:
    """Logits of one forward after a 20-token prefill: eagerly, then twice from a CUDA graph."""
    from flashspec.models.graphs import Graphs

    lm.reset(1, 64)
    gen = torch.Generator().manual_seed(width)
    lm.forward(torch.randint(0, 128, (1, 20), generator=gen).cuda(), torch.zeros(1, dtype=torch.long, device="cuda"))
    tokens = torch.randint(0, 128, (1, width), generator=gen).cuda()
    start = torch.full((1,), 20, device="cuda")
    graphs = Graphs(enabled=True)
    return [graphs.run("f", lambda: lm.forward(tokens, start)).clone() for _ in range(3)]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("width", [1, 5])
@pytest.mark.parametrize("bit_exact", [False, True])
def test_forward_bit_identical_with_and_without_pdl(monkeypatch, width, bit_exact):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from flashspec.models.static import StaticLM

    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("this GPU or Triton has no programmatic dependent launch")
    torch.manual_seed(0)
    # bit-exact mode: several K tiles per map; its maps and attention launch plainly either way, its
    # rotary kernel with PDL or without
    hidden, inner = (512, 1024) if bit_exact else (64, 96)
    config = Qwen2Config(vocab_size=128, hidden_size=hidden, intermediate_size=inner, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    lm = StaticLM(Qwen2ForCausalLM(config).to("cuda", torch.bfloat16).eval())
    if bit_exact:
        lm.bit_exact = True
    else:
        lm.decode_maps = lm.decode_maps_wide = {"qkv", "o", "gate_up", "down"}  # every decode kernel
    with_pdl = _forward_logits(lm, width)
    monkeypatch.setattr(pdl, "ENABLED", False)
    without = _forward_logits(lm, width)
    for a, b in zip(with_pdl, without):
        assert torch.equal(a, b)
