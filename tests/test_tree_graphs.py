"""A tree step's work after the proposals as one CUDA graph per key (SPEC.md §7, "Tree steps are graphs
too"), checked on the CPU as far as a capture can be without a GPU.

:class:`Capturing` stands in for the engine's :class:`~flashspec.models.graphs.Graphs`: every call runs
the step's function (so the output is the real one) while a dispatch mode records each operation it
runs — its name, the shapes and Python values of its arguments, and for each tensor it did not make
itself the storage it reads. A real capture fixes all of that at a key's first call, so every later
call with the key must run the same operations on the same storage: a tensor made outside the function
and read inside (a fresh buffer per step or per call), a Python value that changes between steps of
one key (a shape, a scalar, a branch), a read back to the host, a tensor made from host values or a
random draw inside the function all fail here. Later calls also return the first call's outputs,
overwritten, as a replay does. The mistakes themselves are planted below to show that each is caught.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import flashspec
from flashspec.decode import tree_build, tree_graph, tree_loop
from flashspec.models import graphs as graphs_module
from flashspec.models.graphs import Graphs
from flashspec.select.tree_budget import TreeBudget
from test_tree_decode import NOISY, PROMPT, PROMPTS, TARGET, head_folder, hf_greedy, noisy_model, target_model

NEW = 16
# Operations a CUDA graph cannot hold: reads back to the host (they synchronise, which a capture
# refuses), shapes that depend on values, random draws; and tensors made from host data (below).
FORBIDDEN = ("_local_scalar_dense", "is_nonzero", "aten.item", "aten.equal", "nonzero",
             "masked_select", "unique", "repeat_interleave", "uniform", "normal", "bernoulli", "multinomial",
             "random_", "randint", "randn", "randperm", "aten.rand.", "rand_like", "exponential", "cauchy",
             "geometric", "log_normal")
HOST_READS = ("__bool__", "item", "tolist", "__int__", "__float__", "__index__", "numpy")
_tolist = torch.Tensor.tolist  # the trace reads the host scalars it records with it


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class _Trace(TorchDispatchMode):
    """Every operation a call runs: ``(name, arguments)``, a tensor argument as ``("made", shape, dtype)``
    when an earlier operation of the call made its storage, else as the storage it reads ``("read",
    address, offset, shape, stride, dtype)``; the tensors read are kept alive, so that no later tensor
    can take their address."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, ...]] = []
        self.read: list[torch.Tensor] = []
        self._read: set[int] = set()
        self._made: set[int] = set()
        self.forbidden: list[str] = []

    def _argument(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return type(value).__name__, repr(value)
        if value.numel() == 0:
            return "empty", tuple(value.shape), value.dtype
        address = value.untyped_storage().data_ptr()
        if address in self._made:
            return "made", tuple(value.shape), value.dtype
        if address not in self._read:
            self._read.add(address)
            self.read.append(value)
        return "read", address, value.storage_offset(), tuple(value.shape), value.stride(), value.dtype

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        flat = tree_flatten((args, kwargs))[0]
        masks = name.startswith(("aten.index.", "aten.index_put", "aten._index_put")) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in tree_flatten(args[1])[0])
        # A tensor of host values copied to the device inside the capture (a 0-dim one is a scalar,
        # as in ``x[i] = 0``, which CUDA fills by value).
        host = "lift_fresh" in name and args[0].dim() > 0
        if masks or host or any(word in name for word in FORBIDDEN):  # masks: shapes that depend on values
            self.forbidden.append(name)
        if "lift_fresh" in name:  # host data made a tensor: its values are the argument
            self.ops.append((name, "host", tuple(args[0].shape), repr(_tolist(args[0]))))
        else:
            self.ops.append((name, *(self._argument(a) for a in flat)))
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel():
                address = t.untyped_storage().data_ptr()
                if address not in self._read:
                    self._made.add(address)
        return out


@contextlib.contextmanager
def _no_host_reads():
    """Reading a tensor back to the host raises (a capture would fail on it)."""
    def refuse(self, *args, **kwargs):
        raise AssertionError("the graph's function read a tensor back to the host")

    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, refuse)
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


