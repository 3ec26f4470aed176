"""A factored fuse (SPEC.md §11.8, "A factored fuse"): ``fuse_rank`` ``R`` makes a fused-feature
drafter's ``fuse`` the product ``len(taps)·H → R → H``. The checkpoint records the rank and loads
it back as it was; the checkpoint's bytes shrink exactly as the shapes say; the drafter trains,
loads as ``feature:DIR`` and its greedy output is the target's; ``--resume`` keeps the rank; bad
ranks are clear errors."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from flashspec import FeatureHead, SpeculativeEngine
from flashspec.cli import main
from flashspec.drafters.checkpoint import load_head, save_drafter
from flashspec.drafters.fusion import FactoredLinear, check_fuse_rank
from flashspec.training.train import TrainOptions, train_head
from tiny_models import tiny_model

LAYERS = 4
TAPS = (0, 2)
HIDDEN = 32  # tiny_models' hidden size


@pytest.fixture(scope="module")
def deep():
    torch.set_num_threads(1)
    model = tiny_model("llama", seed=4, vocab_size=64, layers=LAYERS)
    assert model.config.hidden_size == HIDDEN
    return model


def _head(model, rank, taps=TAPS, seed=0):
    """An untrained head that changes the law a lot (drafts both accepted and rejected)."""
    torch.manual_seed(seed)
    head = FeatureHead(model.config, 1, taps=taps, fuse_rank=rank)
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(3.0)
    return head


def _hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _data_bytes(path):
    """The bytes of a safetensors file's tensors: its size less the 8-byte length and the header."""
    raw = path.read_bytes()
    return len(raw) - 8 - struct.unpack("<Q", raw[:8])[0]


def test_a_factored_fuse_round_trips_through_a_checkpoint(deep, tmp_path):
    head = _head(deep, 3)
    assert isinstance(head.fuse, FactoredLinear) and head.fuse.rank == 3 and head.design["fuse_rank"] == 3
    assert {k: tuple(v.shape) for k, v in head.state_dict().items() if k.startswith("fuse")} == {
        "fuse.down.weight": (3, len(TAPS) * HIDDEN), "fuse.up.weight": (HIDDEN, 3)}
    save_drafter(head, deep, tmp_path, storage="same")
    assert json.loads((tmp_path / "drafter.json").read_text())["fuse_rank"] == 3
    loaded = load_head(tmp_path, deep)
    assert loaded.fuse_rank == 3 and isinstance(loaded.fuse, FactoredLinear)
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    x = torch.randn(2, 5, len(TAPS) * HIDDEN)
    torch.testing.assert_close(loaded.fused(x), x @ head.fuse.down.weight.T @ head.fuse.up.weight.T)
    # the full-rank default is unchanged: one matrix, and the record says so
    full = FeatureHead(deep.config, 1, taps=TAPS)
    assert isinstance(full.fuse, torch.nn.Linear) and full.fuse_rank is None
    save_drafter(full, deep, tmp_path / "full")
    assert json.loads((tmp_path / "full" / "drafter.json").read_text())["fuse_rank"] is None
    assert isinstance(load_head(tmp_path / "full", deep).fuse, torch.nn.Linear)


@pytest.mark.parametrize("storage", ["int8", "same"])
def test_the_checkpoint_shrinks_by_the_bytes_the_shapes_give(deep, tmp_path, storage):
    """fuse's bytes: full, ``k·H·H`` entries; factored, ``R·k·H + H·R``; int8 adds a float32
    scale per row (``H`` rows, against ``R + H``); float32 storage 4 bytes an entry."""
    k, rank = len(TAPS), 5
    if storage == "int8":
        full, factored = k * HIDDEN * HIDDEN + 4 * HIDDEN, rank * k * HIDDEN + 4 * rank + HIDDEN * rank + 4 * HIDDEN
    else:
        full, factored = 4 * k * HIDDEN * HIDDEN, 4 * (rank * k * HIDDEN + HIDDEN * rank)
    sizes = {}
    for name, r in (("last", None), ("full", None), ("factored", rank)):
        head = FeatureHead(deep.config, 1, taps=None if name == "last" else TAPS, fuse_rank=r)
        out = save_drafter(head, deep, tmp_path / name, storage=storage)
        sizes[name] = _data_bytes(out / "drafter.safetensors")
        assert json.loads((out / "drafter.json").read_text())["bytes"] == (out / "drafter.safetensors").stat().st_size
    assert sizes["full"] - sizes["last"] == full
    assert sizes["factored"] - sizes["last"] == factored
    assert sizes["factored"] < sizes["full"]


