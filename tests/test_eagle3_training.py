"""Training heads in EAGLE-3's layout (SPEC.md §11.9, "Training a head in EAGLE-3's layout").

``flashspec train-drafter --layout eagle3`` trains an :class:`Eagle3Head` with the feature
drafter's loop and saves it as an EAGLE-layout checkpoint: here a tiny target (8 layers, taps
1, 3, 4) trains one; the loss falls, ``α₁`` rises, it loads as ``"eagle3:DIR"`` and greedy output
is the target's; each unrolled pass is the drafter's own draft at that depth; masked positions
get no gradient; exports to both layouts draft the same, and the speculators layout carries the
target's embedding, which speculators' loader reads from it; a resumed run continues the schedule;
bad options are clear errors.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model

import flashspec.training.train as train
from flashspec import SpeculativeEngine
from flashspec.cli import main
from flashspec.drafters.checkpoint import load_head, save_drafter
from flashspec.drafters.eagle3 import Eagle3Drafter, Eagle3Head
from flashspec.drafters.eagle3_formats import load_eagle3_head, read_eagle3
from flashspec.drafters.feature import FeatureHead, tapped_layers
from flashspec.models.static import StaticLM
from flashspec.training.eagle3_head import new_eagle3_head, save_eagle3_head
from flashspec.training.schedule import FLOOR, REWARM
from flashspec.training.train import TrainOptions, _features_and_logits, _loss, _weights, train_head

LAYERS = 8  # EAGLE-3's default taps 1, 3, 4 (outputs; vLLM's ids 2, 4, 5)
VOCAB = 128
STEPS, TOTAL = 60, 64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _char(i: int) -> str:
    """Token ``i``'s character: a letter (Latin Extended-A), and the newline for 10."""
    return "\n" if i == 10 else chr(0x100 + i)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A saved tiny target with a tokenizer of one character per token, text the target itself
    wrote (sampled at T = 1: data a head can learn), and the command line's flags."""
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tmp = tmp_path_factory.mktemp("eagle3-training")
    model = tiny_model("llama", seed=6, vocab_size=VOCAB, layers=LAYERS)
    model.save_pretrained(tmp / "target")
    tokenizer = Tokenizer(tok_models.WordLevel({_char(i): i for i in range(VOCAB)}, unk_token=_char(0)))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=_char(0)).save_pretrained(tmp / "target")
    prompts = [[(7 * i + j) % VOCAB for j in range(3)] for i in range(240)]
    out = SpeculativeEngine(model, [], device="cpu").generate(prompts, max_new_tokens=45, do_sample=True,
                                                              temperature=1.0, eos_token_id=[], seed=0)
    text = tmp / "data.txt"
    text.write_text("\n".join("".join(map(_char, p + s)) for p, s in zip(prompts, out.sequences)) + "\n")
    common = ["train-drafter", "--target", str(tmp / "target"), "--data", str(text), "--batch", "8",
              "--seq-len", "32", "--device", "cpu", "--layout", "eagle3"]
    return model, tmp, common


def _run(setup, *flags):
    _, tmp, common = setup
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLASHSPEC_CACHE", str(tmp / "cache"))
        return main([*common, *flags])


@pytest.fixture(scope="module")
def trained(setup):
    """A head trained by the command line: a draft vocabulary of 64 tokens, 60 of a 64-step schedule."""
    out = setup[1] / "head"
    assert _run(setup, "--out", str(out), "--steps", str(STEPS), "--total-steps", str(TOTAL), "--draft-vocab", "64",
                "--lr-layers", "1e-2", "--lr-head", "1e-2", "--estimate-every", "30") == 0
    return out


