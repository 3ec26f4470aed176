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
from flashspec.drafters.checkpoint import load_feature_head, load_head, save_drafter
from flashspec.training.schedule import FLOOR
from flashspec.training.train import TrainOptions, train_feature_head, train_head
from flashspec.drafters.feature import window_widths
from flashspec.models.graphs import Graphs
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
    options = TrainOptions(steps=120, batch=8, seq_len=32, lr_layers=1e-2, lr_head=1e-2, estimate_every=60)
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
    assert log["lr_fraction"] == pytest.approx(FLOOR)  # warm-up, then a cosine that ends at the floor


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


def test_compiled_proposals_draft_what_eager_ones_draft_and_compile_once_per_width(target, trained):
    """compile=True compiles the window feed and the one-token steps (SPEC.md §11.5): the same
    drafts (the same output and acceptance, greedy and sampled), and a request with new sampling
    parameters compiles nothing more (the draws between the compiled parts stay eager)."""
    from torch._dynamo.utils import counters

    folder, _ = trained
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    engines = [SpeculativeEngine(target, [f"feature:{folder}"], device="cpu", compile=c) for c in (False, True)]
    assert [e.drafters[0].compiled for e in engines] == [False, True]
    for i, sampling in enumerate([{}, dict(do_sample=True, temperature=0.7, seed=1),
                                  dict(do_sample=True, temperature=0.9, top_p=0.8, top_k=9, seed=2)]):
        graphs = counters["stats"]["unique_graphs"]
        out = [e.generate(prompts, max_new_tokens=16, num_draft_tokens=3, eos_token_id=[], **sampling)
               for e in engines]
        assert out[0].sequences == out[1].sequences
        assert out[0].stats.accepted == out[1].stats.accepted > 0
        if i:
            assert counters["stats"]["unique_graphs"] == graphs


def test_the_first_compiled_proposal_compiles_every_window_width(target, trained):
    """A later proposal's catch-up window (4, 8 or 16 positions) never compiles inside a request:
    the first compiled proposal of a shape compiled them all (SPEC.md §11, compiled proposals)."""
    from torch._dynamo.utils import counters

    from flashspec.drafters import History
    from flashspec.sampling import SamplingParams

    folder, _ = trained
    engine = SpeculativeEngine(target, [f"feature:{folder}"], device="cpu", compile=True)
    engine.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]], max_new_tokens=8,
                    num_draft_tokens=4, eos_token_id=[])
    drafter, ws = engine.drafters[0], engine._buffers
    history = History(ws.tokens, ws.length, ws.active, int(ws.length.max()), ws.hidden)
    graphs = counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        for window in (4, 16, 8):
            tokens, _ = drafter._draft(history, window, 4, SamplingParams(), torch.rand(1, 4, dtype=torch.float64))
            assert tokens.shape == (1, 4)
    assert counters["stats"]["unique_graphs"] == graphs


class _CapturingGraphs(Graphs):
    """CUDA graphs as the drafters meet them, on the CPU: a key's first ``run`` is its capture
    (``captured`` records when: which proposal of the request), later runs replay it (here: run
    the function again, which reads the same buffers)."""

    def __init__(self) -> None:
        super().__init__(enabled=False)
        self.enabled = True
        self.captured: dict = {}
        self.proposal = 0

    def __contains__(self, key) -> bool:
        return key in self.captured

    def run(self, key, fn, warm=False):
        new = key not in self.captured
        self.captured.setdefault(key, self.proposal)
        result = fn()
        if warm and new:  # the warming replay right after a capture runs it once more
            fn()
        return result

    def clear(self) -> None:
        self.captured.clear()