class Capturing(Graphs):
    """The engine's graphs as a capture fixes them, on the CPU (see the module's docstring): tree keys
    are traced and compared with their first call; other keys (the prefill) are plain calls. Counts a
    capture at each key's first call, as :class:`Graphs` does, so that the step is cold."""

    def __init__(self) -> None:
        super().__init__(enabled=False)
        self.enabled = True
        self.entries: dict[Any, tuple[_Trace, Any]] = {}
        self.captures = 0
        self.replayed: dict[Any, int] = {}  # per key: calls compared with its capture

    def __contains__(self, key) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def run(self, key, fn, warm=False):
        if not (isinstance(key, tuple) and key[0] == "tree"):
            return fn()
        trace = _Trace()
        with _no_host_reads(), trace:
            result = fn()
        assert not trace.forbidden, f"operations a CUDA graph cannot hold: {sorted(set(trace.forbidden))}"
        entry = self.entries.get(key)
        if entry is None:  # the capture: what every replay of this key runs
            graphs_module._count_capture()
            self.captures += 1
            self.entries[key] = (trace, tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, result))
            return result
        captured, outputs = entry
        assert len(trace.ops) == len(captured.ops), (
            f"{len(trace.ops)} operations where the capture ran {len(captured.ops)}: a Python value changed the work")
        for i, (now, then) in enumerate(zip(trace.ops, captured.ops)):
            assert now == then, f"operation {i} differs from the capture's:\n  now:      {now}\n  captured: {then}"
        self.replayed[key] = self.replayed.get(key, 0) + 1
        tree_map(lambda o, r: o.copy_(r) if isinstance(o, torch.Tensor) else None, outputs, result)
        return outputs  # a replay returns the capture's outputs, overwritten

    def run_widths(self, widths, width, key, fn, repeatable=False):
        return fn(width)

    def clear(self) -> None:
        self.entries.clear()

    def replays(self) -> int:
        """Calls of a captured key, compared with its capture."""
        return sum(self.replayed.values())


def capturing_engine(drafters: list, arch: str = "llama", target=None) -> tuple[flashspec.SpeculativeEngine, Capturing]:
    engine = flashspec.SpeculativeEngine(target if target is not None else target_model(arch), drafters, device="cpu")
    engine._graphs = graphs = Capturing()
    return engine, graphs


def three_drafters(arch: str = "llama") -> list:
    return ["ngram", noisy_model(arch), target_model(arch)]


# ---------------------------------------------------------------------------------- the step's work
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tree_steps_replay_what_their_capture_ran(arch):
    """Greedy, drafters [n-gram, noisy copy, the target itself]: a ragged batch and one row, fixed
    draft lengths of two node counts, then ``"auto"`` (whose first step is a probe of the fixed
    lengths (4, 4, 4), with the budget's counts read), on one engine: every call of a key runs what
    its capture ran, on the same buffers, across calls of the engine; the output is the target's
    greedy output; each step that captured, and only those, is cold."""
    engine, graphs = capturing_engine(three_drafters(arch), arch)
    ragged, alone = [list(p) for p in PROMPTS], [list(PROMPTS[2])]
    for call, (prompts, gammas) in enumerate(((ragged, [3, 2, 4]), (ragged, [1, 1, 1]), (ragged, [3, 2, 4]),
                                              (ragged, [4, 4, 4]), (ragged, "auto"), (alone, [3, 2, 4]),
                                              (alone, "auto"))):
        captures = graphs.captures
        out = engine.generate_tree(prompts, max_new_tokens=NEW, gammas=gammas)
        assert out.sequences == [hf_greedy(arch, tuple(p), NEW) for p in prompts], gammas
        cold = [r.cold for r in out.stats.step_log]
        assert sum(cold) == out.stats.cold_steps == graphs.captures - captures, gammas
        assert cold[0] or call in (2, 4)  # a new layout, or rows of a new workspace; not the repeated ones
    nodes = {sum(layout.nodes for layout in key[1]) for key, n in graphs.replayed.items() if n >= 2}
    assert len(nodes) >= 2 and graphs.replays() >= 15


def test_sampled_tree_steps_replay_what_their_capture_ran():
    """Sampled, with laws (a noisy copy) beside point masses (n-gram), T = 0.8 with top-k and top-p:
    the same, and the seeded tokens are those of the same engine without graphs."""
    kwargs = dict(max_new_tokens=NEW, gammas=[2, 3], do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=7,
                  eos_token_id=[])
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:]]
    engine, graphs = capturing_engine(["ngram", NOISY], target=TARGET)
    graphed = [engine.generate_tree(prompts, **kwargs).sequences for _ in range(2)]
    engine._graphs = Graphs(enabled=False)
    assert graphed[0] == graphed[1] == engine.generate_tree(prompts, **kwargs).sequences
    assert graphs.replays() > 10 and any(layout.laws for key in graphs.entries for layout in key[1])


