"""Careless and hostile use (SPEC.md §5): each case used to give a silent wrong result, an ignored
argument or a raw exception from deep inside; now it is the right result or a ValueError with a
sentence that names the argument."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

from flashspec import SpeculativeEngine
from flashspec.decode.request import MAX_DRAFT_TOKENS, MAX_TOKENS_WITHOUT_WINDOW
from flashspec.select import Selection


def llama(vocab: int = 32, context: int | None = 64, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=context or 64,
                         initializer_range=0.2)
    return LlamaForCausalLM(config).eval()


TARGET = llama()
DRAFT = llama(seed=1)
PROMPT = [1, 2, 3, 4]


def greedy(engine: SpeculativeEngine, prompts, **kwargs) -> list[list[int]]:
    return engine.generate(prompts, max_new_tokens=6, eos_token_id=[], **kwargs).sequences


# ------------------------------------------------------------------ 1. threads
def test_concurrent_generate_calls_are_serialised_and_each_gets_its_own_answer():
    engine = SpeculativeEngine(TARGET, [DRAFT, "ngram"], gammas=[2, 3], selector="ucb1", selector_options={"seed": 0})
    prompts = [[[1, 2, 3]], [[4, 5, 6, 7], [8, 9]], [[10, 11]], [[3, 1, 4, 1, 5, 9]]]
    expected = [SpeculativeEngine(TARGET, []).generate(p, max_new_tokens=12, eos_token_id=[]).sequences for p in prompts]
    results: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(2):
                results[i] = engine.generate(prompts[i % 4], max_new_tokens=12, eos_token_id=[]).sequences
                assert results[i] == expected[i % 4]
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert all(results[i] == expected[i % 4] for i in range(8))


# ------------------------------------------------------------------ 2. temperatures with no mass
@pytest.mark.parametrize("temperature", [1e-38, 1e-30, 5e-5])
def test_a_temperature_too_small_for_any_mass_is_refused(temperature):
    engine = SpeculativeEngine(TARGET, [])
    with pytest.raises(ValueError, match="temperature"):
        engine.generate([PROMPT], max_new_tokens=2, do_sample=True, temperature=temperature)


# ------------------------------------------------------------------ 3. attention_mask
def test_attention_mask_applies_to_list_prompts():
    engine = SpeculativeEngine(TARGET, ["ngram"])
    padded = greedy(engine, [[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]], attention_mask=[[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert padded == [greedy(engine, [[5, 6, 7]])[0], greedy(engine, [[1, 2, 3, 4, 5]])[0]]
    assert greedy(engine, [0, 5, 6, 7], attention_mask=[0, 1, 1, 1]) == greedy(engine, [[5, 6, 7]])


@pytest.mark.parametrize("prompts, mask, message", [
    ([[1, 2, 3]], [[1, 1]], "shape"),
    ([[1, 2, 3]], "1,1,1", "attention_mask"),
    ([[1, 2, 3]], [[1, 2, 1]], "only 0"),
    (torch.tensor([[1, 2, 3]]), torch.ones(1, 2), "shape"),
])
def test_bad_attention_masks_are_refused(prompts, mask, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeEngine(TARGET, []).generate(prompts, attention_mask=mask, max_new_tokens=2)


def test_attention_mask_with_string_prompts_is_refused():
    class Chars:
        def __call__(self, text):
            return {"input_ids": [ord(c) % 32 for c in text]}

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(65 + i) for i in ids)

    engine = SpeculativeEngine(TARGET, [], tokenizer=Chars())
    with pytest.raises(ValueError, match="attention_mask"):
        engine.generate("abc", attention_mask=[[1, 1, 1]], max_new_tokens=2)


# ------------------------------------------------------------------ 5. bounds
@pytest.mark.parametrize("gamma", [MAX_DRAFT_TOKENS + 1, 10**6])
def test_draft_lengths_are_bounded(gamma):
    engine = SpeculativeEngine(TARGET, ["ngram"])
    with pytest.raises(ValueError, match="num_draft_tokens must be at most"):
        engine.generate([PROMPT], max_new_tokens=2, num_draft_tokens=gamma)
    with pytest.raises(ValueError, match="gammas"):
        SpeculativeEngine(TARGET, ["ngram"], gammas=[2, gamma])


def test_a_model_without_a_context_window_is_bounded(monkeypatch):
    import flashspec.decode.request

    monkeypatch.setattr(flashspec.decode.request, "context_window", lambda config: None)  # a config naming none
    engine = SpeculativeEngine(TARGET, [])
    with pytest.raises(ValueError, match="names no context window"):
        engine.generate([PROMPT], max_new_tokens=MAX_TOKENS_WITHOUT_WINDOW)


# ------------------------------------------------------------------ 6. a folder without tokenizer files
def test_a_saved_model_without_tokenizer_files_is_a_target_for_token_ids(tmp_path):
    TARGET.save_pretrained(tmp_path / "target")
    engine = SpeculativeEngine(str(tmp_path / "target"), [], device="cpu")
    assert greedy(engine, [PROMPT]) == greedy(SpeculativeEngine(TARGET, []), [PROMPT])
    with pytest.raises(ValueError, match="String prompts need a tokenizer: none could be loaded"):
        engine.generate("hello", max_new_tokens=2)


# ------------------------------------------------------------------ 7. booleans
@pytest.mark.parametrize("kwargs", [dict(do_sample="False"), dict(do_sample=1), dict(progress="no")])
def test_booleans_are_type_checked_in_generate(kwargs):
    with pytest.raises(ValueError, match="True or False"):
        SpeculativeEngine(TARGET, []).generate([PROMPT], max_new_tokens=2, **kwargs)


@pytest.mark.parametrize("kwargs", [dict(share_selector="no"), dict(compile="yes")])
def test_booleans_are_type_checked_in_the_constructor(kwargs):
    with pytest.raises(ValueError, match="True or False"):
        SpeculativeEngine(TARGET, [], **kwargs)


def test_numpy_booleans_are_booleans():
    engine = SpeculativeEngine(TARGET, [])
    assert greedy(engine, [PROMPT], do_sample=np.bool_(False)) == greedy(engine, [PROMPT])


# ------------------------------------------------------------------ 10. models that are not causal LMs
BERT = BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)


@pytest.mark.parametrize("model, message", [
    (BertForMaskedLM(BERT), "not a causal language model"),
    (T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)),
     "encoder-decoder"),
])
def test_non_causal_models_are_refused(model, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeEngine(model, [])
    with pytest.raises(ValueError, match=message):
        SpeculativeEngine(TARGET, [model])


# ------------------------------------------------------------------ 12. input-type paper cuts
def test_a_flat_list_is_one_prompt():
    engine = SpeculativeEngine(TARGET, ["ngram"])
    assert greedy(engine, PROMPT) == greedy(engine, [PROMPT])


def test_numpy_integers_are_token_ids():
    engine = SpeculativeEngine(TARGET, ["ngram"])
    ids = [np.int64(t) for t in PROMPT]
    assert greedy(engine, [ids]) == greedy(engine, [PROMPT])
    assert greedy(engine, np.array(PROMPT).tolist()) == greedy(engine, [PROMPT])
    assert engine.generate([PROMPT], max_new_tokens=3, eos_token_id=np.int32(5)).sequences


@pytest.mark.parametrize("prompt, message", [
    ([[1, 2], 3], "list of token-id lists"),
    ([1.0, 2.0], "outside the vocabulary|token-id lists"),
    (torch.tensor([[1.0, 2.0]]), "integer token ids"),
    ({"input_ids": [1, 2]}, "input_ids must be"),
])
def test_malformed_prompts_are_refused(prompt, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeEngine(TARGET, []).generate(prompt, max_new_tokens=2)


@pytest.mark.parametrize("name", ["NGRAM", "Ngram", " ngram"])
def test_a_misspelt_drafter_keyword_says_so_at_once(name):
    with pytest.raises(ValueError, match="did you mean 'ngram'"):
        SpeculativeEngine(TARGET, [name])


def test_context_labels_are_evicted_least_recently_used_first():
    selection = Selection("ucb1", 2, max_contexts=3, seed=0)
    for label in range(5):
        selection.for_request(label)
    assert list(selection.contexts) == [2, 3, 4]
    selection.for_request(2)  # used again: now the most recent
    selection.for_request(5)
    assert list(selection.contexts) == [4, 2, 5]
    engine = SpeculativeEngine(TARGET, [DRAFT, "ngram"], selector="ucb1", selector_options={"seed": 0})
    for label in range(1030):
        engine.selection.for_request(label)
    assert len(engine.selection.contexts) == engine.selection.max_contexts
    with pytest.raises(ValueError, match="max_contexts"):
        Selection("ucb1", 2, max_contexts=0)


@pytest.mark.parametrize("path", ["/nonexistent/model", "./no/such/folder", "~/no-such-model-here"])
def test_a_nonexistent_path_says_so(path):
    """Before: transformers' 'Repo id must be in the form ...' for a path that simply does not exist."""
    with pytest.raises(ValueError, match="does not exist"):
        SpeculativeEngine(path, [])
    with pytest.raises(ValueError, match="does not exist"):
        SpeculativeEngine(TARGET, [path])