def test_training_learns_and_the_head_decodes_the_targets_output(setup, trained):
    model, tmp, _ = setup
    record = json.loads((trained / "drafter.json").read_text())
    log = record["training"]
    assert record["kind"] == "eagle3" and record["taps"] == [1, 3, 4] and record["draft_vocab"] == 64
    assert sum(log["loss"][-10:]) / 10 < sum(log["loss"][:10]) / 10 - 0.1  # the loss falls
    assert log["estimates"][-1]["alpha1"] > log["estimates"][0]["alpha1"] + 0.04  # and α₁ rises
    assert log["alpha_saved"][0] == pytest.approx(log["estimates"][-1]["alpha1"], abs=0.02)  # as saved
    config = json.loads((trained / "config.json").read_text())  # the EAGLE layout, as vLLM and SGLang read it
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 64
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM's numbering: layer inputs
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang's: layer outputs
    assert config["rope_theta"] == model.config.rope_parameters["rope_theta"]  # transformers 4 readers too
    ckpt = read_eagle3(trained)
    assert "embed_tokens.weight" not in ckpt.tensors  # the target's, shared
    assert ckpt.tensors["fc.weight"].shape == (32, 3 * 32) and ckpt.tensors["lm_head.weight"].shape == (64, 32)
    engine = SpeculativeEngine(str(tmp / "target"), [f"eagle3:{trained}"], device="cpu", selector="fixed")
    assert isinstance(engine.drafters[0], Eagle3Drafter)
    prompts = [[ord(c) for c in "def f3(x):\n"], [ord(c) for c in "def f12"]]
    for gamma in (1, 4):
        out = engine.generate(prompts, max_new_tokens=16, num_draft_tokens=gamma, eos_token_id=[])
        assert out.sequences == [_hf_greedy(model, p, 16) for p in prompts]
        assert out.stats.accepted > 0
    from flashspec.bench.training import bench_training

    assert "EAGLE-3 layer" in bench_training([str(trained)])


def test_unrolled_passes_are_the_drafters_drafts_at_each_depth():
    """Pass j at position t of training equals the drafter's j-th draft of a chain begun at
    t − j + 1: its window feed over the true features, then j − 1 one-token steps, each fed its
    own output (the true tokens in place of drafts); with a draft vocabulary."""
    model = tiny_model("qwen2", seed=2, vocab_size=64, layers=4)
    torch.manual_seed(3)
    head = new_eagle3_head(model, TrainOptions(taps=(0, 2, 3), width=24, heads=2), torch.arange(0, 64, 2))
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(3.0)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    layers = tapped_layers(head.taps, 4)
    drafter = Eagle3Drafter(StaticLM(model), head)
    capacity, hidden = 16, model.config.hidden_size
    with torch.no_grad():
        features, _ = _features_and_logits(model, ids, layers)
        logits, _ = train._passes(head, None, model, ids, features, 3)
        tokens = torch.zeros(2, capacity, dtype=torch.long)
        tokens[:, :12] = ids
        # the engine's History.hidden[n] of each tap: the output of the first n layers, before the final norm
        true = tuple(torch.zeros(2, capacity, hidden).index_copy(1, torch.arange(12), f) for f in features.chunk(3, -1))
        drafter.lm.reset(2, capacity)
        drafter._features = torch.zeros(2, capacity, hidden)
        zero = torch.zeros(2, dtype=torch.long)
        for depth in (1, 2, 3):
            for t in range(depth - 1, 12):
                start = t - depth + 1  # the chain's first position, fed the true features
                got = drafter._feed(tokens, true, drafter._features, zero, start + 1,
                                    torch.full((2, 1), start))[:, 0]
                for position in range(start + 1, t + 1):
                    got = drafter._next(ids[:, position], torch.full((2,), position))
                torch.testing.assert_close(logits[depth - 1][:, t], got, rtol=1e-4, atol=1e-4)


