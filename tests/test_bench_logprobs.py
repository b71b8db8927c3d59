"""scripts/bench_logprobs.py on a tiny random pair: one cell per (batch, width) with the three arms side by side,
and the cache bound checked before anything runs."""

import os
import sys

import numpy as np
import pytest
from flax import nnx

import jdspark
import kimi

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import bench_logprobs  # noqa: E402


def test_arms_side_by_side_per_batch_and_width():
    cfg = kimi.KimiConfig.tiny()
    target = kimi.KimiForCausalLM(cfg, rngs=nnx.Rngs(0))
    drafter = jdspark.DSparkDrafter(jdspark.DSparkConfig.for_target(cfg, block_size=3), target=target,
                                    rngs=nnx.Rngs(1))
    prompts = [list(np.random.default_rng(i).integers(4, 200, 12)) for i in range(2)]
    res = bench_logprobs.run(target, drafter, prompts, slots=2, max_len=64, batches=[2], widths=[4], iters=2,
                             repeats=1, top=3)
    assert [(c["batch"], c["width"]) for c in res["cells"]] == [(2, 4)]
    for c in res["cells"]:
        assert all(c[f"{a}_ms"] > 0 for a in bench_logprobs.ARMS)
        assert c["unasked_over_off"] > 0 and c["asked_over_off"] > 0
    assert set(res["compiled"]) == {"off", "on"} and all(v["compile_s"] > 0 for v in res["compiled"].values())
    with pytest.raises(ValueError, match="overflow"):
        bench_logprobs.run(target, drafter, prompts, slots=2, max_len=40, batches=[2], widths=[4], iters=8,
                           repeats=1)