@pytest.mark.parametrize("kind", ["feature", "shallow", "model"])
@pytest.mark.parametrize("do_sample", [False, True])
def test_capturing_every_window_width_first_changes_no_draft(target, trained, shallow, kind, do_sample):
    """SPEC.md §4, §11, "Every proposal is a graph": the first proposal captures the graphs of
    every window width (for its γ and sampling parameters), so a catch-up after a gap of any
    length replays one and no proposal later in the request captures anything; and those
    captures, which feed committed positions and draft from the step's uniforms, change no
    draft: the same tokens and the same acceptance at every step as without them, greedy and
    sampled (for the model drafter, whose windows with graphs pass the rows' ends, against
    the same drafter without graphs, whose windows stop at the bound)."""
    from flashspec.select.fixed import ScriptedSelector

    spec = {"feature": f"feature:{trained[0]}", "shallow": f"shallow:{shallow[0]}",
            "model": tiny_model("llama", seed=7, vocab_size=64)}[kind]
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [5, 5, 5, 5, 5]]
    # The drafter's arm, then target-only gaps of 1 … 40 steps: windows of 4 … 64 positions.
    script = [0] + [a for gap in (1, 3, 9, 20, 40) for a in [1] * gap + [0]]
    sampling = dict(do_sample=True, temperature=0.8, top_k=20, seed=3) if do_sample else {}

    def run(graphs):
        engine = SpeculativeEngine(target, [spec], gammas=[3], target_only=True, slack=None, device="cpu")
        engine.selection = engine.new_selection(ScriptedSelector(2, script))
        drafter = engine.drafters[0]
        if graphs is not None:
            drafter._graphs = graphs
            propose = drafter.propose

            def counted(*args, **kwargs):
                graphs.proposal += 1
                return propose(*args, **kwargs)
            drafter.propose = counted
        out = engine.generate(prompts, max_new_tokens=120, eos_token_id=[], **sampling)
        return out.sequences, [(r.arm, r.accepted, r.committed) for r in out.stats.step_log], engine

    graphs = _CapturingGraphs()
    captured, plain = run(graphs), run(None)
    assert captured[:2] == plain[:2]
    assert sum(a for _, a, _ in plain[1] if a) > 0  # drafts were accepted
    capacity = captured[2]._buffers.tokens.shape[1]
    params = {key[2] for key in graphs.captured}
    widths = captured[2].drafters[0].widths(capacity)
    assert widths == ([2] + window_widths(capacity, 16) if kind == "model" else window_widths(capacity))
    assert len(params) == 1 and {key[:2] for key in graphs.captured} == {(w, 3) for w in widths}
    assert set(graphs.captured.values()) == {1}  # all at the request's first proposal
    assert graphs.proposal == sum(1 for arm, _, _ in captured[1] if arm != "target@0") > 6