def test_a_trained_factored_drafter_drafts_and_its_output_is_the_targets(deep, tmp_path):
    """Trained briefly on the target's own text (sampled at T = 1), saved int8 and loaded as
    ``feature:DIR``: it learns (loss down, drafts accepted) and greedy output equals generate."""
    engine = SpeculativeEngine(deep, [], device="cpu")
    prompts = [[(7 * i + j) % 64 for j in range(3)] for i in range(40)]
    out = engine.generate(prompts, max_new_tokens=29, do_sample=True, temperature=1.0, eos_token_id=[], seed=0)
    data = torch.tensor([p + s for p, s in zip(prompts, out.sequences)])
    options = TrainOptions(steps=80, batch=8, seq_len=32, lr_layers=1e-2, lr_head=1e-2, estimate_every=80,
                           taps=TAPS, fuse_rank=4)
    head, log = train_head("feature", deep, data[:32], options, estimate=data[32:], progress=False)
    assert log["loss"][-1] < log["loss"][0] and log["options"]["fuse_rank"] == 4
    save_drafter(head, deep, tmp_path, log)
    assert load_head(tmp_path, deep).fuse.rank == 4
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    result = SpeculativeEngine(deep, [f"feature:{tmp_path}"], device="cpu").generate(
        prompts, max_new_tokens=20, num_draft_tokens=4, eos_token_id=[])
    assert result.sequences == [_hf_greedy(deep, p, 20) for p in prompts]
    assert result.stats.accepted > 0


@pytest.mark.parametrize("taps", [TAPS, (1,)])
def test_untrained_factored_drafters_keep_the_targets_greedy_output(deep, tmp_path, taps):
    for rank in (1, HIDDEN):  # the bounds: rank 1, and min(len(taps)·H, H) = H
        folder = tmp_path / f"r{rank}"
        save_drafter(_head(deep, rank, taps, seed=rank), deep, folder)
        prompts = [[5, 1, 7, 2, 9, 3], [4, 4]]
        out = SpeculativeEngine(deep, [f"feature:{folder}"], device="cpu").generate(
            prompts, max_new_tokens=10, num_draft_tokens=3, eos_token_id=[])
        assert out.sequences == [_hf_greedy(deep, p, 10) for p in prompts]


@pytest.mark.parametrize("rank, message", [(0, "from 1 to 32"), (-2, "from 1 to 32"), (True, "integer"),
                                           (HIDDEN + 1, "from 1 to 32"), (2.0, "integer"), ("4", "integer")])
def test_bad_fuse_ranks_are_clear_errors(deep, rank, message):
    with pytest.raises(ValueError, match=message):
        FeatureHead(deep.config, 1, taps=TAPS, fuse_rank=rank)
    with pytest.raises(ValueError, match=message):
        check_fuse_rank(rank, (0,), HIDDEN)  # one tap: the bound is still H = min(1·H, H)


def test_a_fuse_rank_without_taps_is_a_clear_error(deep, tmp_path):
    with pytest.raises(ValueError, match="needs taps"):
        FeatureHead(deep.config, 1, fuse_rank=4)
    with pytest.raises(ValueError, match="give taps too"):
        TrainOptions(fuse_rank=4)
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="fuse_rank must be an integer >= 1"):
            TrainOptions(taps=TAPS, fuse_rank=bad)
    with pytest.raises(ValueError, match="feature drafter only"):
        train_head("shallow", deep, torch.zeros(4, 8, dtype=torch.long),
                   TrainOptions(steps=1, seq_len=8, taps=(0,), fuse_rank=2), progress=False)
    save_drafter(_head(deep, 3), deep, tmp_path)
    with pytest.raises(ValueError, match="keeps its base's fuse"):
        train_head("feature", deep, torch.zeros(4, 8, dtype=torch.long),
                   TrainOptions(steps=1, seq_len=8, taps=TAPS, fuse_rank=2), progress=False,
                   base=load_head(tmp_path, deep))
    record = json.loads((tmp_path / "drafter.json").read_text())
    for bad in (0, HIDDEN + 1, "3", True):  # an edited or foreign record
        (tmp_path / "drafter.json").write_text(json.dumps({**record, "fuse_rank": bad}))
        with pytest.raises(ValueError, match="records fuse_rank"):
            load_head(tmp_path, deep)
    (tmp_path / "drafter.json").write_text(json.dumps({**record, "fuse_rank": 3, "taps": None}))
    with pytest.raises(ValueError, match="records fuse_rank 3 with taps None"):
        load_head(tmp_path, deep)


