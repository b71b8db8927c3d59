"""The slots on the bf16 serving copy, what a server runs by default (``--serving-dtype bfloat16``): 21 greedy
requests, speculation off, fixed and adaptive, served among each other at batch buckets 1 and 4 through the Engine,
each equal token for token to batch-1 ``jdspark.generate`` of the same bf16 pair in its own mode, with drafts accepted
and rejected. (tests/jdspark/test_slots.py serves an fp32 pair; on the bf16 copy the slots' mapped rows take
other paths: the MoE's fused pair over bf16 experts for every row, bf16 matmuls padded per mapped row.) The
shipped pair's own figures under load: ``scripts/bench_serve.py``'s ``greedy_agreement`` (docs/serving.md)."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdspark
import kimi
from jdspark.adaptive import monotone_costs
from jdspark.engine import Engine, Request, SamplingRequest
from jdspark.slots import SlotBackend
from kimi.tokenizer import ByteTokenizer
from tests.jdspark.test_slots import _wait_until_finished
from tests.jdspark.test_speculative import bigram_map, markov_drafter, scaled_target


@pytest.fixture(scope="module")
def pair():
    """test_slots.py's built pair (output projections scaled by 0.3, a Markov drafter holding the target's bigram
    map with a fifth of it wrong), 8 experts, its serving copy in bf16."""
    cfg = kimi.KimiConfig.tiny(vocab_size=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                               serving_dtype="bfloat16")
    target = scaled_target(cfg, 0.3, seed=5)
    drafter = markov_drafter(target, bigram_map(scaled_target(cfg, 0.0, seed=5)), 0.2, 4.0, seed=5)
    return target, drafter


def test_bf16_served_rows_equal_batch_one_generate(pair):
    target, drafter = pair
    G = drafter.config.block_size
    be = SlotBackend(target, drafter, num_slots=4, max_len=96, prompt_buckets=(32,), batch_buckets=(1, 4),
                     adaptive=True, widths=(1, 3, G + 1))
    # test_slots.py's cost table: the scheduler's width moves with the survival curves (warm_up would time this
    # machine's, where the choice may sit at one width)
    be.costs = monotone_costs({(b, w): {1: 1.0, G + 1: 2.5}.get(w, 1.2) for b in (1, 4) for w in be.widths})
    kinds = {leaf.dtype for leaf in jax.tree.leaves(be.t_state) if leaf.ndim == 2 and leaf.size >= 64 * 32}
    assert jnp.dtype(jnp.bfloat16) in kinds, kinds  # the slots serve the bf16 copy
    rows = []  # active slots per launch
    launch = be.launch
    be.launch = lambda slots, *a, **k: rows.append(len(slots)) or launch(slots, *a, **k)
    eng = Engine(be, ByteTokenizer(), eos_token_id=target.config.eos_token_id, max_waiting=32).start()
    rng = np.random.default_rng(3)
    reqs = []
    try:
        for i in range(21):  # off, fixed and adaptive in turn
            prompt = tuple(int(t) for t in np.concatenate([[1], rng.integers(3, 64, 6 + (i * 5) % 23)]))
            sp = SamplingRequest(prompt, 12 + (i * 7) % 25, speculative=i % 3 != 0,
                                 spec_mode=("fixed", "adaptive")[i % 2])
            reqs.append(eng.submit(Request(sp, lambda ev: None, ignore_eos=True)))
            if i == 0:  # the first alone (batch bucket 1), the rest arriving over each other's steps (bucket 4)
                _wait_until_finished(eng, reqs, 300)
            time.sleep(0.01 * (i % 3))
        _wait_until_finished(eng, reqs, 600)
    finally:
        eng.shutdown()
    for r in reqs:
        sp = r.sampling
        ref = jdspark.generate(target, drafter if sp.speculative else None, np.array(sp.prompt_ids),
                               max_new_tokens=sp.max_tokens, eos_token_id=-1)
        assert r.output_ids == [int(t) for t in ref.tokens], (sp, r.output_ids, ref.tokens)
    assert 1 in rows and max(rows) >= 3, rows  # batch buckets 1 and 4 both served
    assert be.width_counts[G + 1] > 0 and be.width_counts[3] > 0, be.width_counts  # adaptive chose the middle width too
    spec = [r.usage()["accept_len"] for r in reqs if r.sampling.speculative]
    assert 1.0 < float(np.mean(spec)) < G + 1, spec  # drafts accepted and rejected
