"""Fused-feature drafters (SPEC.md §11, "Fused features"; EAGLE-3): a feature drafter that reads
several of the target's layers (``taps``) instead of its last one. The engine hands it every
tapped layer's features; training computes the same network the drafter runs; checkpoints keep
the taps and refuse a target without those layers; output stays the target's (greedy here, by χ²
in tests/test_distribution.py, case ``feature-fused``); and ``taps=None`` is the last-layer
drafter exactly as before taps existed."""

from __future__ import annotations

import json
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashspec import FeatureHead, SpeculativeEngine
from flashspec.cli import main
from flashspec.drafters import History
from flashspec.drafters.checkpoint import load_head, save_drafter
from flashspec.drafters.feature import check_taps, default_taps, tapped_layers
from flashspec.sampling import SamplingParams
from flashspec.training.train import TrainOptions, _features_and_logits, _passes, _reads, train_head
from tiny_models import tiny_model

LAYERS = 4  # deep enough for taps that leave the last layer out


@pytest.fixture(scope="module")
def deep():
    return tiny_model("llama", seed=4, vocab_size=64, layers=LAYERS)


@pytest.fixture(scope="module")
def deep_data(deep):
    """Sequences the target itself wrote (sampled at T = 1): data a drafter can learn."""
    engine = SpeculativeEngine(deep, [], device="cpu")
    prompts = [[(7 * i + j) % 64 for j in range(3)] for i in range(48)]
    out = engine.generate(prompts, max_new_tokens=29, do_sample=True, temperature=1.0, eos_token_id=[], seed=0)
    return torch.tensor([p + s for p, s in zip(prompts, out.sequences)])


@pytest.fixture(scope="module")
def fused(deep, deep_data, tmp_path_factory):
    """A fused head on layers 0 and 2 (not the last), trained briefly, and its checkpoint."""
    options = TrainOptions(steps=120, batch=8, seq_len=32, lr_layers=1e-2, lr_head=1e-2, estimate_every=60,
                           taps=(0, 2))
    head, log = train_head("feature", deep, deep_data[:40], options, estimate=deep_data[40:], progress=False)
    folder = tmp_path_factory.mktemp("fused")
    save_drafter(head, deep, folder, log, storage="same")
    return folder, log


def _head(model, taps, seed=0, **design):
    """An untrained head that changes the law a lot (drafts both accepted and rejected)."""
    torch.manual_seed(seed)
    head = FeatureHead(model.config, 1, taps=taps, **design)
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


def test_default_taps_are_eagle3s_low_middle_and_high_layers():
    """EAGLE-3 reads the inputs of layers 2, L/2 and L − 3: the outputs of layers 1, L/2 − 1 and
    L − 4 (0-based), which are the engine's features after 2, L/2 and L − 3 layers."""
    assert default_taps(32) == (1, 15, 28) and tapped_layers(default_taps(32), 32) == (2, 16, 29)
    assert default_taps(28) == (1, 13, 24)  # Qwen2.5-1.5B
    assert default_taps(4) == (0, 1) and default_taps(2) == (0, 1) and default_taps(1) == (0,)
    assert tapped_layers(None, 28) == (28,)  # without taps: the last layer, before the norm


@pytest.mark.parametrize("taps, message", [((4,), "from 0 to 3"), ((-1,), "from 0 to 3"), ((), "one or more"),
                                           ((1, 1), "distinct"), (3, "sequence"), ((1.5,), "integer")])
def test_bad_taps_are_clear_errors(deep, taps, message):
    with pytest.raises(ValueError, match=message):
        FeatureHead(deep.config, 1, taps=taps)
    with pytest.raises(ValueError, match=message):
        check_taps(taps, LAYERS)


def test_bad_taps_in_training_options_are_clear_errors():
    with pytest.raises(ValueError, match="distinct"):
        TrainOptions(taps=(1, 1))
    with pytest.raises(ValueError, match="feature_weight"):
        TrainOptions(taps=(0, 1), feature_weight=1.0)  # a fused feature has nothing to regress to
    assert TrainOptions(taps=[2, 0]).taps == (2, 0)  # kept in the order given: the order fuse reads them
    with pytest.raises(ValueError, match="feature drafter only"):
        train_head("shallow", tiny_model("llama", seed=1, vocab_size=64), torch.zeros(4, 8, dtype=torch.long),
                   TrainOptions(steps=1, seq_len=8, taps=(0,)), progress=False)