def test_train_drafter_fuse_rank_and_resume_keeps_it(tmp_path, capsys, monkeypatch):
    """``train-drafter --taps --fuse-rank R`` records R; ``--resume`` keeps it without the flag and
    refuses another; bad values and ``--fuse-rank`` without ``--taps`` fail before any training."""
    monkeypatch.setenv("FLASHSPEC_CACHE", str(tmp_path / "cache"))
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from flashspec.bench.training import bench_training

    model = tiny_model("llama", seed=6, vocab_size=128, layers=LAYERS)
    model.save_pretrained(tmp_path / "target")
    tokenizer = Tokenizer(tok_models.WordLevel({chr(i): i for i in range(128)}, unk_token="?"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="?").save_pretrained(tmp_path / "target")
    text = tmp_path / "data.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(400)))
    common = ["train-drafter", "--target", str(tmp_path / "target"), "--data", str(text), "--steps", "3",
              "--batch", "2", "--seq-len", "32", "--estimate-every", "3", "--device", "cpu", "--storage", "same"]
    first = tmp_path / "first"
    assert main([*common, "--taps", "--fuse-rank", "6", "--total-steps", "6", "--out", str(first)]) == 0, \
        capsys.readouterr().err
    record = json.loads((first / "drafter.json").read_text())
    assert record["fuse_rank"] == 6 and record["taps"] == [0, 1] and record["training"]["options"]["fuse_rank"] == 6
    assert "taps 0,1, fuse rank 6" in bench_training([str(first)])
    second = tmp_path / "second"
    assert main([*common, "--taps", "--resume", str(first), "--out", str(second)]) == 0, capsys.readouterr().err
    record = json.loads((second / "drafter.json").read_text())
    assert record["fuse_rank"] == 6 and record["training"]["options"]["fuse_rank"] == 6
    assert record["training"]["options"]["start_step"] == 3
    assert load_head(second, model).fuse.rank == 6
    third = tmp_path / "third"  # the same rank named again: accepted
    assert main([*common, "--taps", "--fuse-rank", "6", "--resume", str(second), "--total-steps", "9",
                 "--out", str(third)]) == 0, capsys.readouterr().err
    assert json.loads((third / "drafter.json").read_text())["fuse_rank"] == 6
    prompt = [ord(c) for c in "def f3(x):\n"]
    engine = SpeculativeEngine(str(tmp_path / "target"), [f"feature:{second}"], device="cpu")
    assert engine.generate([prompt], max_new_tokens=8, eos_token_id=[]).sequences == [_hf_greedy(model, prompt, 8)]
    capsys.readouterr()
    for flags, message in ((["--taps", "--resume", str(first), "--fuse-rank", "5", "--total-steps", "9"],
                            "keeps its fuse"),
                           (["--fuse-rank", "4"], "give --taps too"),
                           (["--taps", "--fuse-rank", "0"], "--fuse-rank must be an integer >= 1"),
                           (["--taps", "--fuse-rank", "-3"], "--fuse-rank must be an integer >= 1"),
                           (["--taps", "--fuse-rank", "33"], "--fuse-rank must be an integer from 1 to 32"),
                           (["--taps", "0,1,2", "--fuse-rank", "33"], "--fuse-rank must be an integer from 1 to 32")):
        assert main([*common, "--out", str(tmp_path / "bad"), *flags]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