def test_masked_positions_get_no_gradient(monkeypatch):
    """The loss mask (§11.7) holds for EAGLE-3 heads: no gradient flows from a masked position's
    logits, nor from position 0 (the pair the drafter never drafts from); every other counted one learns."""
    target = tiny_model("llama", seed=2, vocab_size=64, layers=4)
    torch.manual_seed(0)
    head = new_eagle3_head(target, TrainOptions(taps=(0, 1, 3)))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, :5] = False  # a prompt of 5 tokens, then the answer
    mask[1, 8:] = False  # the answer ends at 8: the rest is padding
    features, logits = _features_and_logits(target, ids, tapped_layers(head.taps, 4))
    kept: list[torch.Tensor] = []
    passes = train._passes

    def keeping(*args):
        out = passes(*args)
        for t in out[0]:
            t.retain_grad()
            kept.append(t)
        return out

    monkeypatch.setattr(train, "_passes", keeping)
    weights = _weights(mask, ids)
    loss = _loss(head, None, target, ids, features, logits, TrainOptions(unroll=3, seq_len=12), weights)
    loss.backward()
    counted = weights.bool()
    counted[:, 0] = False
    for j, values in enumerate(kept):
        grads = values.grad.abs().sum(-1)
        assert bool((grads[~counted] == 0).all())
        assert bool((grads[:, j:-1][counted[:, j:-1]] > 0).all())
    assert all(p.grad is not None for p in head.lm_head.parameters())  # lm_head trains, the embedding is the target's
    assert target.model.embed_tokens.weight.grad is None


def test_a_masked_run_scores_answers_only_and_its_draft_vocabulary_holds_them():
    """Chunks with a loss mask (a distilled folder's, SPEC.md §11.7): the head's draft vocabulary
    counts answer tokens only, and the loss scores the positions that predict them."""
    target = tiny_model("llama", seed=2, vocab_size=64, layers=4)
    chunks = torch.randint(0, 60, (16, 12), generator=torch.Generator().manual_seed(2))
    chunks[:, :6] = 63  # prompts of one token the head never drafts
    mask = torch.zeros_like(chunks, dtype=torch.bool)
    mask[:, 6:] = True
    options = TrainOptions(steps=3, batch=4, seq_len=12, draft_vocab=8, estimate_every=3, taps=(0, 1, 3))
    head, log = train_head("eagle3", target, chunks, options, estimate=chunks[:4], progress=False, mask=mask,
                           estimate_mask=mask[:4])
    assert isinstance(head, Eagle3Head) and 63 not in head.lm_head.vocab.tolist() and len(head.lm_head.vocab) == 8
    assert log["tokens"] == 3 * 4 * 12 and log["target_tokens"] == 3 * 4 * 6  # positions 5 … 10 predict 6 … 11


