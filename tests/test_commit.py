"""A step's bookkeeping (flashspec.decode.commit.stage_drafts before verification, commit_step after it):
the engine compiles both on a GPU, where a step is replayed as a CUDA graph, so the compiled
functions must do exactly what the eager ones do — faults, EOS cuts, token budgets, finished
rows, a full log included."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashspec.decode.commit import commit_step, stage_drafts


def _state(batch: int, width: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    capacity = 32
    length = torch.randint(2, 12, (batch,), generator=gen)
    generated = torch.randint(0, 6, (batch,), generator=gen)
    return dict(
        tokens=torch.randint(0, 9, (batch, capacity), generator=gen),
        length=length,
        active=torch.rand(batch, generator=gen) < 0.8,
        generated=generated,
        max_new_tokens=generated + torch.randint(1, 8, (batch,), generator=gen),
        eos=torch.tensor([3, -1]),
        new_tokens=torch.randint(0, 9, (batch, width), generator=gen),
        num_accepted=torch.randint(0, width, (batch,), generator=gen),
        log=torch.zeros(4, 3, dtype=torch.long),
        steps_taken=torch.tensor(seed % 6),  # ≥ 4: the log is full, its last row is overwritten
        logits=torch.randn(batch, width, 5, generator=gen),
        fault=torch.zeros(3, dtype=torch.long),
    )


def _faulty(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Some seeds break a row: non-finite logits (seed % 3 == 1) or a draw without mass (== 2)."""
    row = seed % state["length"].shape[0]
    if seed % 3 == 1:
        state["logits"][row, -1, 0] = float("nan")
    elif seed % 3 == 2:
        state["new_tokens"][row, state["num_accepted"][row]] = -1
    return state


@pytest.mark.parametrize("batch,width", [(1, 1), (1, 5), (4, 2), (6, 9)])
def test_compiled_commit_step_equals_eager(batch, width):
    compiled = torch.compile(commit_step, dynamic=False)
    for seed in range(6):
        eager_state, compiled_state = _faulty(_state(batch, width, seed), seed), _faulty(_state(batch, width, seed), seed)
        commit_step(**eager_state)
        compiled(**compiled_state)
        for name, value in eager_state.items():
            if name != "logits":  # read only (NaN in some: never equal to itself)
                assert torch.equal(value, compiled_state[name]), name


def test_commit_step_cuts_at_eos_and_budget():
    """Row 0 accepts 3 drafts but meets EOS (3) at its second new token; row 1 has one token of
    budget left; row 2 is inactive: nothing changes there."""
    state = dict(
        tokens=torch.zeros(3, 8, dtype=torch.long), length=torch.tensor([2, 2, 2]),
        active=torch.tensor([True, True, False]), generated=torch.tensor([0, 4, 0]),
        max_new_tokens=torch.tensor([9, 5, 9]), eos=torch.tensor([3]),
        new_tokens=torch.tensor([[7, 3, 8, 8], [6, 6, 6, 6], [5, 5, 5, 5]]), num_accepted=torch.tensor([3, 3, 3]),
        log=torch.zeros(2, 3, dtype=torch.long), steps_taken=torch.tensor(0),
        logits=torch.zeros(3, 4, 5), fault=torch.zeros(3, dtype=torch.long),
    )
    commit_step(**state)
    assert state["tokens"][:, 2:5].tolist() == [[7, 3, 0], [6, 0, 0], [0, 0, 0]]
    assert state["length"].tolist() == [4, 3, 2] and state["generated"].tolist() == [2, 5, 0]
    assert state["active"].tolist() == [False, False, False]
    assert state["log"][0].tolist() == [6, 2, 3] and state["steps_taken"].item() == 1
    assert state["fault"].tolist() == [0, 0, 0]


