"""Conversations answered turn by turn by the target itself: training samples in its own words.

A drafter learns the law of the text it will draft, and at inference that is the target's text,
in contexts that hold the target's own earlier answers. So every user turn of a conversation is
answered by the target, and the next turn is built on *its* answer, never on the answer the
conversation's source recorded (ShareGPT's, another model's): turn 1 is answered, then turn 2's
context is the chat template over ``[user 1, target's answer 1, user 2]``, and so on.

Answers come from :meth:`SpeculativeEngine.generate` target-only, many rows per call: rows are
filled from a pool of conversations (a conversation that ends makes room for the next one), and
each answer stops at the target's EOS or after ``max_new_tokens``. A conversation ends after
``max_turns`` answers, or at the first turn whose context exceeds ``max_context`` tokens.

Each answered turn adds its context and answer to a :class:`Sample`, with a loss mask that is 1
exactly on the answer's tokens (its EOS included). Where the chat template renders the earlier
turns unchanged, a turn's context starts with the previous sample, and the sample grows in
place: one sample per conversation. Where it does not (a template that rewrites earlier
answers), the turn starts a new sample, so that every sample is a context the target really saw.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..data.corpus import chat_ids

__all__ = ["Item", "Sample", "Tally", "answer_items", "chat_ids", "derived_seed"]


@dataclass(frozen=True)
class Item:
    """One thing to answer: a conversation's user turns (``turns``), or a fixed, already
    tokenized prompt answered once (``prompt``: a corpus request)."""

    key: str
    turns: tuple[str, ...] = ()
    prompt: tuple[int, ...] | None = None


@dataclass
class Sample:
    """Token ids of a context and the target's answers in it; ``mask[i]`` is 1 where ``ids[i]`` is
    a token the target answered. ``item``: the index of the :class:`Item` it came from."""

    ids: list[int]
    mask: list[int]
    item: int


@dataclass
class Tally:
    """What answering did: answers, their tokens, answers cut by ``max_new_tokens`` before an EOS,
    items answered at least once, items skipped (a first context over ``max_context``), calls."""

    answers: int = 0
    answer_tokens: int = 0
    cut: int = 0
    conversations: int = 0
    skipped: int = 0
    calls: int = 0


@dataclass
class _State:
    item: Item
    index: int  # the item's place in the list answered
    messages: list[dict[str, str]] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    answered: int = 0


def derived_seed(*parts: Any) -> int:
    """A seed in ``[0, 2**63)`` that depends on ``parts`` only: each generate call of a shard gets
    its own, so a shard made again draws what it drew the first time."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big") >> 1


def answer_items(
    engine: Any, items: Sequence[Item], *, max_turns: int, max_context: int, max_new_tokens: int, batch: int,
    temperature: float = 0.0, seed: int = 0, on_answers: Callable[[int, int, int], None] | None = None,
) -> tuple[list[Sample], Tally]:
    """Answer every turn of ``items`` with ``engine`` (target-only; see the module's docstring);
    return the samples, in item order, and a :class:`Tally`. ``on_answers(answers, tokens, done)``
    is called after each generate call, ``done`` counting the items finished since the last call
    (a progress bar)."""
    tokenizer = engine.tokenizer
    eos = set(_eos(engine))
    states = [_State(item, i) for i, item in enumerate(items)]
    tally = Tally()
    waiting, running = deque(range(len(items))), deque()
    while waiting or running:
        rows: list[tuple[int, list[int]]] = []
        done = 0
        while len(rows) < batch and (running or waiting):
            index = running.popleft() if running else waiting.popleft()
            prompt = _next_prompt(states[index], tokenizer, max_turns, max_context)
            if prompt is not None:
                rows.append((index, prompt))
                continue
            done += 1
            tally.skipped += states[index].answered == 0
        if not rows:
            if on_answers is not None:
                on_answers(0, 0, done)
            break
        sampled = temperature > 0
        out = engine.generate([prompt for _, prompt in rows], max_new_tokens=max_new_tokens, do_sample=sampled,
                              temperature=temperature if sampled else 1.0,
                              seed=derived_seed(seed, tally.calls) if sampled else None)
        tally.calls += 1
        tokens = 0
        for (index, prompt), answer in zip(rows, out.sequences):
            _record(states[index], prompt, list(answer), eos, tokenizer, tally)
            tokens += len(answer)
            running.append(index)
        if on_answers is not None:
            on_answers(len(rows), tokens, done)
    tally.conversations += sum(1 for state in states if state.answered)
    return [sample for state in states for sample in state.samples], tally


def _eos(engine: Any) -> list[int]:
    from ..decode.request import eos_ids

    return eos_ids(None, engine.target, engine.vocab_size)


def _next_prompt(state: _State, tokenizer: Any, max_turns: int, max_context: int) -> list[int] | None:
    """The context of the item's next turn, or None when it is done."""
    item = state.item
    if item.prompt is not None:
        prompt = list(item.prompt) if state.answered == 0 else None
    elif state.answered < min(max_turns, len(item.turns)):
        user = {"role": "user", "content": item.turns[state.answered]}
        prompt = chat_ids(tokenizer, [*state.messages, user])
    else:
        prompt = None
    if prompt is None or len(prompt) > max_context:
        return None
    return prompt


def _record(state: _State, prompt: list[int], answer: list[int], eos: set[int], tokenizer: Any, tally: Tally) -> None:
    """Add one answered turn: the conversation's messages (the answer as text, for the next turn's
    template) and its sample (grown in place when the context extends the previous sample)."""
    ended = bool(answer) and answer[-1] in eos
    tally.answers += 1
    tally.answer_tokens += len(answer)
    tally.cut += not ended
    if state.item.prompt is None:
        text = tokenizer.decode(answer[:-1] if ended else answer, skip_special_tokens=True)
        user = {"role": "user", "content": state.item.turns[state.answered]}
        state.messages += [user, {"role": "assistant", "content": text}]
    state.answered += 1
    last = state.samples[-1] if state.samples else None
    if last is not None and len(prompt) >= len(last.ids) and prompt[: len(last.ids)] == last.ids:
        tail = prompt[len(last.ids):]
        last.ids += tail + answer
        last.mask += [0] * len(tail) + [1] * len(answer)
    else:
        state.samples.append(Sample(prompt + answer, [0] * len(prompt) + [1] * len(answer), state.index))