# ------------------------------------------------------------------ 2. and 11. faults found on the device
class _Poisoned:
    """Turns the target's logits into NaN from its ``after``-th head call on (a model broken mid-way)."""

    def __init__(self, model: torch.nn.Module, after: int) -> None:
        self.calls, self.after = 0, after
        self.handle = model.lm_head.register_forward_hook(self)

    def __call__(self, module, inputs, output):
        self.calls += 1
        return output.fill_(float("nan")) if self.calls > self.after else output


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("drafters", [[], ["ngram"], [DRAFT]])
def test_non_finite_logits_stop_generation_with_the_row_and_step(do_sample, drafters):
    """Before: greedy took the argmax of NaN (a silent wrong token), sampling emitted token id -1."""
    model = llama(seed=3)
    engine = SpeculativeEngine(model, drafters)
    poison = _Poisoned(model, after=3)  # the prefill and two steps are fine
    with pytest.raises(ValueError, match=r"decode step \d+, row 0: the target's logits are not finite"):
        engine.generate([PROMPT], max_new_tokens=20, do_sample=do_sample, temperature=0.8, eos_token_id=[])
    poison.handle.remove()
    _Poisoned(model, after=0)
    with pytest.raises(ValueError, match="at the prefill, row 0: the target's logits are not finite"):
        engine.generate([PROMPT, [5, 6]], max_new_tokens=4, eos_token_id=[])


