"""Pallas kernels; each one has its jnp reference in kimi.ops and a test comparing the two."""
