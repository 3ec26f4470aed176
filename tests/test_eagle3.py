"""EAGLE-3 heads from the EAGLE/SpecForge and speculators layouts (SPEC.md §11.9).

Tiny checkpoints are built here with the formats' real tensor names and config fields (nothing
is downloaded): loaded as ``"eagle3:DIR"`` they draft, the output is the target's (greedy token
for token, sampled by χ²), their draft logits equal an independent implementation of EAGLE-3's
layer written below, the taps follow each format's numbering, a round trip between the layouts
drafts the same, and heads of other targets or other drafter kinds are refused by name.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import tiny_model

import flashspec
from flashspec.cli import main
from flashspec.drafters.eagle3 import Eagle3Drafter
from flashspec.drafters.eagle3_formats import default_aux_ids, load_eagle3_head, read_eagle3, write_eagle3
from flashspec.drafters.feature import default_taps
from flashspec.models.static import StaticLM

VOCAB = 128
LAYERS = 8  # taps 1, 3, 4 (outputs; vLLM's ids 2, 4, 5): three distinct layers
HEADS, KV, DIM, WIDTH = 4, 2, 8, 64
PROMPTS = ((11,), (5, 9, 17), (3, 8, 3, 8, 3, 8, 3), (40, 41, 42, 43, 40, 41, 42, 43))
NEW_TOKENS = 16


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def target_model(arch: str = "llama", vocab: int = VOCAB):
    return tiny_model(arch, seed=5, vocab_size=vocab, layers=LAYERS)


def eagle3_tensors(target, *, seed: int = 0, draft_vocab: int | None = None, hidden: int | None = None,
                   taps: int = 3, embed: bool = True) -> dict[str, torch.Tensor]:
    """Random EAGLE-3 weights in the EAGLE layout (``midlayer.*``) for ``target``: ``draft_vocab``
    (a random subset of the target's ids, with ``d2t`` offsets and the ``t2d`` mask) or the whole
    vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    h = hidden or target.config.hidden_size
    vocab = target.config.vocab_size

    def w(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=gen)

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(n, generator=gen)

    tensors = {
        "midlayer.self_attn.q_proj.weight": w(HEADS * DIM, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(KV * DIM, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(KV * DIM, 2 * h), "midlayer.self_attn.o_proj.weight": w(h, HEADS * DIM),
        "midlayer.mlp.gate_proj.weight": w(WIDTH, h), "midlayer.mlp.up_proj.weight": w(WIDTH, h),
        "midlayer.mlp.down_proj.weight": w(h, WIDTH), "midlayer.input_layernorm.weight": norm(h),
        "midlayer.hidden_norm.weight": norm(h), "midlayer.post_attention_layernorm.weight": norm(h),
        "fc.weight": w(h, taps * h, scale=0.15), "norm.weight": norm(h),
    }
    ids = (torch.arange(vocab) if draft_vocab is None
           else torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values)
    tensors["lm_head.weight"] = w(len(ids), h, scale=1.0)
    tensors["d2t"] = ids - torch.arange(len(ids))  # an OFFSET map: target id = draft id + d2t[draft id]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    if embed and hidden is None:
        tensors["embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone()
    return tensors


def layer_fields(target, hidden: int | None = None) -> dict:
    return {"hidden_size": hidden or target.config.hidden_size, "intermediate_size": WIDTH,
            "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": DIM, "rms_norm_eps": 1e-5,
            "hidden_act": "silu", "max_position_embeddings": 256, "rope_theta": 10000.0, "num_hidden_layers": 1,
            "vocab_size": target.config.vocab_size, "attention_bias": False, "mlp_bias": False}


def save_eagle_layout(folder: Path, target, tensors: dict, draft_vocab: int | None = None, **config) -> str:
    """An EAGLE/SpecForge checkpoint: a Llama config.json with draft_vocab_size, model.safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    fields = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              **layer_fields(target, config.pop("hidden", None)),
              "draft_vocab_size": draft_vocab or target.config.vocab_size, **config}
    (folder / "config.json").write_text(json.dumps(fields))
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


def save_speculators_layout(folder: Path, target, tensors: dict, draft_vocab: int | None = None, **config) -> str:
    """A speculators ``Eagle3Speculator`` checkpoint (0.9.0's fields), ``layers.0.*`` names."""
    folder.mkdir(parents=True, exist_ok=True)
    fields = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
              "transformer_layer_config": {"model_type": "llama", **layer_fields(target)},
              "draft_vocab_size": draft_vocab or target.config.vocab_size, "norm_before_residual": False,
              "norm_before_fc": False, "fc_norm": False, "norm_output": False, "target_hidden_size": None,
              "eagle_aux_hidden_state_layer_ids": None,
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                     "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}}}
    fields.update(config)
    (folder / "config.json").write_text(json.dumps(fields))
    renamed = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in tensors.items()}
    save_file(renamed, str(folder / "model.safetensors"))
    return str(folder)


@functools.cache
def checkpoint(layout: str, draft_vocab: int | None, tmp: str) -> str:
    target = target_model()
    tensors = eagle3_tensors(target, seed=1, draft_vocab=draft_vocab)
    save = save_eagle_layout if layout == "eagle3" else save_speculators_layout
    return save(Path(tmp) / f"{layout}-{draft_vocab}", target, tensors, draft_vocab)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("eagle3"))


def hf_greedy(prompt: tuple[int, ...]) -> list[int]:
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = target_model().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                      do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# ------------------------------------------------------------------ an independent EAGLE-3 layer
def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of ``x [heads, T, d]`` at ``positions [T]`` (halves rotated, as Llama's)."""
    d = x.shape[-1]
    angles = positions[:, None].double() / theta ** (torch.arange(0, d, 2).double() / d)
    cos, sin = torch.cat([angles.cos()] * 2, -1).float(), torch.cat([angles.sin()] * 2, -1).float()
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * cos + half * sin


def reference_eagle3(t: dict[str, torch.Tensor], features: torch.Tensor, embeddings: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """EAGLE-3's layer (SafeAILab/EAGLE ``LlamaDecoderLayeremb``; speculators ``Eagle3DecoderLayer``)
    on a causal sequence of pairs ``(g, e)``, ``[T, H]`` each: the layer's output ``[T, H]``."""
    p = "midlayer."
    x = torch.cat([rms(embeddings, t[p + "input_layernorm.weight"]), rms(features, t[p + "hidden_norm.weight"])], -1)
    q = (x @ t[p + "self_attn.q_proj.weight"].T).view(-1, HEADS, DIM).transpose(0, 1)
    k = (x @ t[p + "self_attn.k_proj.weight"].T).view(-1, KV, DIM).transpose(0, 1)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(-1, KV, DIM).transpose(0, 1)
    q, k = rope(q, positions), rope(k, positions)
    k, v = k.repeat_interleave(HEADS // KV, 0), v.repeat_interleave(HEADS // KV, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(DIM)
    scores = scores.masked_fill(torch.ones_like(scores[0], dtype=torch.bool).triu(1), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(len(positions), -1) @ t[p + "self_attn.o_proj.weight"].T
    h = features + attn
    y = rms(h, t[p + "post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(y @ t[p + "mlp.gate_proj.weight"].T) * (y @ t[p + "mlp.up_proj.weight"].T))
    return h + mlp @ t[p + "mlp.down_proj.weight"].T


# ---------------------------------------------------------------------------------- tests
def test_the_default_taps_are_the_same_tensors_in_every_numbering():
    """EAGLE's code keeps the states entering layers 2, L//2, L−3; SpecForge hooks the outputs of
    layers 1, L//2−1, L−4; vLLM and speculators number them 2, L//2, L−3 (id n = output of the
    first n layers): FlashSpec's default taps are those outputs."""
    for layers in range(8, 100):
        assert tuple(n - 1 for n in default_aux_ids(layers)) == default_taps(layers)


@pytest.mark.parametrize("key, ids, taps", [
    ("eagle_aux_hidden_state_layer_ids", [1, 3, 7], (0, 2, 6)),  # vLLM / speculators: layer inputs
    ("eagle_config", {"eagle_aux_hidden_state_layer_ids": [0, 2, 6]}, (0, 2, 6)),  # SGLang: layer outputs
])
def test_explicit_taps_follow_each_formats_numbering(tmp, key, ids, taps):
    target = target_model()
    folder = save_eagle_layout(Path(tmp) / f"taps-{key}", target, eagle3_tensors(target), **{key: ids})
    head = load_eagle3_head(folder, target)
    assert head.taps == taps
    assert Eagle3Drafter(StaticLM(target), head).feature_layers == tuple(t + 1 for t in taps)
    folder = save_speculators_layout(Path(tmp) / "taps-spec", target, eagle3_tensors(target),
                                     eagle_aux_hidden_state_layer_ids=[1, 3, 7])
    assert load_eagle3_head(folder, target).taps == (0, 2, 6)


def test_two_numberings_that_disagree_are_refused(tmp):
    target = target_model()
    folder = save_eagle_layout(Path(tmp) / "taps-both", target, eagle3_tensors(target),
                               eagle_aux_hidden_state_layer_ids=[2, 4, 5],
                               eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 4, 5]})
    with pytest.raises(ValueError, match="two different taps"):
        load_eagle3_head(folder, target)


@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
@pytest.mark.parametrize("draft_vocab", [None, 48])
def test_draft_logits_equal_a_reference_eagle3_layer(tmp, layout, draft_vocab):
    """The drafter's window feed and its next step against the reference layer above on the same
    inputs: the target's states entering layers 2, 4, 5, pairs (h_t, x_{t+1}) at positions t, the
    layer's output fed back for the next draft, logits mapped through d2t."""
    target = target_model()
    folder = checkpoint(layout, draft_vocab, tmp)
    drafter = Eagle3Drafter(StaticLM(target), load_eagle3_head(folder, target))
    t = eagle3_tensors(target, seed=1, draft_vocab=draft_vocab)
    ids = torch.tensor([[7, 3, 99, 12, 5, 64, 2, 31, 8, 17]])
    T, capacity = ids.shape[1] - 1, 16
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states  # [n]: entering layer n
        aux = torch.cat([states[2][0], states[4][0], states[5][0]], -1)  # [T + 1, 3H]
        g = aux[:T] @ t["fc.weight"].T  # pairs (g_t, x_{t+1}), t = 0 … T − 1
        e = target.model.embed_tokens(ids[0, 1:])
        out = reference_eagle3(t, g, e, torch.arange(T))
        expected = rms(out, t["norm.weight"]) @ t["lm_head.weight"].T
        draft = int(expected[-1].argmax())
        token = int(draft + t["d2t"][draft])
        e2 = torch.cat([e, target.model.embed_tokens.weight[token][None]])
        out2 = reference_eagle3(t, torch.cat([g, out[-1:]]), e2, torch.arange(T + 1))
        expected2 = rms(out2[-1], t["norm.weight"]) @ t["lm_head.weight"].T

        drafter.lm.reset(1, capacity)
        drafter._features = torch.zeros(1, capacity, target.config.hidden_size)
        tokens = torch.zeros(1, capacity, dtype=torch.long)
        tokens[:, : T + 1] = ids
        hidden = tuple(torch.zeros(1, capacity, target.config.hidden_size).index_copy(1, torch.arange(T + 1), states[n])
                       for n in drafter.feature_layers)
        start = torch.zeros(1, dtype=torch.long)
        got = drafter._feed(tokens, hidden, drafter._features, start, T + 1, torch.arange(1, T + 1)[None])[0]
        got2 = drafter._next(torch.tensor([token]), torch.tensor([T + 1]))[0]
    if draft_vocab is None:  # full vocabulary: the logits in the target's order
        assert drafter._subset is None
    else:
        assert drafter._subset.vocab.tolist() == (torch.arange(draft_vocab) + t["d2t"]).tolist()
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got2, expected2, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("gamma", [1, 4])
@pytest.mark.parametrize("layout, draft_vocab", [("eagle3", None), ("eagle3", 48), ("speculators", 48)])
def test_greedy_output_is_the_targets(tmp, layout, draft_vocab, gamma):
    engine = flashspec.SpeculativeEngine(target_model(), [f"eagle3:{checkpoint(layout, draft_vocab, tmp)}"],
                                         device="cpu", selector="fixed")
    out = engine.generate([list(p) for p in PROMPTS], max_new_tokens=NEW_TOKENS, num_draft_tokens=gamma,
                          do_sample=False)
    assert [list(s) for s in out.sequences] == [hf_greedy(p) for p in PROMPTS]
    assert out.stats.proposed > 0


def test_rows_joining_a_running_batch_equal_generate(tmp):
    """A row that joins a running batch (SPEC.md §12) gets in the head's own cache what
    ``generate``'s prefill gives it (``prefill_row``): the same tokens, drafts accepted as often."""
    from test_batch_drafters import BUDGETS, _generate, _run_batch
    from test_batch_drafters import PROMPTS as ROWS

    engine = flashspec.SpeculativeEngine(target_model(), [f"eagle3:{checkpoint('speculators', 48, tmp)}"], device="cpu")
    expected = [_generate(engine, p, n, 4) for p, n in zip(ROWS, BUDGETS)]
    got, counts = _run_batch(engine, ROWS, BUDGETS, gamma=4)
    assert [got[i] for i in range(len(ROWS))] == [tokens for tokens, _ in expected]
    assert [counts[i] for i in range(len(ROWS))] == [steps for _, steps in expected]


def test_sampled_output_has_the_targets_law(tmp):
    """χ² against the exact law of the target's first three tokens (SPEC.md §6), with a head over
    5 of its 8 tokens (the other 3 come only from the residual) tapping its two layers."""
    from stats_helpers import ALPHA
    from test_distribution import TARGET, chi_square_pvalue, exact_law, run

    tensors = eagle3_tensors(TARGET, seed=3, draft_vocab=5, taps=2)
    tensors["lm_head.weight"] = 0.1 * tensors["lm_head.weight"]  # a flatter q: about 30 % of drafts accepted
    folder = save_speculators_layout(Path(tmp) / "chi2", TARGET, tensors, 5, eagle_aux_hidden_state_layer_ids=[1, 2])
    samples, stats = run(f"eagle3:{folder}", temperature=0.9, gamma=3)
    assert stats.proposed > 0 and 0 < stats.accepted < stats.proposed
    assert chi_square_pvalue(samples, exact_law(0.9, 0, 1.0)) > ALPHA


def test_a_round_trip_between_the_layouts_drafts_the_same(tmp):
    target = target_model()
    source = checkpoint("eagle3", 48, tmp)
    spec = Path(tmp) / "round" / "speculators"
    back = Path(tmp) / "round" / "eagle3"
    assert main(["export-drafter", source, "--to", "speculators", "--out", str(spec)]) == 2  # which target?
    assert main(["export-drafter", source, "--to", "speculators", "--out", str(spec), "--verifier", "tiny"]) == 0
    assert main(["export-drafter", str(spec), "--to", "eagle3", "--out", str(back)]) == 0
    first, again = read_eagle3(source), read_eagle3(back)
    assert read_eagle3(spec).layout == "speculators" and again.layout == "eagle3"
    assert first.tensors.keys() == again.tensors.keys()
    assert all(torch.equal(first.tensors[k], again.tensors[k]) for k in first.tensors)
    logits = []
    for folder in (source, spec, back):
        drafter = Eagle3Drafter(StaticLM(target), load_eagle3_head(folder, target))
        drafter.lm.reset(1, 8)
        drafter._features = torch.zeros(1, 8, target.config.hidden_size)
        gen = torch.Generator().manual_seed(0)
        hidden = tuple(torch.randn(1, 8, target.config.hidden_size, generator=gen) for _ in drafter.feature_layers)
        with torch.no_grad():
            logits.append(drafter._feed(torch.arange(8)[None] + 3, hidden, drafter._features,
                                        torch.zeros(1, dtype=torch.long), 8, torch.arange(8)[None]))
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])


def test_an_export_loads_in_speculators_and_computes_the_same_logits(tmp):
    """speculators' own Eagle3DraftModel (0.9.0) loads a head FlashSpec wrote in its layout, with
    the default taps, and its first draft step's logits are FlashSpec's drafter's."""
    speculators = pytest.importorskip("speculators.models.eagle3")
    target = target_model()
    target.save_pretrained(Path(tmp) / "verifier")
    source = checkpoint("eagle3", 48, tmp)
    out = Path(tmp) / "for-speculators"
    assert main(["export-drafter", source, "--to", "speculators", "--out", str(out),
                 "--verifier", str(Path(tmp) / "verifier")]) == 0
    config = speculators.Eagle3SpeculatorConfig.from_pretrained(str(out))
    config.transformer_layer_config._attn_implementation = "eager"
    model = speculators.Eagle3DraftModel.from_pretrained(str(out), config=config).eval()
    assert list(model.config.eagle_aux_hidden_state_layer_ids) == [2, 4, 5]
    ids = torch.tensor([[7, 3, 99, 12, 5, 64, 2, 31, 8, 17]])
    T, capacity, h = ids.shape[1] - 1, 16, target.config.hidden_size
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
        seen = []
        model.lm_head.register_forward_hook(lambda module, args, output: seen.append(output))
        model(torch.cat([states[2], states[4], states[5]], -1)[:, :T], ids[:, 1:],
              document_ids=torch.zeros(1, T, dtype=torch.long), ttt_steps=1)
        drafter = Eagle3Drafter(StaticLM(target), load_eagle3_head(out, target))
        drafter.lm.reset(1, capacity)
        drafter._features = torch.zeros(1, capacity, h)
        tokens = torch.zeros(1, capacity, dtype=torch.long)
        tokens[:, : T + 1] = ids
        hidden = tuple(torch.zeros(1, capacity, h).index_copy(1, torch.arange(T + 1), states[n])
                       for n in drafter.feature_layers)
        ours = drafter._feed(tokens, hidden, drafter._features, torch.zeros(1, dtype=torch.long), T + 1,
                             torch.arange(1, T + 1)[None])[0]
    torch.testing.assert_close(ours, seen[0][0], atol=1e-4, rtol=1e-4)


def test_flashspec_feature_drafters_are_not_exported(tmp, capsys):
    """FlashSpec's fc([g; e]) → standard layer is not EAGLE-3's layer: no exact export exists, and
    the refusal names the way to a head vLLM and SGLang load (train-drafter --layout eagle3)."""
    from flashspec.drafters.checkpoint import save_drafter

    target = target_model()
    folder = Path(tmp) / "feature"
    save_drafter(flashspec.FeatureHead(target.config, 1, taps=default_taps(LAYERS)), target, folder)
    assert main(["export-drafter", str(folder), "--to", "eagle3", "--out", str(Path(tmp) / "nope")]) == 2
    err = capsys.readouterr().err
    assert "not EAGLE-3's" in err and "--layout eagle3" in err
    assert not (Path(tmp) / "nope").exists()


def test_what_a_layout_cannot_express_is_refused(tmp):
    target = target_model()
    ckpt = read_eagle3(checkpoint("eagle3", None, tmp))
    ckpt.options["norm_output"] = True
    with pytest.raises(ValueError, match="EAGLE layout cannot express"):
        write_eagle3(ckpt, Path(tmp) / "no", "eagle3")
    ckpt.tensors["fc.bias"] = torch.zeros(target.config.hidden_size)
    with pytest.raises(ValueError, match="bias"):
        write_eagle3(ckpt, Path(tmp) / "no", "speculators")
    del ckpt.tensors["fc.bias"], ckpt.tensors["embed_tokens.weight"]  # speculators' loader reads it from the folder
    with pytest.raises(ValueError, match="carries the token embedding"):
        write_eagle3(ckpt, Path(tmp) / "no", "speculators")
    assert not (Path(tmp) / "no").exists()


def test_a_head_for_another_target_is_refused_before_any_forward(tmp):
    target = target_model()
    cases = {
        "hidden size": save_eagle_layout(Path(tmp) / "bad-hidden", target, eagle3_tensors(target, hidden=48),
                                         hidden=48),
        "vocabulary": save_eagle_layout(Path(tmp) / "bad-vocab", target_model(vocab=256),
                                        eagle3_tensors(target_model(vocab=256)), 256),
        "entering layers": save_eagle_layout(Path(tmp) / "bad-taps", target, eagle3_tensors(target),
                                             eagle_aux_hidden_state_layer_ids=[2, 4, 9]),
        "architecture": save_speculators_layout(
            Path(tmp) / "bad-arch", target, eagle3_tensors(target),
            speculators_config={"algorithm": "eagle3", "verifier": {"architectures": ["Qwen2ForCausalLM"]}}),
        "fc maps": save_eagle_layout(Path(tmp) / "bad-fc", target, eagle3_tensors(target, taps=2)),
        "target_hidden_size": save_eagle_layout(Path(tmp) / "bad-target-hidden", target, eagle3_tensors(target),
                                                target_hidden_size=48),
    }
    for what, folder in cases.items():
        with pytest.raises(ValueError, match=what):
            load_eagle3_head(folder, target)
    with pytest.raises(ValueError, match="hidden size"):  # through the engine, as the CLI and server meet it
        flashspec.SpeculativeEngine(target, [f"eagle3:{cases['hidden size']}"], device="cpu")


def test_other_drafter_kinds_are_refused_by_name(tmp):
    target = target_model()
    good = eagle3_tensors(target)
    h = target.config.hidden_size
    eagle1 = {"layers.0.self_attn.q_proj.weight": torch.zeros(h, h), "fc.weight": torch.zeros(h, 2 * h)}
    cases = {
        "DFlash": save_speculators_layout(Path(tmp) / "dflash", target, good, speculators_model_type="dflash",
                                          speculators_config={"algorithm": "dflash"}),
        "P-EAGLE": save_speculators_layout(Path(tmp) / "peagle", target, good, speculators_model_type="peagle",
                                           speculators_config={"algorithm": "peagle"}),
        "parallel drafting": save_eagle_layout(Path(tmp) / "mask", target, {**good, "mask_hidden": torch.zeros(3 * h)}),
        "EAGLE-1/2": save_eagle_layout(Path(tmp) / "eagle1", target, eagle1, architectures=["LlamaForCausalLM"]),
        "multi-token": save_eagle_layout(Path(tmp) / "mtp", target, good, architectures=["DeepseekV3ForCausalLMNextN"]),
        "several decoder layers": save_eagle_layout(Path(tmp) / "deep", target,
                                                    {**good, "layers.1.hidden_norm.weight": torch.ones(h)}),
    }
    (Path(tmp) / "dflash-hf").mkdir()
    (Path(tmp) / "dflash-hf" / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    cases["a DFlash"] = str(Path(tmp) / "dflash-hf")
    for what, folder in cases.items():
        with pytest.raises(ValueError, match=what):
            load_eagle3_head(folder, target)
    with pytest.raises(ValueError, match="FlashSpec drafter checkpoint"):
        (Path(tmp) / "ours").mkdir()
        (Path(tmp) / "ours" / "drafter.json").write_text("{}")
        load_eagle3_head(Path(tmp) / "ours", target)
    with pytest.raises(ValueError, match="no config.json"):
        load_eagle3_head(Path(tmp), target)