def test_the_engine_asks_the_target_for_every_tapped_layer_once(deep, tmp_path):
    save_drafter(_head(deep, (2, 0)), deep, tmp_path / "fused")
    save_drafter(_head(deep, None), deep, tmp_path / "last")
    engine = SpeculativeEngine(deep, [f"feature:{tmp_path / 'fused'}", f"feature:{tmp_path / 'last'}",
                                      f"feature:{tmp_path / 'fused'}"], device="cpu")
    assert engine.drafters[0].feature_layers == (3, 1)  # in tap order
    assert engine.drafters[1].feature_layers == (LAYERS,)
    assert engine._feature_layers == (1, 3, LAYERS)  # the union, once
    out = engine.generate([[1, 2, 3, 4, 5]], max_new_tokens=6, eos_token_id=[])
    assert set(engine._buffers.hidden) == {1, 3, LAYERS}
    assert out.sequences == [_hf_greedy(deep, [1, 2, 3, 4, 5], 6)]


def test_the_drafter_runs_the_network_training_trains(deep, tmp_path):
    """The features the engine's prefill and verify forwards write for the taps, fused and fed as
    the drafter feeds them, give the logits of training's first pass on the same tokens (SPEC.md
    §11: what is trained is what drafts)."""
    head = _head(deep, (0, 2), seed=1)
    save_drafter(head, deep, tmp_path, storage="same")
    engine = SpeculativeEngine(deep, [f"feature:{tmp_path}"], device="cpu")
    engine.generate([[5, 1, 7, 2, 9, 3]], max_new_tokens=14, num_draft_tokens=3, eos_token_id=[])
    drafter, ws = engine.drafters[0], engine._buffers
    length = int(ws.length[0])  # features are the target's at every position before the pending one
    history = History(ws.tokens, ws.length, ws.active, length, ws.hidden)
    with torch.inference_mode():
        zero = torch.zeros(1, dtype=torch.long)
        served = drafter._feed(ws.tokens, drafter._hidden(history), drafter._features, zero, length, None)
    loaded = load_head(tmp_path, deep)
    ids = ws.tokens[:, :length]
    with torch.no_grad():
        features, _ = _features_and_logits(deep, ids, _reads(loaded, deep))
        trained = _passes(loaded, loaded.draft_model(deep), deep, ids, features, 1)[0][0]
    assert features.shape[-1] == 2 * deep.config.hidden_size
    torch.testing.assert_close(served[:, :length], trained, rtol=1e-4, atol=1e-4)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(taps=st.lists(st.integers(0, LAYERS - 1), min_size=1, max_size=LAYERS, unique=True),
       gamma=st.integers(1, 5), batch=st.integers(1, 3), new_tokens=st.integers(1, 16), seed=st.integers(0, 3))
def test_greedy_output_is_the_targets_for_any_taps(deep, taps, gamma, batch, new_tokens, seed):
    folder = tempfile.mkdtemp(prefix="flashspec-fused-")
    save_drafter(_head(deep, tuple(taps), seed), deep, folder)
    prompts = [[(5 * b + 3 * i + seed) % 64 for i in range(2 + 3 * b)] for b in range(batch)]
    engine = SpeculativeEngine(deep, [f"feature:{folder}"], device="cpu")
    out = engine.generate(prompts, max_new_tokens=new_tokens, num_draft_tokens=gamma, eos_token_id=[])
    assert out.sequences == [_hf_greedy(deep, p, new_tokens) for p in prompts]


def test_training_a_fused_head_learns_and_its_checkpoint_keeps_the_taps(deep, deep_data, fused):
    folder, log = fused
    untrained = train_head("feature", deep, deep_data[:40], TrainOptions(steps=1, batch=8, seq_len=32, taps=(0, 2)),
                           estimate=deep_data[40:], progress=False)[1]
    assert log["loss"][-1] < log["loss"][0]
    assert log["estimates"][-1]["alpha1"] > untrained["estimates"][-1]["alpha1"] + 0.05
    assert log["options"]["taps"] == (0, 2) and log["options"]["feature_weight"] == 0.0  # tokens only
    record = json.loads((folder / "drafter.json").read_text())
    assert record["taps"] == [0, 2]
    head = load_head(folder, deep)
    assert head.taps == (0, 2) and head.fuse.weight.shape == (deep.config.hidden_size, 2 * deep.config.hidden_size)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    out = SpeculativeEngine(deep, [f"feature:{folder}"], device="cpu").generate(
        prompts, max_new_tokens=20, num_draft_tokens=4, eos_token_id=[])
    assert out.sequences == [_hf_greedy(deep, p, 20) for p in prompts]
    assert out.stats.accepted > 0