def test_proposals_run_in_inference_mode_even_outside_generate(target, trained):
    """A compiled proposal traced with autograd on would need a backward for the decode kernels,
    which have none (seen on the H200 when a step ran outside generate): propose runs in
    inference mode whoever calls it."""
    from flashspec.drafters import History
    from flashspec.sampling import SamplingParams

    folder, _ = trained
    engine = SpeculativeEngine(target, [f"feature:{folder}"], device="cpu", compile=True)
    engine.generate([[1, 2, 3, 4]], max_new_tokens=4, eos_token_id=[])  # fills its features
    drafter, ws = engine.drafters[0], engine._buffers
    assert not torch.is_inference_mode_enabled()
    history = History(ws.tokens, ws.length, ws.active, int(ws.length.max()), ws.hidden)
    draft = drafter.propose(history, 3, SamplingParams(), torch.rand(1, 3, dtype=torch.float64))
    assert draft.tokens.shape == (1, 3) and draft.tokens.is_inference()


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
def test_train_drafter_command_trains_saves_and_the_engine_loads_it(kind, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FLASHSPEC_CACHE", str(tmp_path / "cache"))  # its token cache
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
    assert len(record["training"]["loss"]) == 6
    assert [e["step"] for e in record["training"]["estimates"]] == [0, 3, 6]  # before training, then every 3
    assert 0 <= record["training"]["alpha1_saved"] <= 1  # re-estimated on the checkpoint as saved
    engine = SpeculativeEngine(str(tmp_path / "target"), [f"{kind}:{tmp_path / 'drafter'}"], device="cpu")
    prompt = [[ord(c) for c in "def f3(x):\n"]]
    assert engine.generate(prompt, max_new_tokens=10, eos_token_id=[]).sequences == _reference(model, prompt, 10)
    # --base without --rank trains the whole drafter further: a full checkpoint that keeps its history
    rc = main(["train-drafter", "--kind", kind, "--target", str(tmp_path / "target"), "--data", str(text), "--out",
               str(tmp_path / "further"), "--base", str(tmp_path / "drafter"), "--steps", "4", "--batch", "2",
               "--seq-len", "32", "--estimate-every", "2", "--device", "cpu"])
    assert rc == 0, capsys.readouterr().err
    further = json.loads((tmp_path / "further" / "drafter.json").read_text())
    assert "base" not in further and len(further["training"]["loss"]) == 4
    before = further["training"]["before"]
    assert before["steps"] == 6 and before["tokens"] == record["training"]["tokens"] == 6 * 2 * 32
    assert [e["step"] for e in before["estimates"]] == [0, 3, 6]
    from flashspec.training.train import training_totals

    assert training_totals(further["training"])["steps"] == 10
    assert training_totals(further["training"])["tokens"] == 10 * 2 * 32
    engine = SpeculativeEngine(str(tmp_path / "target"), [f"{kind}:{tmp_path / 'further'}"], device="cpu")
    assert engine.generate(prompt, max_new_tokens=10, eos_token_id=[]).sequences == _reference(model, prompt, 10)
    from flashspec.bench.training import bench_training

    row = bench_training([str(tmp_path / "further")]).splitlines()[2]
    assert "| 10 (6 + 4) |" in row and f"| {10 * 2 * 32:,} |" in row
    assert main(["train-drafter", "--target", str(tmp_path / "target"), "--data", str(tmp_path / "nope.txt"),
                 "--out", str(tmp_path / "x"), "--device", "cpu"]) == 2
    assert "does not exist" in capsys.readouterr().err


# ------------------------------------------------------------------ compact designs (SPEC.md §11.4, §11.5)
def _compact_head(model, seed=0, vocab=None):
    torch.manual_seed(seed)
    head = FeatureHead(model.config, 1, width=24, heads=2, vocab=vocab)
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(3.0)  # an untrained head that changes the law a lot
    return head


@pytest.mark.parametrize("params", [dict(do_sample=False), dict(do_sample=True, temperature=0.7),
                                    dict(do_sample=True, temperature=1.3, top_k=2),
                                    dict(do_sample=True, temperature=0.9, top_p=0.6)])
def test_drawing_in_the_draft_vocabulary_is_the_law_of_the_full_row(params):
    """draw_in_subset on the draft vocabulary's logits returns target ids and the same law q as
    drawing from the full row that is -inf outside it (SPEC.md §11.4); a sampled token has q > 0."""
    from flashspec.drafters.base import draw
    from flashspec.drafters.feature import draw_in_subset
    from flashspec.sampling import SamplingParams

    sampling = SamplingParams(**params)
    vocab = torch.tensor([7, 2, 11, 0, 5])  # not sorted: the draft vocabulary is by frequency
    small = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    full = torch.full((3, 12), float("-inf")).index_copy(-1, vocab, small)
    uniforms = torch.rand(3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    token, q = draw_in_subset(small, vocab, 12, sampling, uniforms)
    reference, q_full = draw(full, sampling, uniforms)
    assert token.shape == (3,) and bool(torch.isin(token, vocab).all())
    if q is None:
        assert q_full is None and torch.equal(token, reference)
    else:
        torch.testing.assert_close(q, q_full)
        assert bool((q.gather(1, token[:, None]) > 0).all())


def test_subset_head_is_the_target_head_on_its_rows_and_minus_infinity_elsewhere():
    from flashspec.drafters.feature import SubsetHead

    model = tiny_model("llama", seed=1, vocab_size=64)
    vocab = torch.tensor([0, 5, 17, 63])
    head = SubsetHead(model.lm_head, vocab)
    x = torch.randn(2, 3, model.config.hidden_size)
    full, reference = head(x), model.lm_head(x)
    assert full.shape == reference.shape
    torch.testing.assert_close(full[..., vocab], reference[..., vocab])
    others = torch.ones(64, dtype=torch.bool)
    others[vocab] = False
    assert torch.isneginf(full[..., others]).all()
    assert head.weight.data_ptr() != model.lm_head.weight.data_ptr() and "weight" not in dict(head.named_parameters())


@pytest.mark.parametrize("arch", ARCHS)
def test_compact_feature_drafter_with_a_draft_vocabulary_is_token_for_token_the_target(arch, tmp_path):
    model = tiny_model(arch, seed=8, vocab_size=64)
    head = _compact_head(model, vocab=torch.arange(0, 64, 3))  # drafts only every third token
    assert head.layers[0].mlp.gate_proj.out_features == 24 and head.layers[0].self_attn.q_proj.out_features == 2 * (
        model.config.hidden_size // model.config.num_attention_heads)
    save_drafter(head, model, tmp_path)
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6, 5, 4, 3]]
    engine = SpeculativeEngine(model, [f"feature:{tmp_path}"], device="cpu")
    for gamma in (1, 4):
        out = engine.generate(prompts, max_new_tokens=12, num_draft_tokens=gamma, eos_token_id=[])
        assert out.sequences == _reference(model, prompts, 12)


def test_int8_storage_halves_the_bytes_and_keeps_each_row_within_half_a_step(tmp_path):
    model = tiny_model("llama", seed=9, vocab_size=64)
    head = _compact_head(model)
    save_drafter(head, model, tmp_path / "int8")
    save_drafter(head, model, tmp_path / "same", storage="same")
    loaded, exact = load_head(tmp_path / "int8", model), load_head(tmp_path / "same", model)
    for (name, original), q, e in zip(head.state_dict().items(), loaded.state_dict().values(), exact.state_dict().values()):
        assert torch.equal(original, e), name  # "same" storage is bit-exact
        if original.dim() == 2:
            step = original.abs().amax(dim=1, keepdim=True) / 127
            assert ((q - original).abs() <= step / 2 + 1e-7).all(), name
    saved = (tmp_path / "int8" / "drafter.safetensors").stat().st_size
    assert saved < (tmp_path / "same" / "drafter.safetensors").stat().st_size / 2  # float32 → int8 (+ scales)
    with pytest.raises(ValueError, match="storage must be"):
        save_drafter(head, model, tmp_path / "x", storage="fp4")


def test_draft_vocab_keeps_the_most_frequent_tokens_and_the_ones_asked_for():
    from flashspec.training.data import draft_vocab

    chunks = torch.tensor([[5, 5, 5, 2, 2, 9], [9, 9, 9, 9, 1, 0]])
    assert draft_vocab(chunks, 2).tolist() == [5, 9]
    assert draft_vocab(chunks, 3, always=(7,)).tolist() == [5, 7, 9]
    assert draft_vocab(chunks, 100).tolist() == [0, 1, 2, 5, 9]  # only tokens that occur


def test_training_with_a_draft_vocabulary_learns_and_reports_acceptance(target, self_generated, tmp_path):
    options = TrainOptions(steps=60, batch=8, seq_len=32, lr_layers=3e-3, lr_head=3e-3, estimate_every=30,
                           draft_vocab=40, width=32)
    head, log = train_head("feature", target, self_generated[:40], options, estimate=self_generated[40:],
                           progress=False)
    assert head.vocab.numel() == 40 and head.design["vocab"] == 40
    assert log["loss"][-1] < log["loss"][0]
    assert log["estimates"][-1]["alpha1"] > log["estimates"][0]["alpha1"]
    save_drafter(head, target, tmp_path, log)
    assert torch.equal(load_head(tmp_path, target).vocab, head.vocab)
    with pytest.raises(ValueError, match="feature drafter only"):
        train_head("shallow", target, self_generated[:40], TrainOptions(steps=1, draft_vocab=8), progress=False)


def test_a_low_rank_delta_starts_at_its_base_trains_alone_and_loads_over_it(target, self_generated, trained, tmp_path):
    base_folder, _ = trained
    base = load_head(base_folder, target)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    options = TrainOptions(steps=30, batch=8, seq_len=32, lr_layers=3e-3, lr_head=3e-3, estimate_every=30, rank=2)
    head, log = train_head("feature", target, self_generated[:40], options, estimate=self_generated[40:],
                           progress=False, base=base)
    assert log["estimates"][0]["step"] == 0  # B = 0: the delta starts at the base exactly
    assert log["loss"][-1] < log["loss"][0]
    originals = {k.replace(".parametrizations.weight.original", ".weight"): v for k, v in head.state_dict().items()
                 if not k.endswith((".A", ".B"))}
    for name, value in before.items():  # the base's own weights never moved: only the factors learned
        assert torch.equal(originals[name], value), name
    out = save_drafter(head, target, tmp_path / "code", log, base=base_folder)
    record = json.loads((out / "drafter.json").read_text())
    assert record["base"]["path"].endswith(base_folder.name) and record["rank"] == 2
    from safetensors.torch import load_file

    assert all(k.endswith((".A", ".B")) for k in load_file(str(out / "drafter.safetensors")))
    merged = load_head(out, target)
    x = torch.randn(1, 5, 2 * target.config.hidden_size)
    torch.testing.assert_close(merged.fc(x), head.fc(x), rtol=1e-4, atol=1e-5)  # W + B·A, merged
    prompts = [[3, 1, 4, 1, 5]]
    engine = SpeculativeEngine(target, [f"feature:{out}"], device="cpu")
    assert engine.generate(prompts, max_new_tokens=10, eos_token_id=[]).sequences == _reference(target, prompts, 10)
    # a changed base is refused, as is a delta without one
    changed = load_head(base_folder, target)
    with torch.no_grad():
        changed.fc.bias.add_(1.0)
    save_drafter(changed, target, tmp_path / "other", storage="same")
    record["base"]["path"] = "../other"
    (out / "drafter.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="another version of its base"):
        load_head(out, target)
    with pytest.raises(ValueError, match="needs a base drafter"):
        train_head("feature", target, self_generated[:40], TrainOptions(steps=1, rank=2), progress=False)


@pytest.mark.parametrize("bad,message", [({"width": 0}, "width"), ({"heads": 3}, "heads must divide"),
                                         ({"vocab": torch.tensor([1, 1])}, "distinct"),
                                         ({"vocab": torch.tensor([64])}, "distinct")])
def test_compact_designs_refuse_bad_sizes(bad, message):
    model = tiny_model("llama", seed=1, vocab_size=64)
    with pytest.raises(ValueError, match=message):
        FeatureHead(model.config, 1, **bad)


def test_token_chunks_cache_returns_the_same_ids_and_survives_a_damaged_entry(tmp_path):
    from flashspec.training.data import token_chunks

    class Tokenizer:
        name_or_path, calls = "chars", 0

        def __len__(self):
            return 128

        def __call__(self, text):
            Tokenizer.calls += 1
            return {"input_ids": [ord(c) % 128 for c in text]}

    texts = ["hello world " * 20, "another text " * 10]
    fresh = token_chunks(texts, Tokenizer(), 16)
    cached = token_chunks(texts, Tokenizer(), 16, tmp_path)
    again = token_chunks(texts, Tokenizer(), 16, tmp_path)
    assert torch.equal(fresh, cached) and torch.equal(cached, again)
    assert Tokenizer.calls == 4  # twice without the cache, twice to fill it, none from it
    for entry in tmp_path.iterdir():
        entry.write_bytes(b"damaged")
    assert torch.equal(token_chunks(texts, Tokenizer(), 16, tmp_path), fresh)


def test_max_seconds_stops_training_early_and_says_so(target, self_generated):
    options = TrainOptions(steps=10_000, batch=2, seq_len=32, max_seconds=0.5, estimate_every=10_000)
    _, log = train_feature_head(target, self_generated[:40], options, estimate=self_generated[40:], progress=False)
    assert 1 <= log["stopped_at_step"] < 10_000 == options.steps
    assert len(log["loss"]) == log["stopped_at_step"] and log["estimates"][-1]["step"] == log["stopped_at_step"]
    assert log["lr_fraction"] == pytest.approx(FLOOR)  # the schedule follows the clock: annealed at the cap
    with pytest.raises(ValueError, match="max_seconds"):
        TrainOptions(max_seconds=0)


def test_a_checkpoint_trained_in_bfloat16_loads_onto_the_same_target_in_float32(tmp_path):
    model = tiny_model("qwen2", seed=3, vocab_size=64)
    half = tiny_model("qwen2", seed=3, vocab_size=64).to(torch.bfloat16)
    save_drafter(FeatureHead(half.config, 1).to(torch.bfloat16), half, tmp_path)
    head = load_head(tmp_path, model)  # float32 target, bf16-trained head: the same shared weights
    assert next(head.parameters()).dtype == torch.float32


# ------------------------------------------------------------------ unrolled training (SPEC.md §11.6)
@pytest.mark.parametrize("taps", [None, (1, 0)])
def test_unrolled_passes_compute_what_the_drafter_computes_at_each_draft_depth(taps):
    """Pass j at position t, through chain_mask, equals the j-th draft of a chain begun at
    t − j + 1 computed the inference way: one growing causal sequence whose later inputs are the
    drafter's own predicted features (with taps, the first fed the fused feature, §11.8)."""
    from flashspec.training.train import _passes

    model = tiny_model("qwen2", seed=2, vocab_size=64)
    torch.manual_seed(3)
    head = FeatureHead(model.config, 1, width=24, heads=2, taps=taps)
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(3.0)
    draft = head.draft_model(model)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        captured = {}  # the target's features: its last layer's output before the norm, or the taps' outputs
        hooks = [model.model.norm.register_forward_pre_hook(lambda m, a: captured.setdefault("last", a[0]))]
        hooks += [model.model.layers[t].register_forward_hook(lambda m, a, out, t=t: captured.setdefault(t, out))
                  for t in taps or ()]
        model(ids)
        for hook in hooks:
            hook.remove()
        features = captured["last"] if taps is None else torch.cat([captured[t] for t in taps], dim=-1)
        logits, _ = _passes(head, draft, model, ids, features, 3)
        features = head.fused(features)  # the feature the drafter starts from
        pre = []
        hook = draft.model.norm.register_forward_pre_hook(lambda m, a: pre.append(a[0]))
        embeddings = model.model.embed_tokens(ids)
        for depth in (1, 2, 3):
            for t in range(depth - 1, 12):
                start = t - depth + 1  # the chain's first (true-feature) position
                previous = torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)
                inputs = [head.inputs(previous[:, : start + 1], embeddings[:, : start + 1])]
                out = draft.model(inputs_embeds=torch.cat(inputs, 1))
                for position in range(start + 1, t + 1):
                    predicted = pre[-1][:, -1:]
                    inputs.append(head.inputs(predicted, embeddings[:, position : position + 1]))
                    out = draft.model(inputs_embeds=torch.cat(inputs, 1))
                reference = draft.lm_head(out.last_hidden_state[:, -1])
                # (1e-3: with transformers 5.25's SDPA masking the two orders of summation differ by
                # up to 1.6e-4 on logits of magnitude 4; a wrong mask or input differs by order 1)
                torch.testing.assert_close(logits[depth - 1][:, t], reference, rtol=1e-3, atol=1e-3)
        hook.remove()


def test_chain_mask_for_one_pass_is_causal():
    from flashspec.training.train import chain_mask

    assert torch.equal(chain_mask(1, 5), torch.ones(5, 5, dtype=torch.bool).tril())
    mask = chain_mask(3, 4)
    assert mask.shape == (12, 12)
    assert mask[2 * 4 + 3].nonzero().flatten().tolist() == [0, 1, 4 + 2, 8 + 3]  # (3, t=3): s ≤ 1, (2, 2), (3, 3)


@pytest.fixture(scope="module")
def peaked():
    """A tiny target with peaked laws and text it sampled at T = 0.7: data where later drafts can
    be learnt (a random target's laws are too flat to tell the training methods apart)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.lm_head.weight.mul_(6)
    prompts = [[(5 * i + j) % 96 for j in range(4)] for i in range(160)]
    out = SpeculativeEngine(model, [], device="cpu").generate(prompts, max_new_tokens=60, do_sample=True,
                                                              temperature=0.7, eos_token_id=[], seed=0)
    return model, torch.tensor([p + s for p, s in zip(prompts, out.sequences)])


def test_later_drafts_need_unrolled_training(peaked, tmp_path):
    """Trained on true features only, the drafter's own predicted features mean nothing to it:
    drafts after the first are rarely accepted (as measured on the H200, BENCHMARKS.md). Unrolled
    passes and the feature loss (the defaults) keep them accepted (SPEC.md §11.6)."""
    target, data = peaked
    prompts = [p[:8] for p in data[140:148].tolist()]
    results = {}
    for name, extra in {"first-only": dict(unroll=1, feature_weight=0.0), "defaults": {}}.items():
        options = TrainOptions(steps=200, batch=16, seq_len=64, lr_layers=3e-3, lr_head=3e-3, estimate_every=200,
                               **extra)
        head, log = train_head("feature", target, data[:140], options, estimate=data[140:], progress=False)
        save_drafter(head, target, tmp_path / name, log, storage="same")
        out = SpeculativeEngine(target, [f"feature:{tmp_path / name}"], device="cpu").generate(
            prompts, max_new_tokens=40, num_draft_tokens=4, eos_token_id=[])
        results[name] = (log["estimates"][-1]["alpha"], out.stats.mean_tokens_per_step)
    (first1, first2, _), first_tokens = results["first-only"]
    (alpha1, alpha2, alpha3), tokens = results["defaults"]
    assert first2 < first1 - 0.3  # the collapse after the first draft
    assert alpha2 > first2 + 0.3 and alpha3 > first2 + 0.3
    assert tokens > first_tokens + 0.3


def test_long_texts_are_tokenized_in_pieces_cut_at_line_starts(monkeypatch):
    import flashspec.training.data as train

    class Tokenizer:
        def __call__(self, text):
            if isinstance(text, list):
                assert all(piece.endswith("\n") or piece is text[-1] for piece in text)
                return {"input_ids": [[ord(c) for c in piece] for piece in text]}
            return {"input_ids": [ord(c) for c in text]}

    monkeypatch.setattr(train, "PIECE", 10)
    text = "".join(f"line {i}\n" for i in range(50)) + "tail without newline"
    assert train._tokenize(text, Tokenizer()) == [ord(c) for c in text]


@pytest.mark.parametrize("vocab", [None, 40])
def test_training_over_a_bfloat16_target_keeps_float32_master_weights(vocab, self_generated, tmp_path):
    """The GPU recipe (a 16-bit target, float32 head under autocast, unrolled passes) on the CPU."""
    target = tiny_model("llama", seed=4, vocab_size=64).to(torch.bfloat16)
    options = TrainOptions(steps=20, batch=8, seq_len=32, lr_layers=3e-3, lr_head=3e-3, estimate_every=10,
                           draft_vocab=vocab)
    head, log = train_head("feature", target, self_generated[:40], options, estimate=self_generated[40:],
                           progress=False)
    assert next(head.parameters()).dtype == torch.bfloat16 and log["loss"][-1] < log["loss"][0]
    assert len(log["estimates"][-1]["alpha"]) == 3
    save_drafter(head, target, tmp_path)
    out = SpeculativeEngine(target, [f"feature:{tmp_path}"], device="cpu").generate(
        [[1, 2, 3]], max_new_tokens=8, eos_token_id=[])
    assert len(out.sequences[0]) == 8


@settings(max_examples=300, deadline=None)
@given(capacity=st.sampled_from([256, 512, 768, 1024]), bound=st.integers(1, 1024), seen=st.integers(0, 1024),
       first=st.booleans())
def test_feature_windows_cover_the_unseen_positions_in_few_widths(capacity, bound, seen, first):
    """SPEC.md §11: a feature (and shallow) drafter's window covers every position whose true
    feature it has not seen (the whole bound at a request's first proposal), and is always one
    of the few widths ``window_widths(capacity)``, whose graphs the first proposal captured."""
    from flashspec.drafters import History

    bound = min(bound, capacity)
    from flashspec.drafters.base import Seen

    drafter = FeatureDrafter.__new__(FeatureDrafter)  # _window reads only _seen
    drafter._seen = Seen()
    drafter._seen.mark = None if first else min(seen, bound)
    history = History(torch.zeros(1, capacity, dtype=torch.long), torch.ones(1, dtype=torch.long), max_length=bound)
    window = drafter._window(history)
    widths = window_widths(capacity)
    assert window in widths and widths == sorted(set(widths)) and widths[-1] == capacity
    assert len(widths) <= 1 + capacity.bit_length()
    unseen = bound if first else bound - drafter._seen.mark + 1
    assert window >= min(unseen, capacity) and window >= FeatureDrafter.MIN_WINDOW
    assert window < 2 * max(unseen, FeatureDrafter.MIN_WINDOW)  # never more than twice the work needed


@pytest.mark.parametrize("sync_every", [1, 4])
def test_a_gap_of_drafting_steps_re_feeds_what_they_committed_not_their_draft_lengths(target, trained, sync_every):
    """SPEC.md §4, "Catch-up windows": after steps of another drafter, a feature drafter re-feeds
    the positions those steps committed (read at polls; k + 1 for a step no poll has read yet),
    never fewer — not γ + 1 per step, which on the H200 pushed a window past the compiled widths
    into an eager feed (+7 % a step on an H200). Greedy output stays the target's."""
    from flashspec.select.fixed import ScriptedSelector

    prompt = [[(5 * j + 3) % 64 for j in range(12)]]
    engine = SpeculativeEngine(target, [f"feature:{trained[0]}", "ngram"], gammas=[4], target_only=True,
                               slack=None, device="cpu")
    # feature@4 = 0, ngram@4 = 1, target@0 = 2: a feature step after every gap of six steps
    engine.selection = engine.new_selection(ScriptedSelector(3, [0] + [1] * 6 + [0] + [2] * 3 + [1] * 3))
    drafter, windows = engine.drafters[0], []
    window = drafter._window

    def recorded(history):
        w = window(history)
        windows.append((history.growth.steps, w))
        return w
    drafter._window = recorded
    out = engine.generate(prompt, max_new_tokens=90, eos_token_id=[], sync_every=sync_every)
    assert out.sequences == _reference(target, prompt, 90)
    committed = [r.committed for r in out.stats.step_log]
    proposals = sorted({step for step, _ in windows})  # (_window runs for the guard's price and the proposal)
    assert len(proposals) > 5
    narrower = 0
    for previous, step in zip(proposals, proposals[1:]):
        w = max(w for s, w in windows if s == step)
        unseen = sum(committed[previous:step]) + 1  # what the rows really gained, and the pending token
        assert w >= unseen  # nothing committed is left unfed
        bound = 1 + sum(5 if r.arm != "target@0" else 1 for r in out.stats.step_log[previous:step])  # k + 1 each
        if sync_every == 1:
            assert w < 2 * max(unseen, FeatureDrafter.MIN_WINDOW)  # sized by what was committed
        narrower += w < max(FeatureDrafter.MIN_WINDOW, 1 << (bound - 1).bit_length())
    assert narrower > 0  # narrower than the draft lengths alone would have made it