def test_expanded_tree_steps_replay_what_their_capture_ran():
    """A feature head's top-k expansion (its parents and depths staged too, the target's features
    written inside the graph) beside n-gram, greedy: the same, and the target's greedy output."""
    model = target_model("llama")
    engine, graphs = capturing_engine([f"feature:{head_folder(model)}", "ngram"])
    expand = {engine.drafters[0].name: (3, 6)}
    prompts = [list(p) for p in PROMPTS]
    for gammas in ([3, 2], [2, 2], "auto"):
        out = engine.generate_tree(prompts, max_new_tokens=NEW, gammas=gammas, expand=expand)
        assert out.sequences == [hf_greedy("llama", p, NEW) for p in PROMPTS]
    assert graphs.replays() > 10 and any(layout.expanded for key in graphs.entries for layout in key[1])


def test_without_graphs_no_step_is_cold():
    """On the CPU the engine's graphs are plain calls: nothing is captured, no step is cold."""
    engine = flashspec.SpeculativeEngine(target_model("llama"), three_drafters(), device="cpu")
    out = engine.generate_tree([list(p) for p in PROMPTS], max_new_tokens=NEW, gammas=[3, 2, 4])
    assert not engine._graphs.enabled and out.stats.cold_steps == 0
    assert not any(r.cold for r in out.stats.step_log)


