"""Fixtures shared by jdspark's tests."""
import jax
import pytest

from kimi import dispatch


@pytest.fixture(params=dispatch.SAMPLING_FORMS)
def sampling_form(request):
    """Runs a test under each of ``dispatch.sampling_form``'s forms on this CPU: "bisect" (the CPU's own) and "sort"
    (what a GPU runs: one sort, Gumbel noise over the whole vocabulary, no run-time cond), by
    ``dispatch.sampling_form_as``. The form is read while tracing, so outside the backend's own form JAX's in-memory
    caches are cleared before the test (a program traced in the other form, e.g. the slots' module-level jitted
    step, must not serve it) and after it (nor serve later tests)."""
    form = request.param
    other = form != dispatch.sampling_form()
    if other:
        jax.clear_caches()
    with dispatch.sampling_form_as(form):
        yield form
    if other:
        jax.clear_caches()


@pytest.fixture(scope="module")
def srv():
    """A live server over the scripted backend (``serve_helpers.LiveServer``): 4 slots, a queue of 8 (the 429
    test fills it); one per test module, so a module's tests see one another's traffic and no other module's."""
    from tests.jdspark.serve_helpers import LiveServer

    s = LiveServer(num_slots=4, max_waiting=8)
    yield s
    s.close()