def test_a_checkpoint_whose_taps_the_target_lacks_is_refused(deep, fused, tmp_path):
    """A fused drafter loaded onto a target with the same embedding, norm and head but fewer
    layers than its taps need: a ValueError naming the layers, not an index error."""
    shallower = tiny_model("llama", seed=4, vocab_size=64, layers=2)
    with torch.no_grad():
        for name in ("embed_tokens", "norm"):
            getattr(shallower.model, name).weight.copy_(getattr(deep.model, name).weight)
        shallower.lm_head.weight.copy_(deep.lm_head.weight)
    with pytest.raises(ValueError, match=r"decoder layers \[0, 2\].*this target has 2"):
        load_head(fused[0], shallower)
    with pytest.raises(ValueError, match="decoder layers"):
        SpeculativeEngine(shallower, [f"feature:{fused[0]}"], device="cpu")
    for bad in ([LAYERS], [], "0,1", [0.5]):  # an edited or foreign record
        (tmp_path / "drafter.safetensors").write_bytes((fused[0] / "drafter.safetensors").read_bytes())
        record = json.loads((fused[0] / "drafter.json").read_text())
        (tmp_path / "drafter.json").write_text(json.dumps({**record, "taps": bad}))
        with pytest.raises(ValueError, match="decoder layers"):
            load_head(tmp_path, deep)


def test_a_low_rank_delta_over_a_fused_drafter_trains_its_fuse_too(deep, deep_data, fused, tmp_path):
    base = load_head(fused[0], deep)
    options = TrainOptions(steps=6, batch=4, seq_len=32, lr_layers=1e-2, lr_head=1e-2, rank=2)
    head, _ = train_head("feature", deep, deep_data[:40], options, progress=False, base=base)
    out = save_drafter(head, deep, tmp_path / "delta", base=fused[0])
    from safetensors.torch import load_file

    assert {"fuse.A", "fuse.B"} <= set(load_file(str(out / "drafter.safetensors")))
    merged = load_head(out, deep)
    assert merged.taps == (0, 2)
    x = torch.randn(1, 3, 2 * deep.config.hidden_size)
    torch.testing.assert_close(merged.fuse(x), head.fuse(x), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="keeps its base's taps"):
        train_head("feature", deep, deep_data[:40], TrainOptions(steps=1, seq_len=32, taps=(1,)), progress=False,
                   base=load_head(fused[0], deep))


