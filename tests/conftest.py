"""Test-session setup shared by every test file."""

from __future__ import annotations

import os

import torch

# Without CUDA, the Triton verify kernels run on CPU tensors through Triton's interpreter. The
# variable must be set before anything imports triton (triton.jit reads it at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "default_configuration: run with the engine's real default selector ('auto': the "
        "target-only arm and the never-slower guard) instead of 'fixed'")


@pytest.fixture(autouse=True)
def _fixed_selector_unless_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Most tests check what one drafter does at every step (its drafts verified, accepted,
    cached), so an engine built without ``selector=`` uses ``"fixed"`` here: under the default
    ``"auto"`` the never-slower guard may run a slow test drafter rarely or never (SPEC.md §8),
    and those tests would stop testing it. Tests of the default configuration carry the
    ``default_configuration`` marker (tests/test_guard.py, tests/test_serve.py, ...)."""
    from flashspec.engine import SpeculativeEngine

    if request.node.get_closest_marker("default_configuration") is None:
        monkeypatch.setitem(SpeculativeEngine.__init__.__kwdefaults__, "selector", "fixed")
    # Tests build engines by the hundred and check what a request does on its own; the warm-up
    # at construction (SPEC.md §7, "Warm shapes") is tested where it is asked for (warmup=True).
    monkeypatch.setitem(SpeculativeEngine.__init__.__kwdefaults__, "warmup", False)


@pytest.fixture(autouse=True)
def _steady_timings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibrations of tiny models on a machine that runs other tests are cached as steady ones:
    what the cache does is tested on its own; the check that keeps a busy machine's timings out
    of it (SPEC.md §13) is tested in tests/test_calibrate.py with its thresholds put back."""
    from flashspec.tuning import auto, calibrate

    monkeypatch.setattr(calibrate, "ERRATIC", 0.0)
    monkeypatch.setattr(auto, "STEADY_SPREAD", float("inf"))
