"""Fixtures shared by jdspark's tests."""
import pytest

from kimi import dispatch


@pytest.fixture(params=["bisect", "sort"])
def sampling_form(request, monkeypatch):
    """Runs a test under both of ``dispatch.sampling_form``'s forms on this CPU: "bisect" (the CPU's own) and "sort"
    (what a GPU runs: one sort, Gumbel noise over the whole vocabulary, no run-time cond), by setting which
    backends take run-time skips. Functions must be traced inside the test (a jit cache from another form would
    hide it)."""
    monkeypatch.setattr(dispatch, "RUNTIME_SKIP_BACKENDS", ("cpu",) if request.param == "bisect" else ())
    assert dispatch.sampling_form() == request.param
    return request.param
