"""What the distillation tests share: ShareGPT-format files written by hand (cut off like the
registry's copy), character tokenizers with role-aware chat templates, and a generate spy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tiny_models import CharTokenizer

from flashspec.data.sharegpt import part_of
from flashspec.engine import SpeculativeEngine

RECORDED = "SHAREGPT-ANSWER"  # the answers the file records: never part of a context or a sample


class RoleChatTokenizer(CharTokenizer):
    """One token per character and the template ``<u>user</u><a>answer</a>``, generation prompt
    ``<a>``: earlier turns render unchanged, so a conversation stays one sample."""

    chat_template = "<u>{user}</u><a>{assistant}</a>"

    def render(self, message: dict[str, str], last: bool) -> str:
        tag = "u" if message["role"] == "user" else "a"
        return f"<{tag}>{message['content']}</{tag}>"

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = False,
                            tokenize: bool = True) -> Any:
        text = "".join(self.render(m, i == len(messages) - 1) for i, m in enumerate(messages))
        text += "<a>" if add_generation_prompt else ""
        return self(text)["input_ids"] if tokenize else text


class RewritingChatTokenizer(RoleChatTokenizer):
    """A template that renders earlier answers shortened to 2 characters (as templates that drop
    earlier reasoning do): a turn's context no longer extends the previous sample."""

    def render(self, message: dict[str, str], last: bool) -> str:
        if message["role"] == "assistant":
            return f"<a>{message['content'][:2]}</a>"
        return super().render(message, last)


def keys(count: int, part: str | None = None, start: int = 0) -> list[str]:
    """``count`` ShareGPT-like ids (``"kN_0"``), all of ``part`` (:func:`part_of`) when given."""
    out, n = [], start
    while len(out) < count:
        key = f"k{n}_0"
        if part is None or part_of(key) == part:
            out.append(key)
        n += 1
    return out


def record(key: str, questions: list[str]) -> dict[str, Any]:
    """A ShareGPT record: each question a human turn followed by a recorded gpt answer."""
    turns = []
    for question in questions:
        turns += [{"from": "human", "value": question}, {"from": "gpt", "value": RECORDED}]
    return {"id": key, "conversations": turns}


def write_sharegpt(path: Path, records: list[dict[str, Any]], cut: int = 0) -> Path:
    """``records`` as an indented JSON list, its last ``cut`` characters removed (a cut-off tail)."""
    text = json.dumps(records, indent=2)
    path.write_text(text[: len(text) - cut] if cut else text)
    return path


class Stopped(Exception):
    """What a spy raises to stop a run midway."""


class GenerateSpy:
    """Counts ``SpeculativeEngine.generate`` calls and keeps their prompts and outputs; with
    ``fail_at``, the call of that number (from 1) raises :class:`Stopped`, as an interrupted run.
    A new spy replaces the one before."""

    def __init__(self, monkeypatch: Any, fail_at: int | None = None) -> None:
        self.calls: list[tuple[list[list[int]], list[list[int]]]] = []
        self.fail_at = fail_at
        original = getattr(SpeculativeEngine.generate, "unspied", SpeculativeEngine.generate)

        def generate(engine: Any, prompts: Any, **kwargs: Any) -> Any:
            if self.fail_at is not None and len(self.calls) + 1 == self.fail_at:
                raise Stopped
            out = original(engine, prompts, **kwargs)
            self.calls.append(([list(p) for p in prompts], [list(s) for s in out.sequences]))
            return out

        generate.unspied = original
        monkeypatch.setattr(SpeculativeEngine, "generate", generate)
