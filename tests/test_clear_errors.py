"""Mistakes a user makes in the Python API get a ValueError that says what is wrong, at
construction or call time, never a TypeError from deep in the loop or a misleading diagnosis."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from tiny_models import tiny_model

from flashspec import SpeculativeEngine
from flashspec.drafters.model import ModelDrafter
from flashspec.drafters.ngram import NgramDrafter

TARGET = tiny_model("llama", seed=0)


@pytest.mark.parametrize("cls, call", [(NgramDrafter, "NgramDrafter()"), (ModelDrafter, "ModelDrafter(...)")])
def test_a_drafter_class_instead_of_an_instance_is_refused_at_construction(cls, call):
    with pytest.raises(ValueError, match=re.escape(f"{cls.__name__} is a class, not a drafter: pass an instance: "
                                                   f"{call}.")):
        SpeculativeEngine(TARGET, [cls])
    assert SpeculativeEngine(TARGET, [NgramDrafter()]).generate([[1, 2, 3]], max_new_tokens=3).sequences


def test_an_empty_folder_or_one_without_a_model_is_named_as_such(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for build in (lambda: SpeculativeEngine(str(empty), []), lambda: SpeculativeEngine(TARGET, [str(empty)])):
        with pytest.raises(ValueError, match="the folder is empty") as caught:
            build()
        assert "corrupt" not in str(caught.value)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match=r"holds no model \(no config.json and weights .* it has notes.txt\)"):
        SpeculativeEngine(str(other), [])
    TARGET.config.save_pretrained(other)  # a config alone: still no weights
    with pytest.raises(ValueError, match=r"holds no model \(no weights"):
        SpeculativeEngine(str(other), [])


@pytest.mark.parametrize("prompt", [[[1.0, 2.0]], [1.0, 2.0], [[1, 2.5]], [np.float32(3.0)],
                                    [torch.tensor([1.0, 2.0])]])
def test_float_token_ids_are_named_as_not_integers(prompt):
    engine = SpeculativeEngine(TARGET, ["ngram"])
    with pytest.raises(ValueError, match="token ids must be integers") as caught:
        engine.generate(prompt, max_new_tokens=3)
    assert "outside the vocabulary" not in str(caught.value)
    with pytest.raises(ValueError, match="integer token ids; got a torch.float32 tensor"):
        engine.generate(torch.tensor([[1.0, 2.0]]), max_new_tokens=3)


@pytest.mark.parametrize("content", [b"hello", b"\xff\xfe\x00binary", b"[1, 2]", b'{"a": 1}',
                                     b'{"default": null, "contexts": {"not json": {}}}', b"[" * 5000])
def test_loading_a_file_that_is_not_a_saved_selection_says_so(tmp_path, content):
    engine = SpeculativeEngine(TARGET, ["ngram", "ngram"], selector="thompson")
    path = tmp_path / "state.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="is not a saved selector state"):
        engine.selection.load(str(path))
    engine.selection.save(str(path))  # a real one still loads
    engine.selection.load(str(path))
    assert json.loads(path.read_text())["default"]["kind"] == "thompson"
