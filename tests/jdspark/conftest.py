"""Fixtures shared by jdspark's tests."""
import jax
import pytest

from kimi import dispatch


@pytest.fixture(params=["bisect", "sort"])
def sampling_form(request, monkeypatch):
    """Runs a test under both of ``dispatch.sampling_form``'s forms on this CPU: "bisect" (the CPU's own) and "sort"
    (what a GPU runs: one sort, Gumbel noise over the whole vocabulary, no run-time cond), by setting which
    backends take run-time skips. The form is read while tracing, so under "sort" JAX's in-memory caches are
    cleared before the test (a program traced under "bisect", e.g. the slots' module-level jitted step, must not
    serve it) and after it (nor serve later tests)."""
    form = request.param
    monkeypatch.setattr(dispatch, "RUNTIME_SKIP_BACKENDS", ("cpu",) if form == "bisect" else ())
    assert dispatch.sampling_form() == form
    if form == "sort":
        jax.clear_caches()
    yield form
    if form == "sort":
        jax.clear_caches()