class _Custom:
    """A drafter returning whatever it is told to."""

    name = "custom"

    def __init__(self, make) -> None:
        self.make = make

    def begin(self, batch_size: int) -> None:
        pass

    def propose(self, history, num_tokens, params, uniforms):
        from flashspec import Draft

        tokens, probs = self.make(history.tokens.shape[0], num_tokens)
        return Draft(tokens, probs)


@pytest.mark.parametrize("make, message", [
    (lambda b, k: (torch.full((b, k), 32), None), "outside the target's vocabulary"),
    (lambda b, k: (torch.full((b, k), -1), None), "outside the target's vocabulary"),
    (lambda b, k: (torch.zeros(b, k + 1, dtype=torch.long), None), r"shape \(2, 5\); the protocol asks for \[2, 4\]"),
    (lambda b, k: (torch.zeros(k, dtype=torch.long), None), "shape"),
    (lambda b, k: ([[0] * k] * b, None), "shape list"),
    (lambda b, k: (torch.zeros(b, k), None), "float32 draft tokens"),
    (lambda b, k: (torch.zeros(b, k, dtype=torch.long), torch.ones(b, k, 7)), "draft probabilities of shape"),
])
def test_a_custom_drafters_output_is_checked(make, message):
    """Before: an IndexError or RuntimeError from deep inside verification."""
    engine = SpeculativeEngine(TARGET, [_Custom(make)])
    with pytest.raises(ValueError, match=message):
        engine.generate([PROMPT, [7, 8, 9]], max_new_tokens=6, do_sample=True, temperature=0.9, eos_token_id=[])


def test_a_drafter_whose_probabilities_are_nan_has_every_draft_rejected():
    """NaN q fails every acceptance test (u·q < p is false), and the residual with no finite mass
    falls back to the target's own law (SPEC.md §2): the output stays the target's, never id -1."""
    nan = lambda b, k: (torch.zeros(b, k, dtype=torch.long), torch.full((b, k, 32), float("nan")))  # noqa: E731
    out = SpeculativeEngine(TARGET, [_Custom(nan)]).generate(
        [PROMPT, [5, 6]], max_new_tokens=12, do_sample=True, temperature=0.9, eos_token_id=[], seed=0)
    assert out.stats.accepted == 0 and out.stats.proposed > 0
    assert all(0 <= t < 32 for row in out.sequences for t in row) and all(len(r) == 12 for r in out.sequences)


# ------------------------------------------------------------------ 4. the user's model is left as it was
def test_a_model_in_eval_mode_is_not_switched_and_mixed_modes_come_back_module_by_module():
    """eval_mode (SPEC.md §5): a model wholly in eval mode is left alone (no module's mode is
    set: switching cost milliseconds per call); a model with one submodule in training mode runs
    wholly in eval mode and gets back exactly that submodule's mode."""
    from flashspec.models.loading import eval_mode

    still, mixed = llama(seed=7).eval(), llama(seed=8).eval()
    mixed.model.layers[0].mlp.train()
    before = [m.training for m in mixed.modules()]
    sets = []
    original = torch.nn.Module.__setattr__

    def spy(module, name, value):
        if name == "training":
            sets.append(module)
        original(module, name, value)

    torch.nn.Module.__setattr__ = spy
    try:
        with eval_mode(still, mixed):
            assert not any(m.training for m in still.modules()) and not any(m.training for m in mixed.modules())
    finally:
        torch.nn.Module.__setattr__ = original
    assert not any(m is s for m in still.modules() for s in sets)
    assert [m.training for m in mixed.modules()] == before and sum(before) == len(list(mixed.model.layers[0].mlp.modules()))
    out = SpeculativeEngine(still, [mixed]).generate([PROMPT], max_new_tokens=4, eos_token_id=[])
    assert len(out.sequences[0]) == 4 and mixed.model.layers[0].mlp.training and not still.training