def test_train_drafter_with_taps(tmp_path, capsys, monkeypatch):
    """``flashspec train-drafter --taps``: alone, EAGLE-3's taps for the target's depth; with a list,
    those layers; the checkpoint records them and drafts for the engine."""
    monkeypatch.setenv("FLASHSPEC_CACHE", str(tmp_path / "cache"))
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = tiny_model("llama", seed=6, vocab_size=128, layers=LAYERS)
    model.save_pretrained(tmp_path / "target")
    tokenizer = Tokenizer(tok_models.WordLevel({chr(i): i for i in range(128)}, unk_token="?"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="?").save_pretrained(tmp_path / "target")
    text = tmp_path / "data.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(400)))
    common = ["train-drafter", "--target", str(tmp_path / "target"), "--data", str(text), "--steps", "4",
              "--batch", "2", "--seq-len", "32", "--estimate-every", "2", "--unroll", "7", "--device", "cpu"]
    for taps, expected in ((["--taps"], [0, 1]), (["--taps", "3,0"], [3, 0])):
        out = tmp_path / f"drafter{len(taps)}"
        assert main([*common, "--out", str(out), *taps]) == 0, capsys.readouterr().err
        record = json.loads((out / "drafter.json").read_text())
        assert record["taps"] == expected and record["training"]["options"]["unroll"] == 7
        from flashspec.bench.training import bench_training

        assert f"taps {','.join(map(str, expected))}" in bench_training([str(out)])
        engine = SpeculativeEngine(str(tmp_path / "target"), [f"feature:{out}"], device="cpu")
        prompt = [ord(c) for c in "def f3(x):\n"]
        assert engine.generate([prompt], max_new_tokens=8, eos_token_id=[]).sequences == [_hf_greedy(model, prompt, 8)]
    capsys.readouterr()
    for taps, message in ((["--taps", "a,b"], "comma"), (["--taps", "9"], "from 0 to 3"),
                          (["--taps", "--feature-weight", "1"], "feature-weight"),
                          (["--taps", "--kind", "shallow"], "--kind feature")):
        assert main([*common, "--out", str(tmp_path / "bad"), *taps]) == 2
        assert message in capsys.readouterr().err


# ------------------------------------------------------------------ taps=None: the drafter as before
# Recorded with the last-layer drafter before taps existed (the same head, target and requests as
# _last_layer_run): its first proposal's drafts and, sampled, each step's (accepted, committed).
BEFORE_PROPOSAL = [32, 22, 22]
BEFORE_SAMPLED_STEPS = [(0, 2), (1, 3), (3, 5), (0, 2), (0, 2), (1, 3), (2, 4), (1, 3), (1, 3), (0, 2), (1, 3),
                        (0, 2), (0, 2), (0, 2), (1, 3), (0, 2), (2, 2), (0, 1)]


def _last_layer_run(tmp_path):
    target = tiny_model("llama", seed=4, vocab_size=64)
    torch.manual_seed(3)
    head = FeatureHead(target.config, 1, width=24, heads=2, vocab=torch.arange(0, 64, 2))
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(3.0)
    save_drafter(head, target, tmp_path, storage="same")
    engine = SpeculativeEngine(target, [f"feature:{tmp_path}"], device="cpu", selector="fixed")
    sampled = engine.generate([[1, 2, 3, 4, 5], [9, 8]], max_new_tokens=24, num_draft_tokens=3, eos_token_id=[],
                              do_sample=True, temperature=0.8, seed=5)
    engine.generate([[1, 2, 3, 4, 5, 6, 7]], max_new_tokens=6, num_draft_tokens=3, eos_token_id=[])
    return engine, [(s.accepted, s.committed) for s in sampled.stats.step_log]


def test_without_taps_the_drafter_is_the_last_layer_drafter_it_was(tmp_path):
    """``taps=None`` keeps the last-layer design: no ``fuse``, the same tensors in the checkpoint,
    the last layer's features read, the same window feed to the bit (against the feed as it was
    written before taps), and the drafts recorded before taps existed."""
    engine, steps = _last_layer_run(tmp_path)
    drafter, ws = engine.drafters[0], engine._buffers
    assert drafter.head.taps is None and drafter.head.fuse is None
    assert drafter.feature_layers == (2,) and "fuse.weight" not in drafter.head.state_dict()
    assert json.loads((tmp_path / "drafter.json").read_text())["taps"] is None
    history = History(ws.tokens, ws.length, ws.active, int(ws.length.max()), ws.hidden)
    tokens, hidden, own = ws.tokens, ws.hidden[2], drafter._features
    start, width = torch.zeros(1, dtype=torch.long), int(ws.length[0])
    with torch.inference_mode():
        now = drafter._feed(tokens, drafter._hidden(history), own, start, width, None)
        index = (start[:, None] + torch.arange(width)).clamp(max=tokens.shape[1] - 1)  # the feed before taps:
        previous = hidden.gather(1, (index - 1).clamp(min=0)[..., None].expand(-1, -1, hidden.shape[-1]))
        previous = torch.where((index > 0)[..., None], previous, torch.zeros_like(previous))
        before = drafter.network(tokens.gather(1, index), previous.to(own.dtype), start, None, {1: own})
    assert torch.equal(now, before)
    drafter._seen.forget()
    draft = drafter.propose(history, 3, SamplingParams(do_sample=True, temperature=0.9),
                            torch.full((1, 3), 0.37, dtype=torch.float64))
    assert draft.tokens.tolist() == [BEFORE_PROPOSAL]
    assert steps == BEFORE_SAMPLED_STEPS


def test_rows_joining_a_running_batch_equal_generate(deep, tmp_path):
    """A joining row is fed alone (``prefill_row``) from every tapped layer's features (SPEC.md
    §12): each row of a running batch is token for token its own ``generate``."""
    save_drafter(_head(deep, (0, 2), seed=2), deep, tmp_path)
    engine = SpeculativeEngine(deep, [f"feature:{tmp_path}"], device="cpu")
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6, 5, 3], [5, 8], [9, 7, 9, 3]]
    expected = [_hf_greedy(deep, p, 12) for p in prompts]
    got, names, pending = {}, {}, list(range(len(prompts)))
    with engine.batch(slots=2, max_length=64, num_draft_tokens=3, eos_token_id=[]) as batch:
        while pending or batch.running:
            if pending and batch.free_slots:
                i = pending.pop(0)
                names[batch.add(prompts[i], max_new_tokens=12)] = i
                got[i] = []
            for update in batch.step():
                got[names[update.handle]] += update.tokens
    assert [got[i] for i in range(len(prompts))] == expected


def test_compiled_proposals_of_a_fused_drafter_draft_what_eager_ones_draft(deep, fused):
    """compile=True compiles the window feed (the taps' gathers and ``fuse`` with it) and the
    one-token steps: the same output and the same acceptance, greedy and sampled."""
    engines = [SpeculativeEngine(deep, [f"feature:{fused[0]}"], device="cpu", compile=c) for c in (False, True)]
    for sampling in ({}, dict(do_sample=True, temperature=0.8, seed=1)):
        out = [e.generate([[1, 2, 3, 4, 5, 6], [7, 8, 9]], max_new_tokens=12, num_draft_tokens=3, eos_token_id=[],
                          **sampling) for e in engines]
        assert out[0].sequences == out[1].sequences
        assert out[0].stats.accepted == out[1].stats.accepted > 0
