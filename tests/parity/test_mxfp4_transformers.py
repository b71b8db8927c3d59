"""kimi.mxfp4 vs transformers' gpt-oss dequantiser (`convert_moe_packed_tensors`), bit-exact.

transformers returns `[E, I, O]` (it transposes the `[E, O, I]` result); ours returns `[E, O, I]`. It computes
`ldexp(FP4_VALUES[nibble], scale - 127)` in the requested dtype; float32 keeps every product exact as long as
6 * 2**(s - 127) stays finite (s <= 252).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # noqa: E402  (a missing parity dependency fails the run: tests/conftest.py)
import transformers.integrations.mxfp4 as hf_mxfp4  # noqa: E402

from kimi import mxfp4  # noqa: E402


def _hf_dequant(blocks, scales):
    out = hf_mxfp4.convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
    )
    return out.numpy()


@pytest.mark.parametrize(
    "backend,lo,hi",
    # NumPy keeps float32 subnormals (like torch on CPU); XLA flushes them, so its scales stay >= 3.
    [(np.asarray, 0, 252), (jnp.asarray, 3, 252)],
)
def test_dequantize_gpt_oss_matches_transformers(backend, lo, hi):
    rng = np.random.default_rng(0)
    n_exp, n_out, n_groups = 3, 5, 4  # in = 128
    blocks = rng.integers(0, 256, size=(n_exp, n_out, n_groups, 16), dtype=np.uint8)
    scales = rng.integers(lo, hi + 1, size=(n_exp, n_out, n_groups), dtype=np.uint8)
    scales[0, 0, :] = [lo, hi, 127, 128]  # the extremes are always present

    want_EIO = _hf_dequant(blocks, scales)
    assert want_EIO.shape == (n_exp, n_groups * 32, n_out)

    fn = mxfp4.dequantize_gpt_oss if backend is np.asarray else jax.jit(mxfp4.dequantize_gpt_oss)
    got_EOI = np.asarray(fn(backend(blocks), backend(scales)))
    assert got_EOI.shape == (n_exp, n_out, n_groups * 32) and got_EOI.dtype == np.float32
    got_EIO = got_EOI.swapaxes(-1, -2)
    assert np.abs(got_EIO - want_EIO).max() == 0
    np.testing.assert_array_equal(got_EIO.view(np.uint32), want_EIO.view(np.uint32))  # -0.0 too

    # the compressed-tensors path (what K3 checkpoints store) gives the same numbers
    packed, scale = mxfp4.gpt_oss_to_compressed(blocks, scales)
    np.testing.assert_array_equal(mxfp4.dequantize(packed, scale).swapaxes(-1, -2), want_EIO)