@pytest.mark.parametrize("drafted", [False, True])
def test_building_and_using_an_engine_leaves_the_model_as_it_was(drafted):
    """Before: q/k/v and gate/up became new Parameters with requires_grad=False (an optimizer built
    earlier held orphans) and the model was left in eval mode."""
    model, draft = llama(seed=7).train(), llama(seed=8).train()
    params = dict(model.named_parameters())
    values = {k: v.detach().clone() for k, v in params.items()}
    flags = {k: v.requires_grad for k, v in params.items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = SpeculativeEngine(model, [draft] if drafted else [])
    engine.generate([PROMPT], max_new_tokens=8, eos_token_id=[])
    assert model.training and draft.training  # eval only during the call
    after = dict(model.named_parameters())
    assert all(after[k] is params[k] for k in params)  # the same objects: the optimizer still holds them
    assert all(after[k].requires_grad == flags[k] for k in params)
    assert all(torch.equal(after[k], values[k]) for k in params)
    # Training through the model still works, and the engine computes with the updated weights.
    loss = model(torch.tensor([PROMPT]), labels=torch.tensor([PROMPT])).loss
    loss.backward()
    optimizer.step()
    assert not torch.equal(params["model.layers.0.self_attn.q_proj.weight"], values["model.layers.0.self_attn.q_proj.weight"])
    fresh = llama(seed=7)  # the updated weights in a model no engine has touched
    fresh.load_state_dict(model.state_dict())
    expected = SpeculativeEngine(fresh, []).generate([PROMPT], max_new_tokens=8, eos_token_id=[]).sequences
    assert engine.generate([PROMPT], max_new_tokens=8, eos_token_id=[]).sequences == expected


# ------------------------------------------------------------------ 9. corrupt files
@pytest.fixture
def saved(tmp_path):
    TARGET.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def test_a_truncated_safetensors_file_is_named_as_corrupt(saved):
    weights = saved / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(ValueError, match=r"corrupt or truncated \(.*model\.safetensors"):
        SpeculativeEngine(str(saved), [], device="cpu")


def test_a_broken_config_is_named_as_corrupt(saved):
    (saved / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt or truncated"):
        SpeculativeEngine(str(saved), [], device="cpu")


@pytest.mark.parametrize("content", [b"GGUF" + bytes(range(256)) * 2, b""])
def test_a_gguf_file_that_does_not_parse_is_named_as_corrupt(tmp_path, content):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"corrupt or truncated \(.*model\.gguf"):
        SpeculativeEngine(str(path), [], device="cpu")


def test_a_saved_encoder_is_refused_as_not_causal(tmp_path):
    BertForMaskedLM(BERT).save_pretrained(tmp_path / "bert")
    with pytest.raises(ValueError, match="not a causal language model"):
        SpeculativeEngine(str(tmp_path / "bert"), [], device="cpu")


@pytest.mark.parametrize("spec", ["ngramm", "Qwen/No-Such-Model-Here"])
def test_a_hub_id_that_cannot_be_fetched_fails_at_once(spec, monkeypatch):
    """Before: 'NGRAM' or a typo was taken for a hub id and retried for about 23 s."""
    import flashspec.models.loading

    monkeypatch.setattr(flashspec.models.loading, "hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(ValueError, match="neither a local folder or file"):
        SpeculativeEngine(TARGET, [spec])
    with pytest.raises(ValueError, match="neither a local folder or file"):
        SpeculativeEngine(spec, [])


@pytest.mark.parametrize("drafters", [[], ["ngram"]])
def test_a_fault_is_raised_even_when_steps_run_ahead_of_the_poll(drafters):
    """With several steps between polls (CUDA's default, sync_every=8), the steps after a faulty
    draw must not index with its id -1 before the poll raises (on CUDA: a device-side assert)."""
    model = llama(seed=3)
    engine = SpeculativeEngine(model, drafters)
    _Poisoned(model, after=3)
    with pytest.raises(ValueError, match="the target's logits are not finite"):
        engine.generate([PROMPT], max_new_tokens=30, do_sample=True, temperature=0.8, eos_token_id=[], sync_every=8)


def test_temperature_none_is_transformers_greedy_convention():
    """transformers accepts ``temperature=None`` with greedy decoding; so does the engine (the value
    is ignored), while sampling still needs a number."""
    engine = SpeculativeEngine(TARGET, [])
    assert greedy(engine, [PROMPT], temperature=None) == greedy(engine, [PROMPT])
    with pytest.raises(ValueError, match="temperature"):
        engine.generate([PROMPT], max_new_tokens=2, do_sample=True, temperature=None)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate([PROMPT], max_new_tokens=2, temperature="hot")
