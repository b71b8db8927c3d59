"""Random numbers for sampling without XLA:CPU's rolled Threefry loop: the same Threefry-2x32 hash, unrolled.

Why: ``jax.random`` lowers Threefry-2x32 on CPU as a ``while`` loop of 5 iterations (to keep compile times down),
so every ``split`` / ``uniform`` / ``gumbel`` call inside a program is a loop whose carry XLA copies on each
iteration: ~30 us a call here, whatever its size. A sampled DSpark step made ~30 such calls (a split and two
Gumbel draws per draft position, more in the rejection rule): 0.6-0.9 ms of a ~9 ms step in copies and loop
control (``scripts/bench_profile.py --temperature 1``: ``copy.*`` ops of ``u32[]`` / ``u32[4]`` under
``_gumbel/_uniform/while``). Here the 20 rounds are written out, so a call is one elementwise fusion.

Threefry-2x32 (Salmon et al. 2011, Random123), 20 rounds: with key (k0, k1), k2 = k0 ^ k1 ^ 0x1BD11BDA,

    x0 += k0;  x1 += k1
    round i (i = 0..19):  x0 += x1;  x1 = rotl(x1, R[i mod 8]) ^ x0,     R = 13 15 26 6 17 29 16 24
    after round 4s - 1 (s = 1..5):  x0 += k[s mod 3];  x1 += k[(s + 1) mod 3] + s

A key is a ``jax.random`` key of the threefry2x32 implementation (typed or raw uint32[2]); ``split`` returns keys
of the same kind, so these functions and ``jax.random`` mix freely, one key used by one of them (as in JAX).
Counters: the i-th pair is (0, i); each pair gives two 32-bit words. The streams differ from ``jax.random``'s (a
different counter layout), not their law: ``tests/jdspark/test_rng.py`` checks the hash against Random123's
known-answer vectors and the uniform's law.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

_ROT = (13, 15, 26, 6, 17, 29, 16, 24)
_PARITY = np.uint32(0x1BD11BDA)


def _rotl(x, r: int):
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def threefry2x32(k0, k1, x0, x1):
    """The Threefry-2x32 hash (20 rounds) of counter words (x0, x1) under key words (k0, k1), all uint32 and
    broadcastable. Returns the two output words."""
    ks = (k0, k1, k0 ^ k1 ^ _PARITY)
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(20):
        x0 = x0 + x1
        x1 = _rotl(x1, _ROT[i % 8]) ^ x0
        if i % 4 == 3:
            s = (i + 1) // 4
            x0 = x0 + ks[s % 3]
            x1 = x1 + ks[(s + 1) % 3] + np.uint32(s)
    return x0, x1


def _key_words(key):
    """(k0, k1) of one threefry2x32 key (a typed key array or raw uint32[2]; batch keys with ``jax.vmap``)."""
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    data = jax.random.key_data(key) if typed else jnp.asarray(key)
    if data.shape != (2,) or data.dtype != jnp.uint32:
        raise ValueError(f"key: expected one threefry2x32 key (key data uint32[2]), got data {data.dtype}"
                         f"{list(data.shape)}")
    return data[0], data[1]


def bits(key, shape) -> jax.Array:
    """uint32 random words of ``shape``: the hash of counters (0, 0), (0, 1), ..., both words of each."""
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    k0, k1 = _key_words(key)
    m = (n + 1) // 2
    y0, y1 = threefry2x32(k0, k1, jnp.zeros((m,), jnp.uint32), jnp.arange(m, dtype=jnp.uint32))
    return jnp.concatenate([y0, y1])[:n].reshape(shape)


def uniform(key, shape) -> jax.Array:
    """float32 uniform on [0, 1) of ``shape``, 23 random mantissa bits (as ``jax.random.uniform``)."""
    b = (bits(key, shape) >> np.uint32(9)) | np.uint32(0x3F800000)
    return jax.lax.bitcast_convert_type(b, jnp.float32) - 1.0


def gumbel(key, shape) -> jax.Array:
    """float32 standard Gumbel of ``shape``: -log(-log(u)), u uniform on [tiny, 1)."""
    u = jnp.maximum(uniform(key, shape), jnp.finfo(jnp.float32).tiny)
    return -jnp.log(-jnp.log(u))


def split(key, num: int = 2):
    """``num`` new keys from ``key`` [num] (typed if ``key`` is typed, else raw uint32 [num, 2])."""
    data = bits(key, (int(num), 2))
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key))
    return data