def test_exports_to_both_layouts_draft_the_same(setup, trained):
    """export-drafter writes a trained head in the speculators layout (its verifier from the
    training record) and back in the EAGLE layout: the same tensors, the same drafts."""
    model, tmp, _ = setup
    spec, back = tmp / "export" / "speculators", tmp / "export" / "eagle3"
    assert main(["export-drafter", str(trained), "--to", "speculators", "--out", str(spec)]) == 0
    assert main(["export-drafter", str(spec), "--to", "eagle3", "--out", str(back)]) == 0
    verifier = json.loads((spec / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(tmp / "target"), "architectures": ["LlamaForCausalLM"]}
    first, again = read_eagle3(trained), read_eagle3(back)
    assert again.tensors.keys() == first.tensors.keys() | {"embed_tokens.weight"}  # the target's, from the export
    assert all(torch.equal(first.tensors[k], again.tensors[k]) for k in first.tensors)
    outputs = []
    prompts = [[ord(c) for c in "def f7(x):\n    re"]]
    for folder in (trained, spec, back):
        engine = SpeculativeEngine(model, [f"eagle3:{folder}"], device="cpu", selector="fixed")
        out = engine.generate(prompts, max_new_tokens=12, num_draft_tokens=3, eos_token_id=[], do_sample=True,
                              temperature=0.8, seed=3)
        outputs.append((out.sequences, [(s.accepted, s.committed) for s in out.stats.step_log]))
    assert outputs[0] == outputs[1] == outputs[2] and outputs[0][1]


def test_a_speculators_export_carries_the_targets_embedding(setup, trained, tmp_path):
    """The head shares the target's embedding and its EAGLE-layout folder holds none; its export to
    the speculators layout carries the verifier's, read from the verifier's weights, since
    speculators' Eagle3DraftModel takes the embedding from the checkpoint (without one it keeps
    the uninitialised memory transformers materialises a missing weight in). A verifier whose
    weights cannot give it, or give another target's, is refused and nothing is written."""
    model, tmp, _ = setup
    assert "embed_tokens.weight" not in read_eagle3(trained).tensors
    out = tmp_path / "speculators"
    assert main(["export-drafter", str(trained), "--to", "speculators", "--out", str(out)]) == 0
    embed = read_eagle3(out).tensors["embed_tokens.weight"]
    assert torch.equal(embed, model.model.embed_tokens.weight.detach())
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    (weightless / "config.json").write_text((tmp / "target" / "config.json").read_text())
    other = tmp_path / "other"
    tiny_model("llama", seed=1, vocab_size=2 * VOCAB, layers=LAYERS).save_pretrained(other)
    for verifier in (weightless, other):
        folder = tmp_path / f"not-{verifier.name}"
        assert main(["export-drafter", str(trained), "--to", "speculators", "--out", str(folder),
                     "--verifier", str(verifier)]) == 2
        assert not folder.exists()


def test_an_export_loads_in_speculators_and_computes_the_same_logits(setup, trained):
    """speculators' own Eagle3DraftModel loads the trained head exported to its layout, and its
    first draft step's logits are the drafter's (skipped where speculators does not import)."""
    speculators = pytest.importorskip("speculators.models.eagle3")
    model, tmp, _ = setup
    out = tmp / "for-speculators"
    assert main(["export-drafter", str(trained), "--to", "speculators", "--out", str(out)]) == 0
    config = speculators.Eagle3SpeculatorConfig.from_pretrained(str(out))
    config.transformer_layer_config._attn_implementation = "eager"
    reader = speculators.Eagle3DraftModel.from_pretrained(str(out), config=config).eval()
    assert list(reader.config.eagle_aux_hidden_state_layer_ids) == [2, 4, 5]
    assert torch.equal(reader.embed_tokens.weight, model.model.embed_tokens.weight)  # the export's copy
    ids = torch.tensor([[ord(c) for c in "def f9(x):\n"]])
    T, h = ids.shape[1] - 1, model.config.hidden_size
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
        seen = []
        reader.lm_head.register_forward_hook(lambda module, args, output: seen.append(output))
        reader(torch.cat([states[2], states[4], states[5]], -1)[:, :T], ids[:, 1:],
               document_ids=torch.zeros(1, T, dtype=torch.long), ttt_steps=1)
        drafter = Eagle3Drafter(StaticLM(model), load_eagle3_head(out, model))
        drafter.lm.reset(1, 16)
        drafter._features = torch.zeros(1, 16, h)
        tokens = torch.zeros(1, 16, dtype=torch.long)
        tokens[:, : T + 1] = ids
        hidden = tuple(torch.zeros(1, 16, h).index_copy(1, torch.arange(T + 1), states[n])
                       for n in drafter.feature_layers)
        ours = drafter._feed(tokens, hidden, drafter._features, torch.zeros(1, dtype=torch.long), T + 1,
                             torch.arange(1, T + 1)[None])[0]
    torch.testing.assert_close(ours, seen[0][0], atol=1e-4, rtol=1e-4)


def test_a_resumed_run_continues_the_schedule(setup, trained):
    tmp = setup[1]
    assert _run(setup, "--out", str(tmp / "resumed"), "--steps", "4", "--resume", str(trained),
                "--estimate-every", "100") == 0
    first = json.loads((trained / "drafter.json").read_text())["training"]
    second = json.loads((tmp / "resumed" / "drafter.json").read_text())
    log = second["training"]
    assert first["schedule"] == {"total_steps": TOTAL, "position": STEPS}
    assert log["schedule"] == {"total_steps": TOTAL, "position": TOTAL}
    assert log["options"]["start_step"] == STEPS and log["before"]["steps"] == STEPS
    assert log["before"]["sha256"] == hashlib.sha256((trained / "model.safetensors").read_bytes()).hexdigest()
    assert log["lr_fraction"] == pytest.approx(FLOOR * 5 / REWARM)  # annealed, re-warming
    assert sum(log["loss"]) / 4 < sum(first["loss"][:4]) / 4 - 0.1  # it starts from the trained head, not afresh
    assert second["kind"] == "eagle3" and second["taps"] == [1, 3, 4] and second["draft_vocab"] == 64
    assert _run(setup, "--out", str(tmp / "based"), "--steps", "2", "--base", str(trained), "--estimate-every",
                "100") == 0  # --base: the head trained further on a schedule of its own, its taps kept
    based = json.loads((tmp / "based" / "drafter.json").read_text())
    assert based["taps"] == [1, 3, 4] and based["training"]["schedule"] == {"total_steps": 2, "position": 2}
    assert based["training"]["before"]["steps"] == STEPS


def test_bad_options_are_clear_errors(setup, trained, capsys):
    model, tmp, _ = setup
    feature = tmp / "feature"
    save_drafter(FeatureHead(model.config, 1), model, feature)
    for flags, message in (
        (["--kind", "shallow"], "--kind feature"),
        (["--taps", "1,2"], "three"),
        (["--taps", "1,2,3,4"], "three"),
        (["--taps", "1,1,2"], "distinct"),
        (["--layers", "2"], "one decoder layer"),
        (["--storage", "int8"], "--storage"),
        (["--feature-weight", "1"], "feature-weight"),
        (["--taps", "--fuse-rank", "8"], "leave --fuse-rank out"),
        (["--base", str(trained), "--rank", "2"], "low-rank"),
        (["--base", str(feature)], "--layout eagle3"),
        (["--resume", str(feature)], "--layout eagle3"),
    ):
        capsys.readouterr()
        assert _run(setup, "--out", str(tmp / "bad"), "--steps", "1", *flags) == 2, flags
        assert message in capsys.readouterr().err, flags
    chunks = torch.zeros(4, 8, dtype=torch.long)
    for options, message in ((TrainOptions(steps=1, seq_len=8, taps=(0, 1)), "three"),
                             (TrainOptions(steps=1, seq_len=8, layers=2), "one decoder layer"),
                             (TrainOptions(steps=1, seq_len=8, feature_weight=1.0), "feature_weight")):
        with pytest.raises(ValueError, match=message):
            train_head("eagle3", model, chunks, options, progress=False)
    shallow = tiny_model("llama", seed=6, vocab_size=VOCAB, layers=4)
    with pytest.raises(ValueError, match="--taps"):  # its default taps are fewer than three layers
        new_eagle3_head(shallow, TrainOptions())
    with pytest.raises(ValueError, match="eagle3:DIR"):
        load_head(trained, model, "feature")


def test_a_head_for_another_target_is_refused(setup, trained, tmp_path):
    """Sizes alike, weights not: the training record's checksum of the shared tensors refuses it."""
    other = tiny_model("llama", seed=7, vocab_size=VOCAB, layers=LAYERS)
    with pytest.raises(ValueError, match="shared weights differ"):
        load_eagle3_head(trained, other)
    head = load_eagle3_head(trained, setup[0])
    assert isinstance(head, Eagle3Head) and head.taps == (1, 3, 4)
    save_eagle3_head(head, setup[0], tmp_path / "again")  # the same tensors saved again
    again = read_eagle3(tmp_path / "again")
    assert all(torch.equal(t, read_eagle3(trained).tensors[k]) for k, t in again.tensors.items())
    assert Path(tmp_path / "again" / "drafter.json").is_file()
