"""The trained drafters made from the target (SPEC.md §11), feature (EAGLE family) and shallow,
and their training: they share the target's tensors; their output is the target's, greedy and
sampled (also tests/test_greedy.py, tests/test_distribution.py); their catch-up windows lose
nothing; checkpoints refuse the wrong target; ``flashspec train-drafter`` trains and saves one
that loads as ``feature:DIR`` / ``shallow:DIR``."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashspec import FeatureDrafter, FeatureHead, ShallowDrafter, ShallowHead, SpeculativeEngine
from flashspec.cli import main
from flashspec.train import TrainOptions, load_feature_head, load_head, save_drafter, train_feature_head, train_head
from tiny_models import tiny_model

ARCHS = ("llama", "qwen2", "mistral")


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=4, vocab_size=64)


@pytest.fixture(scope="module")
def self_generated(target):
    """Sequences the target itself wrote (sampled at T = 1): data a drafter can learn."""
    engine = SpeculativeEngine(target, [], device="cpu")
    prompts = [[(7 * i + j) % 64 for j in range(3)] for i in range(48)]
    out = engine.generate(prompts, max_new_tokens=29, do_sample=True, temperature=1.0, eos_token_id=[], seed=0)
    return torch.tensor([p + s for p, s in zip(prompts, out.sequences)])


@pytest.fixture(scope="module")
def trained(target, self_generated, tmp_path_factory):
    options = TrainOptions(steps=120, batch=8, seq_len=32, lr_layers=3e-3, lr_head=3e-3, estimate_every=60)
    head, log = train_feature_head(target, self_generated[:40], options, estimate=self_generated[40:], progress=False)
    folder = tmp_path_factory.mktemp("feature")
    save_drafter(head, target, folder, log)
    return folder, log


@pytest.fixture(scope="module")
def shallow(target, self_generated, tmp_path_factory):
    options = TrainOptions(layers=1, shared_layers=1, steps=120, batch=8, seq_len=32, lr_layers=3e-3, lr_head=3e-3,
                           estimate_every=60)
    head, log = train_head("shallow", target, self_generated[:40], options, estimate=self_generated[40:],
                           progress=False)
    folder = tmp_path_factory.mktemp("shallow")
    save_drafter(head, target, folder, log)
    return folder, log


def _reference(model, prompts, n):
    return SpeculativeEngine(model, [], device="cpu").generate(prompts, max_new_tokens=n, eos_token_id=[]).sequences


def test_it_shares_the_targets_embedding_norm_and_head(target, trained):
    engine = SpeculativeEngine(target, [f"feature:{trained[0]}"], device="cpu")
    drafter = engine.drafters[0]
    assert isinstance(drafter, FeatureDrafter)
    draft_model = drafter.lm.model
    assert draft_model.model.embed_tokens is target.model.embed_tokens
    assert draft_model.model.norm is target.model.norm and draft_model.lm_head is target.lm_head
    target_storages = {p.untyped_storage().data_ptr() for p in target.parameters()}
    own = {p.untyped_storage().data_ptr() for p in drafter.head.parameters()}
    assert not own & target_storages  # its own part is its own...
    shared = {p.untyped_storage().data_ptr() for p in draft_model.parameters()} - own
    assert shared <= target_storages  # ...and everything else is the target's, not a copy


def test_training_lowers_the_loss_and_raises_acceptance(target, self_generated, trained):
    _, log = trained
    untrained = train_feature_head(target, self_generated[:40], TrainOptions(steps=1, batch=8, seq_len=32),
                                   estimate=self_generated[40:], progress=False)[1]
    assert log["loss"][-1] < log["loss"][0]
    assert log["estimates"][-1]["alpha1"] > untrained["estimates"][-1]["alpha1"] + 0.05
    assert log["tokens"] == 120 * 8 * 32 and log["seconds"] > 0


@pytest.mark.parametrize("kind", ["feature", "shallow"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_output_is_the_targets(kind, arch, gamma, tmp_path):
    model = tiny_model(arch, seed=5)
    torch.manual_seed(0)
    head = FeatureHead(model.config, 1) if kind == "feature" else ShallowHead(model.config, 1, 1)
    save_drafter(head, model, tmp_path)  # untrained: mostly rejected
    prompts = [[3, 4, 5, 3, 4, 5, 3], [9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    engine = SpeculativeEngine(model, [f"{kind}:{tmp_path}", "ngram"], gammas=[gamma], selector="ucb1",
                               selector_options={"seed": 0}, device="cpu")
    for _ in range(2):  # the second request reuses the buffers
        assert engine.generate(prompts, max_new_tokens=20, eos_token_id=[]).sequences == _reference(model, prompts, 20)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(gamma=st.integers(1, 5), batch=st.integers(1, 3), new_tokens=st.integers(1, 24), kind=st.sampled_from([0, 1]))
def test_trained_drafter_greedy_output_is_the_targets(target, trained, shallow, gamma, batch, new_tokens, kind):
    prompts = [[(5 * b + i) % 64 for i in range(2 + 3 * b)] for b in range(batch)]
    spec = f"feature:{trained[0]}" if kind == 0 else f"shallow:{shallow[0]}"
    engine = SpeculativeEngine(target, [spec], device="cpu")
    out = engine.generate(prompts, max_new_tokens=new_tokens, num_draft_tokens=gamma, eos_token_id=[])
    assert out.sequences == _reference(target, prompts, new_tokens)


@pytest.mark.parametrize("kind", ["feature", "shallow"])
def test_the_catch_up_window_loses_nothing(target, trained, shallow, kind, monkeypatch):
    """Feeding only the positions whose true features the drafter has not seen proposes exactly
    what re-feeding the whole history would: the same drafts accepted at every step."""
    prompts = [[1, 2, 3, 4], [8, 9], [5, 5, 5, 5, 5, 5]]
    folder = (trained if kind == "feature" else shallow)[0]

    def run():
        engine = SpeculativeEngine(target, [f"{kind}:{folder}"], device="cpu")
        out = engine.generate(prompts, max_new_tokens=30, num_draft_tokens=3, eos_token_id=[])
        return out.sequences, [(r.accepted, r.committed) for r in out.stats.step_log]

    windowed = run()
    cls = FeatureDrafter if kind == "feature" else ShallowDrafter
    monkeypatch.setattr(cls, "_window", lambda self, history: history.length_bound())
    full = run()
    assert windowed == full
    assert sum(a for a, _ in windowed[1]) > 0  # drafts were accepted, so the catch-up was exercised


def test_a_checkpoint_refuses_another_target(trained):
    other = tiny_model("llama", seed=99, vocab_size=64)
    with pytest.raises(ValueError, match="trained for another target"):
        SpeculativeEngine(other, [f"feature:{trained[0]}"], device="cpu")
    qwen = tiny_model("qwen2", seed=4, vocab_size=64)
    with pytest.raises(ValueError, match="another target"):
        load_feature_head(trained[0], qwen)


def test_broken_checkpoints_are_clear_errors(target, trained, tmp_path):
    with pytest.raises(ValueError, match="not a drafter checkpoint"):
        load_feature_head(tmp_path, target)
    (tmp_path / "drafter.json").write_text((trained[0] / "drafter.json").read_text())
    (tmp_path / "drafter.safetensors").write_bytes((trained[0] / "drafter.safetensors").read_bytes()[:100])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_feature_head(tmp_path, target)
    record = json.loads((trained[0] / "drafter.json").read_text())
    assert record["kind"] == "feature" and record["target"]["shared_sha256"]


def test_shallow_training_and_its_checkpoint(target, shallow):
    folder, log = shallow
    assert log["loss"][-1] < log["loss"][0] and log["estimates"][-1]["alpha1"] > 0
    head = load_head(folder, target, "shallow")
    assert isinstance(head, ShallowHead) and head.shared_layers == 1
    engine = SpeculativeEngine(target, [f"shallow:{folder}"], device="cpu")
    drafter = engine.drafters[0]
    assert drafter.target is engine._target_lm  # the shared layers run on the target's own cache
    assert drafter.lm.model.lm_head.lm_head is target.lm_head and drafter.lm.model.model.norm is target.model.norm
    changed = tiny_model("llama", seed=4, vocab_size=64)  # the same embedding, norm and head ...
    with torch.no_grad():
        changed.model.layers[0].mlp.down_proj.weight.add_(0.01)  # ... but a shared layer differs
    with pytest.raises(ValueError, match="shared weights differ"):
        load_head(folder, changed)
    with pytest.raises(ValueError, match="expected feature"):
        load_head(folder, target, "feature")


@pytest.mark.parametrize("shared", [0, 2, 3])
def test_shallow_shared_layers_are_checked(target, shared):
    with pytest.raises(ValueError, match="shared_layers"):
        ShallowHead(target.config, shared)


def test_targets_without_the_static_cache_are_refused(trained):
    with pytest.raises(ValueError, match="static cache"):
        SpeculativeEngine(tiny_model("gpt2", seed=0), [f"feature:{trained[0]}"], device="cpu")


@pytest.mark.parametrize("options, message", [
    (dict(steps=0), "steps"), (dict(batch=-1), "batch"), (dict(lr_head=0.0), "lr_head"),
    (dict(lr_layers=2.0), "lr_layers"), (dict(layers=True), "layers"), (dict(hard_labels="yes"), "hard_labels"),
])
def test_bad_training_options(options, message):
    with pytest.raises(ValueError, match=message):
        TrainOptions(**options)


@pytest.mark.parametrize("kind", ["feature", "shallow"])
def test_train_drafter_command_trains_saves_and_the_engine_loads_it(kind, tmp_path, capsys):
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = tiny_model("llama", seed=6, vocab_size=128)
    model.save_pretrained(tmp_path / "target")
    tokenizer = Tokenizer(tok_models.WordLevel({chr(i): i for i in range(128)}, unk_token="?"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="?").save_pretrained(tmp_path / "target")
    text = tmp_path / "data.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(400)))
    rc = main(["train-drafter", "--kind", kind, "--target", str(tmp_path / "target"), "--data", str(text), "--out",
               str(tmp_path / "drafter"), "--steps", "6", "--batch", "2", "--seq-len", "32", "--estimate-every", "3",
               "--device", "cpu"])
    assert rc == 0, capsys.readouterr().err
    assert f"{kind}:" in capsys.readouterr().out
    record = json.loads((tmp_path / "drafter" / "drafter.json").read_text())
    assert record["kind"] == kind
    assert len(record["training"]["loss"]) == 6 and len(record["training"]["estimates"]) == 2
    engine = SpeculativeEngine(str(tmp_path / "target"), [f"{kind}:{tmp_path / 'drafter'}"], device="cpu")
    prompt = [[ord(c) for c in "def f3(x):\n"]]
    assert engine.generate(prompt, max_new_tokens=10, eos_token_id=[]).sequences == _reference(model, prompt, 10)
    assert main(["train-drafter", "--target", str(tmp_path / "target"), "--data", str(tmp_path / "nope.txt"),
                 "--out", str(tmp_path / "x"), "--device", "cpu"]) == 2
    assert "does not exist" in capsys.readouterr().err
