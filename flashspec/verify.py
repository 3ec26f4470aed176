"""Verification of drafted tokens against the target: the exact speculative-sampling rule.

One public function, :func:`verify`, with two backends behind the same signature and result:

* ``"reference"`` (below): pure PyTorch, batched over rows with tensor operations only (no
  Python loop over rows, no device-to-host synchronisation), so it runs on every device;
* ``"triton"`` (:mod:`flashspec.kernels.verify`): fused Triton kernels that read the logits once.

SPEC.md §2 step 4 is the contract both follow. ``backend="auto"`` picks Triton for CUDA logits
when Triton imports, else the reference; the environment variable ``FLASHSPEC_VERIFY_BACKEND``
(``reference`` or ``triton``) overrides that choice.

``acceptance="block"`` decides on the drafted block jointly instead of draft by draft (block
verification, SPEC.md §2 "Block verification"): the same law, at least as many drafts kept in
expectation. Sampled, it runs on the reference backend's tensor operations on every device (the
Triton kernels verify draft by draft); greedy is step 4's rule either way (the block rule reduces
to it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .kernels import shim
from .sampling import SamplingParams, probabilities, sample

__all__ = ["ACCEPTANCES", "BACKENDS", "VerifyResult", "verify"]

BACKENDS = ("auto", "reference", "triton")
"""Names accepted by ``verify(..., backend=...)``."""

ACCEPTANCES = ("token", "block")
"""Names accepted by ``verify(..., acceptance=...)``: draft by draft (SPEC.md §2 step 4), or the
block jointly (§2, "Block verification")."""

BACKEND_ENV = "FLASHSPEC_VERIFY_BACKEND"
"""Environment variable that overrides ``backend="auto"`` (``reference`` or ``triton``)."""

_NO_TRITON = "The Triton verify backend needs Triton: pip install 'flashspec[gpu]' (Linux only)."


@dataclass
class VerifyResult:
    """``num_accepted [B]``: leading drafts kept (0..k). ``tokens [B, k+1]``: the kept drafts,
    then the new (corrected or bonus) token at index ``num_accepted``; later entries are -1."""

    num_accepted: torch.Tensor
    tokens: torch.Tensor


def verify(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    uniforms: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    acceptance: str = "token",
) -> VerifyResult:
    """Accept a prefix of the drafts and emit one more token, exactly per SPEC.md §2.

    Args:
        target_logits: ``[B, k+1, V]`` raw target logits; position ``i`` scores the token after
            the ``i``-th fed token (the pending token, then each draft).
        draft_tokens: ``[B, k]`` drafted token ids (``k`` may be 0).
        draft_probs: ``[B, k, V]`` processed drafter distributions the drafts were drawn from,
            or ``None`` for a deterministic drafter (verified with one-hot ``q``).
        params: the sampling parameters (greedy when ``params.do_sample`` is False).
        uniforms: ``[B, k+1]`` float64 in ``[0, 1)``: ``[:, i]`` tests draft ``i``, ``[:, k]``
            draws the final token. Required when sampling; ignored for greedy.
        backend: ``"auto"`` (Triton for CUDA logits when Triton imports, else the reference;
            overridden by ``$FLASHSPEC_VERIFY_BACKEND``), ``"reference"`` or ``"triton"``.
        acceptance: ``"token"`` (step 4: each draft tested alone) or ``"block"`` (the block
            verified jointly, SPEC.md §2 "Block verification").
    """
    check_acceptance(acceptance)
    chosen = _choose_backend(backend, target_logits)
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must have shape [B, k]; got {tuple(draft_tokens.shape)}.")
    batch, k = draft_tokens.shape
    if target_logits.dim() != 3 or target_logits.shape[:2] != (batch, k + 1):
        raise ValueError(
            f"target_logits must have shape [B, k+1, V] = [{batch}, {k + 1}, V] for drafts of "
            f"shape {tuple(draft_tokens.shape)}; got {tuple(target_logits.shape)}."
        )
    vocab = target_logits.shape[2]
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, k, vocab):
        raise ValueError(
            f"draft_probs must have shape [B, k, V] = [{batch}, {k}, {vocab}]; "
            f"got {tuple(draft_probs.shape)}."
        )
    if params.do_sample and (uniforms is None or uniforms.shape != (batch, k + 1)):
        raise ValueError(f"Sampling needs uniforms of shape [{batch}, {k + 1}].")
    if acceptance == "block" and params.do_sample:  # one backend yet: this one's tensor operations (§2)
        return _verify_block(target_logits, draft_tokens, draft_probs, params, uniforms)
    if chosen == "triton":
        from .kernels.verify import verify_triton

        num_accepted, tokens = verify_triton(target_logits, draft_tokens, draft_probs, params, uniforms)
        return VerifyResult(num_accepted, tokens)
    if acceptance == "block":
        return _verify_block(target_logits, draft_tokens, draft_probs, params, uniforms)
    return _verify_reference(target_logits, draft_tokens, draft_probs, params, uniforms)


def check_acceptance(acceptance: object) -> str:
    """``acceptance`` itself when it names a verification rule, else a ``ValueError``."""
    if not isinstance(acceptance, str) or acceptance not in ACCEPTANCES:
        raise ValueError(f"acceptance must be 'token' (each draft tested alone) or 'block' (the block verified "
                         f"jointly, SPEC.md §2); got {acceptance!r}.")
    return acceptance


def _choose_backend(backend: str, target_logits: torch.Tensor) -> str:
    """Resolve ``backend`` (and ``$FLASHSPEC_VERIFY_BACKEND`` for "auto") to a concrete one."""
    if backend not in BACKENDS:
        raise ValueError(f"Unknown verify backend {backend!r}; available: {', '.join(BACKENDS)}.")
    if backend == "auto":
        forced = os.environ.get(BACKEND_ENV, "").strip()
        if forced:
            if forced not in ("reference", "triton"):
                raise ValueError(
                    f"Unknown verify backend {forced!r} in ${BACKEND_ENV}; available: reference, triton."
                )
            backend = forced
        elif target_logits.is_cuda and shim.importable():
            return "triton"
        else:
            return "reference"
    if backend == "triton":
        if not shim.importable():
            raise ValueError(_NO_TRITON)
        if not target_logits.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"The Triton verify backend needs CUDA tensors; the logits are on "
                f"{target_logits.device.type} (set TRITON_INTERPRET=1 to run the kernels on the "
                "CPU with Triton's interpreter, slowly)."
            )
    return backend


def _verify_reference(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    uniforms: torch.Tensor | None,
) -> VerifyResult:
    """The reference backend: the rule of SPEC.md §2 in batched tensor operations."""
    batch, k = draft_tokens.shape
    device = target_logits.device
    columns = torch.arange(k + 1, device=device)

    if not params.do_sample:
        target_choice = target_logits.float().argmax(dim=-1)  # [B, k+1]
        matches = draft_tokens == target_choice[:, :k]
        num_accepted = _leading_true(matches)
        final = target_choice.gather(1, num_accepted[:, None]).squeeze(1)
        return VerifyResult(num_accepted, _assemble(draft_tokens, num_accepted, final, columns))

    if uniforms is None or uniforms.shape != (batch, k + 1):
        raise ValueError(f"Sampling needs uniforms of shape [{batch}, {k + 1}].")
    p = probabilities(target_logits, params)  # [B, k+1, V] float32
    p_draft = p[:, :k].gather(2, draft_tokens[..., None]).squeeze(2).double()  # [B, k]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, draft_tokens[..., None]).squeeze(2).double()
    accepted = uniforms[:, :k].double() * q_draft < p_draft
    num_accepted = _leading_true(accepted)

    # The one row per sequence where the final token is drawn: p at position n, minus q there
    # (q is zero at the bonus position n == k, so the "residual" is p itself).
    rows = torch.arange(batch, device=device)
    p_final = p[rows, num_accepted]  # [B, V]
    q_final = _draft_law_at(draft_tokens, draft_probs, num_accepted, p_final)
    residual = torch.clamp(p_final - q_final, min=0.0)
    has_mass = residual.sum(dim=-1, keepdim=True) > 0
    final = sample(torch.where(has_mass, residual, p_final), uniforms[:, k])
    return VerifyResult(num_accepted, _assemble(draft_tokens, num_accepted, final, columns))


def _verify_block(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    uniforms: torch.Tensor | None,
) -> VerifyResult:
    """Block verification (SPEC.md §2, "Block verification"; Sun et al., arXiv:2403.10444,
    Algorithm 2), batched over rows. Greedy is step 4's rule, which is what it reduces to."""
    if not params.do_sample:
        return _verify_reference(target_logits, draft_tokens, draft_probs, params, uniforms)
    if uniforms is None:
        raise ValueError("Sampling needs uniforms.")
    batch, k = draft_tokens.shape
    device = target_logits.device
    p = probabilities(target_logits, params)  # [B, k+1, V] float32
    p_draft = p[:, :k].gather(2, draft_tokens[..., None]).squeeze(2).double()  # [B, k]
    if draft_probs is None:  # a deterministic drafter: q_i = onehot(d_i)
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, draft_tokens[..., None]).squeeze(2).double()

    # Step 1, forward: running weights w_i = min(1, w_{i-1} p_i(d_i) / q_i(d_i)), w_0 = 1.
    # E.g. ratios p/q = [0.5, 3, 0.5] give w = [1, 0.5, 1, 0.5].
    weights = [torch.ones(batch, dtype=torch.float64, device=device)]
    for i in range(k):
        scaled, q = weights[-1] * p_draft[:, i], q_draft[:, i]
        ratio = torch.where(scaled >= q, torch.ones_like(q), scaled / torch.where(q > 0, q, torch.ones_like(q)))
        weights.append(torch.where(scaled > 0, ratio, torch.zeros_like(ratio)))
    w = torch.stack(weights, dim=1)  # [B, k+1]: w_0 .. w_k

    # Step 2: residual masses Z_i = sum_x max(0, w_i p_{i+1}(x) - q_{i+1}(x)), with q_{k+1} = 0.
    mass = _residual_masses(w, p, p_draft, draft_probs)  # [B, k+1]

    # Step 3, backward: n = the largest i in 1..k whose test u_i < h_i passes (0 if none),
    # h_i = Z_i / (Z_i + 1 - w_i), 0 where Z_i = 0 (nothing to draw from after i drafts).
    stop = torch.where(mass > 0, mass / (mass + 1.0 - w).clamp(min=1e-300), torch.zeros_like(mass))
    passed = uniforms[:, :k].double() < stop[:, 1:]  # [B, k]
    positions = torch.arange(1, k + 1, device=device).expand(batch, k)
    num_accepted = torch.where(passed, positions, torch.zeros_like(positions))
    num_accepted = num_accepted.amax(dim=1) if k > 0 else num_accepted.sum(dim=1)  # (k = 0: n = 0)

    # Step 4: the new token from r_n = max(0, w_n p_{n+1} - q_{n+1}) (the bonus token at n = k).
    rows = torch.arange(batch, device=device)
    p_final = p[rows, num_accepted].double()  # [B, V]
    q_final = _draft_law_at(draft_tokens, draft_probs, num_accepted, p_final)
    residual = torch.clamp(w[rows, num_accepted][:, None] * p_final - q_final, min=0.0)
    has_mass = residual.sum(dim=-1, keepdim=True) > 0
    final = sample(torch.where(has_mass, residual, p_final), uniforms[:, k])
    columns = torch.arange(k + 1, device=device)
    return VerifyResult(num_accepted, _assemble(draft_tokens, num_accepted, final, columns))


