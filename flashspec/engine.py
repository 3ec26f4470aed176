"""``SpeculativeEngine``: build an engine from a target and drafters, and ``generate``.

The engine owns what lasts across calls — the models behind their caches, the arms, the
learning state, the device buffers and CUDA graphs. A call is parsed into a
:class:`~flashspec.decode.request.Request`, handed to the decode loop (:mod:`flashspec.decode.loop`)
as an explicit :class:`~flashspec.decode.workspace.Plan` (:meth:`SpeculativeEngine.plan`, which the
running batch of :mod:`flashspec.decode.batch` uses too), and returned as a
:class:`GenerationOutput`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from .checks import check_flag, check_int
from .decode.chunks import check_chunking
from .decode.commit import commit_step, stage_drafts
from .decode.loop import decode
from .decode.request import MAX_TOKENS_WITHOUT_WINDOW, Request, parse_engine_options, parse_request
from .decode.tree_loop import decode_tree
from .decode.warmup import warm_up
from .decode.workspace import Plan, Workspace, workspace_shape
from .drafters.base import Drafter, features_read
from .drafters.feature import FeatureDrafter
from .drafters.model import ModelDrafter
from .drafters.shallow import ShallowDrafter, check_reuse
from .drafters.specs import make_drafter
from .models.cached import make_lm
from .models.graphs import Graphs
from .models.loading import context_window, eval_mode
from .models.parallel import TensorParallel, tensor_parallel_of
from .models.static import StaticLM
from .models.target import load_target
from .select import Selection, Selector
from .select.guard import DEFAULT_SLACK, CostMemory, Guard, check_slack
from .stats import DrafterStats, GenerationOutput, GenerationStats
from .verify import check_acceptance

__all__ = ["SpeculativeEngine", "GenerationOutput", "GenerationStats", "Selection"]

AUTO = "auto"  # the default selector: AUTO_SELECTOR over the arms plus the target-only arm, guarded
AUTO_SELECTOR = "thompson"
# Captured steps a running batch keeps at once (one per draft length and set of sampling parameters
# in the batch); past it every graph is dropped and captured again as the sets recur.
BATCH_GRAPHS = 32


class SpeculativeEngine:
    """Exact speculative decoding of ``target`` with one or more drafters (SPEC.md).

    Args:
        target: a loaded transformers causal LM, or a local folder, hub id or ``.gguf`` file.
        drafters: a drafter or a list of them; each is a loaded model, a path / hub id /
            ``.gguf`` file, ``"ngram"``, ``"early-exit:N"`` (the target's first N layers, SPEC.md
            §11), ``"feature:DIR"`` or ``"shallow:DIR"`` (trained drafters made from the target,
            ``flashspec train-drafter``) or a :class:`~flashspec.drafters.Drafter`. Empty means
            plain target-only decoding through the same loop.
        selector: how an arm — a (drafter, γ) pair — is chosen each step: ``"auto"`` (the
            default: Thompson sampling on throughput over every arm plus the target-only arm,
            guarded so that no request gets more than ``slack`` slower than the target alone;
            SPEC.md §8), ``"fixed"`` (the first arm), ``"ucb1"``, ``"thompson"``,
            ``"discounted-ucb"``, ``"sliding-window-ucb"``, ``"epsilon-greedy"``, ``"request"``
            (each request's own best arm, its context's past as a prior), or a selector
            object (:mod:`flashspec.select`). ``selector_options`` go to the named selector's
            class (e.g. ``{"reward": "acceptance", "seed": 0}``).
        target_only: add the arm "no drafting" (``"target@0"``, γ = 0) after the drafter arms.
            Default: with ``selector="auto"`` only. Needs ``reward="throughput"``.
        slack: with a target-only arm, the guard's δ: a step may draft only while the request
            stays within this fraction (plus one target step) of the target alone's time
            (SPEC.md §8); ``"auto"`` (default) is 0.01 with a target-only arm and no guard
            without one; ``None`` turns the guard off.
        gammas: draft lengths to choose among; the arms are every (drafter, γ) pair, drafter
            first. ``None``: one arm per drafter, with ``generate``'s ``num_draft_tokens``.
        share_selector: ``True`` (default) — the selector learns across requests (one state
            per ``generate(context=...)`` value); ``False`` — each request starts afresh.
        tokenizer: a tokenizer or a path; needed for string prompts. Loaded from ``target``
            when ``target`` is a path and this is None.
        device, dtype: where and in which precision to load models given as paths
            (default: CUDA if available else CPU; bfloat16 on CUDA, float32 on CPU).
        compile: run decode-step forwards of Llama-family models through ``torch.compile``
            (fuses small kernels; pays off on a GPU after a one-off compilation per shape), the
            proposals of feature drafters too, and on a GPU the step's bookkeeping before and
            after verification (:func:`stage_drafts`, :func:`commit_step`).
        reuse_shallow: ``True`` — at the steps a ``"shallow:DIR"`` drafter drafts, the target's
            verify forward does not recompute its first ``N`` layers for the positions that drafter
            already fed through them, but starts from its states (LayerSkip-style; SPEC.md §11,
            verify reuse). Exact in exact arithmetic and token for token equal in float32 tests,
            but in bfloat16 the logits may differ from the verify without reuse in the last bits
            (one-token forwards round differently from a ``(k+1)``-token one), so it is off by
            default. Needs a shallow drafter and one device (no tensor parallelism).
        bit_exact: ``True`` — the target's decode forwards give a position bit-identical logits
            whether they feed one token or ``γ + 1`` per sequence and whatever else the batch
            holds (SPEC.md §14), so greedy output equals target-only greedy output token for
            token in bfloat16 too, not only in float32. Llama, Qwen2, Qwen3 and Mistral targets in 16
            bits on a CUDA GPU with Triton; elsewhere ``ValueError`` says why. Off by default: its one-token
            forwards are slower (target-only decoding at 0.82–0.93× of the default's tokens/s on an
            H100, BENCHMARKS.md, "Exactness").
        max_length: prompt + new tokens of one row that the buffers hold. Where shapes are
            compiled or captured (CUDA graphs, ``compile=True``) they are sized to it once, so no
            request of another length compiles (SPEC.md §7, "Warm shapes"; a longer request grows
            them, once); default: the model's context window, at most 4096. Elsewhere (a CPU
            without ``compile``) the buffers follow each request and it is not used.
        warmup: compile and capture every arm's shapes now (greedy and sampled, alone and after
            gaps), with a progress bar, so that no request pays for it (``engine.warmup_seconds``
            says what it took); default: where steps replay as CUDA graphs (a Llama, Qwen2, Qwen3
            or Mistral target on a CUDA GPU).
        warmup_batch_sizes: the numbers of prompts per call to warm up (default ``(1,)``); where
            shapes are fixed a call of ``B`` prompts runs over ``2^⌈log₂ B⌉`` rows.
        acceptance: ``"token"`` (default: each draft tested alone, SPEC.md §2 step 4) or ``"block"``
            (the drafted block verified jointly: the same law, never fewer drafts kept in expectation).
        block_size: None (default) or the drafts per chunk, each scored while the next is drafted (SPEC.md §2).
    """

    def __init__(
        self,
        target: PreTrainedModel | str,
        drafters: Any = (),
        *,
        selector: str | Selector = AUTO,
        selector_options: dict[str, Any] | None = None,
        target_only: bool | None = None,
        slack: float | str | None = "auto",
        gammas: Sequence[int] | None = None,
        share_selector: bool = True,
        tokenizer: Any = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        compile: bool = False,
        reuse_shallow: bool = False,
        bit_exact: bool = False,
        max_length: int | None = None,
        warmup: bool | None = None,
        warmup_batch_sizes: Sequence[int] = (1,),
        acceptance: str = "token",
        block_size: int | None = None,
    ) -> None:
        self.acceptance = check_acceptance(acceptance)
        check_flag("reuse_shallow", reuse_shallow)
        check_flag("bit_exact", bit_exact)
        if warmup is not None:
            check_flag("warmup", warmup)
        if not isinstance(warmup_batch_sizes, (list, tuple)) or not warmup_batch_sizes:
            raise ValueError(f"warmup_batch_sizes must be a non-empty list of batch sizes; got {warmup_batch_sizes!r}.")
        for rows in warmup_batch_sizes:
            check_int("warmup_batch_sizes", rows, 1, 1024)
        self.reuse_shallow = reuse_shallow
        options = parse_engine_options(
            drafters=drafters, gammas=gammas, selector_options=selector_options, share_selector=share_selector,
            tokenizer=tokenizer, device=device, dtype=dtype, compile=compile, block_size=block_size)
        self.device, self.compile = options.device, options.compile
        self.target, self.tokenizer, self._no_tokenizer = load_target(target, tokenizer, self.device, options.dtype)
        # Tensor parallelism (flashspec.models.parallel, SPEC.md §9): every rank runs this same loop;
        # the few places that must agree across ranks check self._tp.
        self._tp = tensor_parallel_of(self.target)
        self.block_size = check_chunking(options.block_size, tensor_parallel=self._tp, reuse_shallow=reuse_shallow)
        self.vocab_size: int = self.target.config.vocab_size
        self._target_lm = make_lm(self.target, compile=self.compile)  # drafters made from the target use it
        if bit_exact:
            if not isinstance(self._target_lm, StaticLM):
                raise ValueError(f"bit_exact=True needs a target of architecture {', '.join(StaticLM.ARCHITECTURES)}; "
                                 f"this one is {self.target.config.model_type!r}.")
            self._target_lm.bit_exact = True  # ValueError saying why where it cannot hold (SPEC.md §14)
        self.drafters: list[Drafter] = [
            make_drafter(d, target=self.target, target_lm=self._target_lm, device=self.device, dtype=options.dtype,
                         compile=self.compile, reuse_shallow=reuse_shallow) for d in options.drafters]
        names: set[str] = set()
        for i, d in enumerate(self.drafters):  # statistics are kept by name: make names unique
            if d.name in names:
                d.name = f"{d.name}#{i}"
            names.add(d.name)
        if reuse_shallow:
            check_reuse(self.drafters, self._tp)
        # The layer counts after which drafters read the target's features (SPEC.md §11).
        self._feature_layers = features_read(self.drafters, getattr(self.target.config, "num_hidden_layers", None))
        gammas = options.gammas
        # Arms: (drafter index, γ or None for generate's num_draft_tokens); the target-only arm is
        # (None, 0), last (SPEC.md §8).
        self.arms: list[tuple[int | None, int | None]] = [
            (d, g) for d in range(len(self.drafters)) for g in (gammas if gammas is not None else [None])
        ]
        self.slack = self._target_only_arm(selector, target_only, slack, options.selector_options)
        # What each arm's step and each drafter's catch-up cost, in target-only steps, as the
        # guards of recent requests measured them: the next request's guard starts from these
        # instead of its cautious priors (SPEC.md §8, "What carries over").
        self.costs = CostMemory()
        self.share_selector = options.share_selector
        self.selection = self.new_selection(selector, **options.selector_options)
        static_on_gpu = isinstance(self._target_lm, StaticLM) and self.target.device.type == "cuda"
        self._graphs = Graphs(enabled=static_on_gpu)
        # A step's bookkeeping after verification (commit, stop flags, log) is about 25 tiny
        # kernels; compiled, inductor fuses them into a few. Only where the step is replayed as a
        # CUDA graph: elsewhere the compiled function's guards would cost more host time per step.
        self._commit_step, self._stage_drafts = commit_step, stage_drafts
        if self.compile and static_on_gpu:
            self._commit_step = torch.compile(commit_step, dynamic=False)
            self._stage_drafts = torch.compile(stage_drafts, dynamic=False)
        self._buffers: Workspace | None = None
        # Queue the next step before a poll waits for its read-back, so that the device does not
        # idle while the host reads the log and launches the next graphs (SPEC.md §7). On a CPU
        # nothing runs ahead, and a step queued after the last row finished would be wasted work.
        self.queue_ahead = self.device.type == "cuda"
        # One generate at a time: calls share the workspace, caches and graphs (SPEC.md §5).
        self._generating = threading.Lock()
        # Fixed shapes where they are compiled or captured (SPEC.md §7, "Warm shapes").
        self.fixed_shapes = static_on_gpu or (self.compile and isinstance(self._target_lm, StaticLM))
        window = context_window(self.target.config) or MAX_TOKENS_WITHOUT_WINDOW
        if max_length is None:
            max_length = min(window, 4096) if self.fixed_shapes else 2
        self.max_length = check_int("max_length", max_length, 2, window, upto=f"the context window ({window})")
        self.warmup_seconds = 0.0
        if warmup if warmup is not None else static_on_gpu:
            self.warmup_seconds = warm_up(self, tuple(warmup_batch_sizes))

    def _target_only_arm(self, selector: Any, target_only: Any, slack: Any, selector_options: dict[str, Any]
                         ) -> float | None:
        """Append the target-only arm when asked for (by default with ``selector="auto"``);
        return the guard's slack (None: no guard). SPEC.md §8."""
        if target_only is None:
            target_only = isinstance(selector, str) and selector == AUTO
        if not isinstance(target_only, bool):
            raise ValueError(f"target_only must be True, False or None (default: with selector='auto'); "
                             f"got {target_only!r}.")
        if isinstance(slack, str) and slack == "auto":
            slack = DEFAULT_SLACK if target_only else None
        slack = check_slack(slack)
        if slack is not None and not target_only:
            raise ValueError("slack guards a request against drafting that loses by switching to the target-only "
                             "arm: pass target_only=True too (or use selector='auto').")
        if target_only and self.arms:
            if selector_options.get("reward", "throughput") != "throughput":
                raise ValueError("A target-only arm needs reward='throughput': an acceptance rate cannot compare "
                                 "drafting with not drafting.")
            self.arms.append((None, 0))
        return slack if self.arms else None

    # What flashspec.calibrated_engine chose (flashspec.tuning.auto.Choice), or None for an
    # engine configured by hand.
    choice: Any = None
    # generate_tree(gammas="auto")'s flashspec.select.tree_budget.TreeBudget, made at its first call
    # and kept so that it learns across calls; assign one to set its γ_max or options (SPEC.md §7).
    tree_budget: Any = None

    @property
    def bit_exact(self) -> bool:
        """Whether the target's decode forwards run in bit-exact mode (SPEC.md §14)."""
        return isinstance(self._target_lm, StaticLM) and self._target_lm.bit_exact

    @property
    def arm_costs(self) -> Mapping[int, float]:
        """Per arm, its steady step cost in target-only steps carried to the next request's guard."""
        return self.costs.arm_costs

    @property
    def catch_up_costs(self) -> Mapping[tuple[int, int], float]:
        """Per ``(drafter, width class)``, its catch-up cost carried to the next request's guard."""
        return self.costs.catch_up_costs

    @property
    def target_lm(self) -> Any:
        """The target behind FlashSpec's cache (:class:`~flashspec.models.static.StaticLM` or
        :class:`~flashspec.models.cached.CachedLM`), which drafters made from the target share."""
        return self._target_lm

    @property
    def tensor_parallel(self) -> TensorParallel | None:
        """The target's tensor-parallel group (SPEC.md §9), or None on one device."""
        return self._tp

    @property
    def target_only_arm(self) -> int | None:
        """The index of the target-only arm, or None when the engine has none."""
        return next((a for a, (d, _) in enumerate(self.arms) if d is None), None)

    # ------------------------------------------------------------------ learning state
    def arm_label(self, arm: int, num_draft_tokens: int | None = None) -> str:
        """``"drafter@γ"`` for arm ``arm``."""
        d, g = self.arms[arm]
        if d is None:
            return "target@0"
        return f"{self.drafters[d].name}@{g if g is not None else num_draft_tokens}"

    def new_selection(self, selector: str | Selector = "fixed", **options: Any) -> Selection:
        """A fresh learning state for this engine's arms (a selector name with its class's
        options, or an object); install it with ``engine.selection = ...`` (SPEC.md §8)."""
        if isinstance(selector, str) and selector == AUTO:
            selector = AUTO_SELECTOR
        if self._tp is not None and isinstance(selector, str) and options.get("seed") is None:
            options["seed"] = self._tp.shared_seed()  # every rank must choose the same arms
        return Selection(selector, len(self.arms), share=self.share_selector, **options)

    @property
    def selection(self) -> Selection:
        """The learning state later requests use and update: ``save(path)`` / ``load(path)``
        keep it across restarts; assign another :class:`Selection` (from :meth:`new_selection`,
        or one taken from here earlier) to switch."""
        return self._selection

    @selection.setter
    def selection(self, selection: Selection) -> None:
        if not isinstance(selection, Selection):
            raise ValueError(f"engine.selection must be a Selection (engine.new_selection(...)); "
                             f"got {type(selection).__name__}.")
        if selection.num_arms != len(self.arms):
            raise ValueError(f"That selection has {selection.num_arms} arm(s); this engine has {len(self.arms)}: "
                             "it belongs to an engine with a different set of arms.")
        self._selection = selection

    # ------------------------------------------------------------------ generate
    @torch.inference_mode()
    def generate(
        self,
        input_ids: Any,
        *,
        attention_mask: Any = None,
        max_new_tokens: int = 32,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        num_draft_tokens: int = 4,
        eos_token_id: int | Sequence[int] | None = None,
        seed: int | None = None,
        progress: bool = False,
        sync_every: int | None = None,
        context: Hashable = None,
    ) -> GenerationOutput:
        """Generate up to ``max_new_tokens`` per row; the output law is exactly the target's.

        ``sync_every``: check for finished rows (a device-to-host read) every this many steps;
        default 1 on the CPU, 8 on CUDA. Steps after every row finished do no harm but cost time.
        ``context``: a hashable label of the request (a domain, a route); with a learning
        selector, each label gets its own selector state.

        Calls from several threads are serialised: each waits for the one before to finish.
        """
        with self.session():  # concurrent calls wait for one another
            return self._generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                  do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                                  num_draft_tokens=num_draft_tokens, eos_token_id=eos_token_id, seed=seed,
                                  progress=progress, sync_every=sync_every, context=context)

    def _generate(self, input_ids: Any, *, progress: Any, **arguments: Any) -> GenerationOutput:
        check_flag("progress", progress)
        if self.tokenizer is None and (isinstance(input_ids, str) or (
                isinstance(input_ids, (list, tuple)) and input_ids and isinstance(input_ids[0], str))):
            raise ValueError(f"String prompts need a tokenizer: {self._no_tokenizer}.")
        request = self.parse(input_ids, **arguments)
        stats = GenerationStats(
            per_drafter={d.name: DrafterStats() for d in self.drafters},
            per_arm={self.arm_label(a, request.num_draft_tokens): DrafterStats() for a in range(len(self.arms))},
        )
        if request.max_new_tokens == 0:
            return self._output([[] for _ in request.rows], stats)
        plan = self.plan(rows=len(request.rows), length=request.longest + request.max_new_tokens,
                         num_draft_tokens=request.num_draft_tokens, num_eos=len(request.eos), context=request.context)
        sequences = decode(plan, request, stats, progress=progress)
        if plan.guard is not None:
            self.costs.learn(plan.guard)
        return self._output(sequences, stats)

    def generate_tree(self, input_ids: Any, *, gammas: Sequence[int] | str | None = None,
                      expand: Mapping[str, Any] | None = None, **options: Any) -> GenerationOutput:
        """Decode with one draft tree per step of every drafter's chain (``gammas``: one γ per drafter, or
        ``"auto"``: chosen per step for ``context`` by :attr:`tree_budget`), verified exactly in one target
        forward; ``expand={name: TreeExpansion(topk, nodes)}``: a feature or EAGLE-3 head's part is an
        EAGLE-2 top-k expansion of depth γ. ``options``: :meth:`generate`'s but ``progress`` and
        ``sync_every``; ``stats.per_drafter`` counts each branch's committed tokens (SPEC.md §7)."""
        with self.session():
            return decode_tree(self, input_ids, gammas=gammas, expand=expand, **options)

    # ------------------------------------------------------------------ continuous batching
    def batch(self, *, slots: int = 8, max_length: int | None = None, num_draft_tokens: int = 4,
              eos_token_id: int | Sequence[int] | None = None) -> Any:
        """A running batch that requests join and leave at step boundaries (continuous
        batching, SPEC.md §12): ``add(prompt, **sampling) -> handle``, ``step() -> updates``,
        ``cancel(handle)``. It holds the engine until closed (use it as a context manager).
        See :class:`flashspec.decode.batch.Batch`."""
        from .decode.batch import Batch

        return Batch(self, slots=slots, max_length=max_length, num_draft_tokens=num_draft_tokens,
                     eos_token_id=eos_token_id)

    def warmup(self, *, slots: int = 8, max_length: int | None = None, num_draft_tokens: int = 4,
               prompt_lengths: Sequence[int] = (1,)) -> float:
        """Touch every shape a server with these settings uses — a prefill of each of
        ``prompt_lengths`` and one step of every arm at the batch's fixed slots and capacity —
        so that no request pays lazy initialisation or compilation; returns the seconds taken.
        On a CPU without ``compile`` there is nothing to compile or capture."""
        with self.batch(slots=slots, max_length=max_length, num_draft_tokens=num_draft_tokens) as batch:
            return batch.warmup(prompt_lengths)

    def parse(self, input_ids: Any, **arguments: Any) -> Request:
        """``generate``'s prompt and keywords (all of them but ``progress``) checked against this
        engine's target, drafters and device, as a :class:`~flashspec.decode.request.Request`
        (SPEC.md §5: a ``ValueError`` names what is wrong)."""
        return parse_request(input_ids, **arguments, target=self.target, tokenizer=self.tokenizer,
                             drafter_models=[d.model for d in self.drafters if isinstance(d, ModelDrafter)],
                             gammas=[g for d, g in self.arms if d is not None], device=self.device)

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Hold the engine — one ``generate`` or running batch at a time: they share the
        workspace, caches and graphs (SPEC.md §5) — with its models in eval mode."""
        models = [self.target] + [d.model for d in self.drafters if isinstance(d, ModelDrafter)]
        with self._generating, eval_mode(*models):
            yield

    def arm_gammas(self, num_draft_tokens: int) -> list[int]:
        """Each arm's draft length: its own γ, else ``num_draft_tokens``; 0 for the target-only arm."""
        return [0 if d is None else g or num_draft_tokens for d, g in self.arms]

    def plan(self, *, rows: int, length: int, num_draft_tokens: int, num_eos: int, context: Hashable = None,
             running_batch: bool = False) -> Plan:
        """What a decode loop over ``rows`` rows of up to ``length`` tokens (prompt + new) needs:
        arms resolved, buffers shaped, the selector of ``context``, a fresh guard (SPEC.md §7, §8).
        ``running_batch``: for :class:`~flashspec.decode.batch.Batch` — buffers and graphs of its own
        (a bounded number of graphs), no tensor parallelism, nothing queued ahead (SPEC.md §12).
        Call it while holding :meth:`session`."""
        gammas = self.arm_gammas(num_draft_tokens)
        gamma = max(gammas, default=num_draft_tokens)
        if self.fixed_shapes and not running_batch:
            rows = 1 << (rows - 1).bit_length()  # a power of two: few distinct shapes
            self.max_length = length = max(self.max_length, length)  # a longer request grows them, once
        shape = workspace_shape(rows, length, gamma, num_eos, self.target.config.hidden_size, self._feature_layers)
        if running_batch:
            if self._tp is not None:
                raise ValueError("Continuous batching does not support tensor-parallel targets yet.")
            if self._target_lm.reset(rows, shape[1]):
                self._graphs.clear()
                self._buffers = None
            workspace = Workspace(*shape, self.target.device, dtype=self.target.dtype)
            graphs = Graphs(enabled=self._graphs.enabled, limit=BATCH_GRAPHS)
        else:
            workspace, graphs = self._workspace(shape), self._graphs
        return Plan(
            target=self._target_lm,
            drafters=self.drafters,
            arm_drafters=[d for d, _ in self.arms],
            arm_gammas=gammas,
            labels=[self.arm_label(a, num_draft_tokens) for a in range(len(self.arms))],
            selector=self.selection.for_request(context),
            guard=self.new_guard(gammas),
            graphs=graphs,
            workspace=workspace,
            commit_step=self._commit_step,
            stage_drafts=self._stage_drafts,
            tp=None if running_batch else self._tp,
            queue_ahead=self.queue_ahead and not running_batch,
            acceptance=self.acceptance,
            block_size=self.block_size,
        )

    def new_guard(self, gammas: Sequence[int]) -> Guard | None:
        """A fresh never-slower guard for one request (or running batch) whose arms draft
        ``gammas`` tokens, or None without a target-only arm or slack (SPEC.md §8)."""
        if self.slack is None or self.target_only_arm is None:
            return None
        return Guard(gammas, self.target_only_arm, self.slack, priors=self.arm_costs,
                     arm_drafters=[d for d, _ in self.arms], catch_up_priors=self.catch_up_costs,
                     layer_ratios={d: self._layer_ratio(drafter) for d, drafter in enumerate(self.drafters)})

    def _layer_ratio(self, drafter: Drafter) -> float:
        """λ: the layers a catch-up of ``drafter`` runs over the target's — the scale of the prior
        of a catch-up never measured, in units of the target's prefill (SPEC.md §8); 1 for a
        drafter of unknown make."""
        layers = len(self._target_lm.base.layers) if isinstance(self._target_lm, StaticLM) \
            else getattr(self.target.config, "num_hidden_layers", None)
        if isinstance(drafter, ModelDrafter):
            own = getattr(drafter.model.config, "num_hidden_layers", None)
        elif isinstance(drafter, (FeatureDrafter, ShallowDrafter)):
            own = len(drafter.head.layers)
        else:
            own = None
        if not own or not layers:
            return 1.0
        return own / layers

    def _workspace(self, shape: tuple[Any, ...]) -> Workspace:
        """The decode buffers for this shape: reused when it matches the last request (so are
        the captured graphs), replaced together with every graph when it does not."""
        batch, capacity = shape[:2]
        reallocated = self._target_lm.reset(batch, capacity)
        if reallocated or self._buffers is None or self._buffers.shape != shape:
            self._graphs.clear()
            self._buffers = Workspace(*shape, self.target.device, dtype=self.target.dtype)
        return self._buffers

    def _output(self, sequences: list[list[int]], stats: GenerationStats) -> GenerationOutput:
        stats.new_tokens = sum(len(s) for s in sequences)
        text = None
        if self.tokenizer is not None:
            text = [self.tokenizer.decode(s, skip_special_tokens=True) for s in sequences]
        return GenerationOutput(sequences, stats, text)