class _Uniforms:
    """A drafter that records where each proposal's uniforms lie."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.addresses = inner, inner.name, set()

    def begin(self, batch_size: int) -> None:
        self.inner.begin(batch_size)

    def propose(self, history, num_tokens, params, uniforms):
        self.addresses.add(uniforms.data_ptr())
        return self.inner.propose(history, num_tokens, params, uniforms)


def test_each_drafter_reads_its_uniforms_from_one_buffer():
    """Whatever each step's allocation, a drafter's proposal reads its uniforms (its columns of the
    step's one draw) at one address across steps and calls, so that its own graphs, dropped when what
    they read moves, are kept."""
    from flashspec.drafters.model import ModelDrafter
    from flashspec.drafters.ngram import NgramDrafter

    drafters = [_Uniforms(NgramDrafter()), _Uniforms(ModelDrafter(NOISY, NOISY.config.vocab_size, name="noisy"))]
    engine = flashspec.SpeculativeEngine(TARGET, drafters, device="cpu")
    for gammas in ([2, 3], [4, 1], "auto", [2, 3]):
        engine.generate_tree([PROMPT, PROMPT[:5]], max_new_tokens=NEW, gammas=gammas, do_sample=True, seed=1,
                             eos_token_id=[])
    assert [len(d.addresses) for d in drafters] == [1, 1]


# ---------------------------------------------------------------------------------- the check has power
def _fresh_uniforms(monkeypatch):
    """A new uniforms buffer at every step, as one kept per call rather than with the workspace would
    be at the next call."""
    monkeypatch.setattr(tree_graph.TreeInputs, "uniforms",
                        lambda self, width: torch.zeros(self.batch, width, dtype=torch.float64))


def _unstaged_parts(monkeypatch):
    """The drafters' outputs read in place instead of copied into the layout's buffers."""
    stage = tree_graph.TreeInputs.stage
    monkeypatch.setattr(tree_graph.TreeInputs, "stage",
                        lambda self, drafter, depth, part: (part, stage(self, drafter, depth, part)[1]))


def _host_value(monkeypatch):
    """A Python value of the host that grows at every step (the host's bound on the rows' lengths)
    used inside the graph."""
    work = tree_loop._TreeRun._score_verify_commit_tree
    monkeypatch.setattr(tree_loop._TreeRun, "_score_verify_commit_tree",
                        lambda self, parts, random: work(self, parts, random).clamp(max=10**9 + self.max_length))


def _budget_in_the_read(monkeypatch):
    """What the step reads depends on whether a budget chooses its lengths, which the key does not say:
    the fixed call then the ``"auto"`` call (whose probe has the same layout) differ."""
    work = tree_loop._TreeRun._score_verify_commit_tree

    def packed(self, parts, random):
        values = work(self, parts, random)
        return values if self.budget is not None else values[: 7 + 2 * len(parts)]
    monkeypatch.setattr(tree_loop._TreeRun, "_score_verify_commit_tree", packed)


def _host_tensor(monkeypatch):
    """Chains of unequal lengths whose lengths are a tensor made from a host list inside the graph."""
    def greedy(chains):
        depth = max(c.shape[1] for c in chains)
        padded = torch.stack([torch.nn.functional.pad(c, (0, depth - c.shape[1])) for c in chains], dim=1)
        lengths = torch.tensor([c.shape[1] for c in chains]).expand(padded.shape[0], -1)
        return tree_build.tree_from_chains(padded, lengths, check=False)
    monkeypatch.setattr(tree_loop, "greedy_tree", greedy)


def _host_read(monkeypatch):
    """A value read back inside the graph."""
    work = tree_loop._TreeRun._score_verify_commit_tree
    monkeypatch.setattr(tree_loop._TreeRun, "_score_verify_commit_tree",
                        lambda self, parts, random: work(self, parts, random) if bool(self.active.any()) else None)


MISTAKES = {
    "fresh uniforms": (_fresh_uniforms, "differs from the capture's"),
    "unstaged parts": (_unstaged_parts, "differs from the capture's"),
    "host value": (_host_value, "differs from the capture's"),
    "budget in the read": (_budget_in_the_read, "differs from the capture's|operations where the capture ran"),
    "host tensor": (_host_tensor, "lift_fresh"),
    "host read": (_host_read, "read a tensor back"),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_the_check_catches_a_step_that_a_replay_would_get_wrong(mistake, monkeypatch):
    plant, message = MISTAKES[mistake]
    plant(monkeypatch)
    engine, _ = capturing_engine(three_drafters())
    prompts = [list(p) for p in PROMPTS]
    with pytest.raises(AssertionError, match=message):
        for gammas in ([3, 2, 4], [3, 2, 4], [4, 4, 4], "auto"):  # "auto" unguarded: its first step is the probe
            engine.generate_tree(prompts, max_new_tokens=NEW, gammas=gammas,
                                 **({"slack": None} if gammas == "auto" else {}))


# ---------------------------------------------------------------------------------- the budget
def test_a_cold_step_teaches_the_budget_its_counts_but_not_its_time():
    """A step that captured a graph is recorded (its acceptance counts), but its seconds are not a
    sample of what the allocation costs (SPEC.md §8, "Steady costs only")."""
    budget, warm = TreeBudget([4, 4]), TreeBudget([4, 4])
    for b in (budget, warm):
        for _ in range(3):
            b.observe((4, 0), [[2], [-1]], [3], 1.5, [0.3, 0.0])
    budget.observe((4, 0), [[4], [-1]], [5], 90.0, [0.3, 0.0], timed=False)
    warm.observe((4, 0), [[4], [-1]], [5], 1.5, [0.3, 0.0])
    assert budget.seconds((4, 0)) == pytest.approx(1.5)
    assert budget.survival(0) == warm.survival(0)


# ---------------------------------------------------------------------------------- warm layouts
def test_warm_trees_captures_every_layout_auto_may_choose_before_any_request():
    """After ``warm_trees`` (greedy and sampled), ``gammas="auto"`` calls behind the guard, greedy and
    sampled, capture nothing: every step replays a graph captured in the warm-up; the engine's budget
    is the one it had, and the output is still the target's."""
    from flashspec.decode.tree_warmup import SAMPLED, layouts, warm_trees

    engine, graphs = capturing_engine(["ngram", noisy_model("llama")])
    engine.tree_budget = None
    seconds = warm_trees(engine)
    assert seconds > 0 and engine.tree_budget is None
    assert graphs.captures == len({key for key in graphs.entries}) >= 2 * len(layouts([4, 4])) - 2
    captured = graphs.captures
    prompt = [list(PROMPTS[2])]
    for _ in range(3):
        out = engine.generate_tree(prompt, gammas="auto", max_new_tokens=NEW, eos_token_id=[])
        assert out.sequences == [hf_greedy("llama", PROMPTS[2], NEW)] and out.stats.cold_steps == 0
        sampled = engine.generate_tree(prompt, gammas="auto", max_new_tokens=NEW, eos_token_id=[], seed=1, **SAMPLED)
        assert sampled.stats.cold_steps == 0
    assert graphs.captures == captured and graphs.replays() > 0


def test_warm_trees_does_nothing_without_graphs_and_refuses_bad_batch_sizes():
    from flashspec.decode.tree_warmup import layouts, warm_trees

    engine = flashspec.SpeculativeEngine(target_model("llama"), ["ngram"], device="cpu")
    assert warm_trees(engine) == 0.0 and getattr(engine, "tree_budget", None) is None
    capturing, graphs = capturing_engine(["ngram"])
    with pytest.raises(ValueError, match="batch_sizes"):
        warm_trees(capturing, batch_sizes=[0])
    with pytest.raises(ValueError, match="extra allocations"):
        warm_trees(capturing, extra=[(65,)])
    warm_trees(capturing, sampling=[{}], extra=[(3,), (6,)])  # no candidates of γ_max 4 (0, 1, 2, 4)
    assert {sum(layout.depth for layout in key[1]) for key in graphs.entries} == {0, 1, 2, 3, 4, 6}
    assert layouts([2]) == [(0,), (1,), (2,)]
    many = layouts([8, 8, 8, 8, 8])  # 5⁵ candidates: too many to evaluate, so each drafter alone
    assert many[0] == (0,) * 5 and (8,) * 5 in many and (0, 0, 4, 0, 0) in many and len(many) == 2 + 5 * 4