def _residual_masses(
    w: torch.Tensor, p: torch.Tensor, p_draft: torch.Tensor, draft_probs: torch.Tensor | None
) -> torch.Tensor:
    """``Z_i = Σ_x max(0, w_i p_{i+1}(x) − q_{i+1}(x))`` for ``i = 0..k`` as ``[B, k+1]`` float64.

    ``q_{k+1} = 0`` (no draft follows the last), so ``Z_k = w_k``. A one-hot ``q`` (no
    ``draft_probs``) has the closed form ``w_i (1 − p_{i+1}(d_{i+1}))``: ``w_i p ≤ 1`` everywhere.
    """
    k = p_draft.shape[1]
    scaled = w[:, :, None] * p.double()  # [B, k+1, V]
    if draft_probs is None:
        total = scaled.sum(dim=-1)
        at_draft = w[:, :k] * p_draft  # w_i p_{i+1}(d_{i+1}), i < k
        head = total[:, :k] - at_draft + torch.clamp(at_draft - 1.0, min=0.0)
        return torch.cat([head, total[:, k:]], dim=1)
    head = torch.clamp(scaled[:, :k] - draft_probs.double(), min=0.0).sum(dim=-1)
    return torch.cat([head, scaled[:, k].sum(dim=-1, keepdim=True)], dim=1)


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Number of leading True entries per row of ``[B, k]`` (prefix-only acceptance)."""
    return torch.cumprod(mask.long(), dim=1).sum(dim=1)


def _draft_law_at(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    position: torch.Tensor,
    like: torch.Tensor,
) -> torch.Tensor:
    """``q`` at ``position [B]`` as ``[B, V]``; zero where ``position == k`` (no draft there)."""
    batch, k = draft_tokens.shape
    in_range = (position < k)[:, None]
    safe = position.clamp(max=max(k - 1, 0))
    rows = torch.arange(batch, device=like.device)
    if k == 0:
        return torch.zeros_like(like)
    if draft_probs is None:
        q = torch.zeros_like(like).scatter_(1, draft_tokens[rows, safe][:, None], 1.0)
    else:
        q = draft_probs[rows, safe].to(like.dtype)
    return torch.where(in_range, q, torch.zeros_like(q))


def _assemble(
    drafts: torch.Tensor, num_accepted: torch.Tensor, final: torch.Tensor, columns: torch.Tensor
) -> torch.Tensor:
    """``[B, k+1]``: drafts before ``num_accepted``, ``final`` at it, -1 after."""
    padded = torch.cat([drafts, drafts.new_full((drafts.shape[0], 1), -1)], dim=1)
    n = num_accepted[:, None]
    out = torch.where(columns < n, padded, torch.full_like(padded, -1))
    return torch.where(columns == n, final[:, None], out)