@pytest.mark.parametrize("kind", [1, 2])
def test_commit_step_notes_the_first_fault_of_an_active_row_and_commits_a_faulty_draw_as_zero(kind):
    """Kind 1: row 1's logits hold a NaN; kind 2: its draw found no mass (-1). The fault names
    step + 1, the row and the kind; a -1 is committed as 0; an inactive row's NaN is no fault;
    a later fault does not overwrite the first."""
    state = _state(3, 3, 5)
    state["active"] = torch.tensor([False, True, True])
    state["max_new_tokens"] = state["generated"] + 9
    state["logits"][0, 0, 0] = float("nan")  # inactive row: ignored
    state["num_accepted"] = torch.tensor([0, 1, 2])
    if kind == 1:
        state["logits"][1, 2, 3] = float("inf")
    else:
        state["new_tokens"][1, 1] = -1
    length = int(state["length"][1])
    commit_step(**state)
    assert state["fault"].tolist() == [int(state["steps_taken"]), 1, kind]
    if kind == 2:
        assert int(state["tokens"][1, length + 1]) == 0
    first = state["fault"].clone()
    state["logits"][2, 0, 0] = float("nan")
    commit_step(**state)
    assert torch.equal(state["fault"], first)


@pytest.mark.parametrize("batch,k", [(1, 1), (3, 4)])
def test_stage_drafts_copies_and_zeroes_ids_outside_the_vocabulary_compiled_as_eager(batch, k):
    for fn in (stage_drafts, torch.compile(stage_drafts, dynamic=False)):
        drafts = torch.arange(batch * k).view(batch, k) % 7
        staged = torch.full((batch, k), 99)
        fault = torch.zeros(3, dtype=torch.long)
        active = torch.ones(batch, dtype=torch.bool)
        fn(staged, drafts, 7, active, fault, torch.tensor(4))
        assert torch.equal(staged, drafts) and fault.tolist() == [0, 0, 0]
        bad = drafts.clone()
        bad[-1, -1] = 7
        bad[0, 0] = -2
        active[0] = False  # its bad id is zeroed, but it is no fault
        fn(staged, bad, 7, active, fault, torch.tensor(4))
        assert int(staged[-1, -1]) == 0 and int(staged[0, 0]) == 0
        assert fault.tolist() == ([0, 0, 0] if batch == 1 else [5, batch - 1, 3])


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 6), width=st.integers(1, 9), seed=st.integers(0, 10_000))
def test_commit_step_invariants(batch, width, seed):
    """For any batch and step width (γ + 1): each active row appends a prefix of its new tokens —
    at most num_accepted + 1, at most its remaining budget, ending at the first EOS — and nothing
    else in the buffer changes; inactive rows change nothing; the log entry adds up."""
    state = _state(batch, width, seed)
    before = {name: value.clone() for name, value in state.items()}
    commit_step(**state)
    taken = state["length"] - before["length"]
    assert torch.equal(taken, state["generated"] - before["generated"])
    assert (state["generated"] <= state["max_new_tokens"]).all()
    accepted = torch.where(before["active"], before["num_accepted"], 0)
    row = min(seed % 6, 3)  # where the log entry went (its last row once full)
    assert state["log"][row].tolist() == [int(accepted.sum()), int(before["active"].sum()), int(taken.sum())]
    assert int(state["steps_taken"]) == int(before["steps_taken"]) + 1
    for b in range(batch):
        n, start = int(taken[b]), int(before["length"][b])
        if not before["active"][b]:
            assert n == 0 and not state["active"][b]
            continue
        assert 1 <= n <= min(int(before["num_accepted"][b]) + 1, width)
        written = before["new_tokens"][b, :n]
        assert torch.equal(state["tokens"][b, start:start + n], written)
        assert torch.equal(state["tokens"][b, :start], before["tokens"][b, :start])
        assert torch.equal(state["tokens"][b, start + n:], before["tokens"][b, start + n:])
        eos_at = [j for j, t in enumerate(written.tolist()) if t == 3]
        assert eos_at in ([], [n - 1])  # an EOS can only be the last token committed
        finished = bool(eos_at) or int(state["generated"][b]) >= int(before["max_new_tokens"][b])
        assert bool(state["active"][b]) == (not finished)
