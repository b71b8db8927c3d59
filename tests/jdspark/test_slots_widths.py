"""The serving slots with ``num_speculative_tokens`` n below the drafter's block (the server's
``--num-speculative-tokens``, vLLM's setting): the widest compiled step verifies n drafts, a ``fixed`` request runs
at it, and each request served among others equals batch-1 ``jdspark.generate(..., num_speculative_tokens=n)``
token for token, greedy and sampled (the same width draws the same keys), with at most n drafts accepted a step."""

import numpy as np
import pytest

import jdspark
from jdspark.engine import Engine, Request, SamplingRequest
from jdspark.slots import SlotBackend
from tests.jdspark.test_slots import SETTINGS, _prompts, _wait_until_finished, pair  # noqa: F401 (a fixture)

N_DRAFTS = 2


def test_fixed_requests_at_n_drafts_equal_batch_one_generate(pair):  # noqa: F811
    target, drafter, tok = pair
    G = drafter.config.block_size
    assert N_DRAFTS < G
    be = SlotBackend(target, drafter, num_slots=2, max_len=128, prompt_buckets=(64,),
                     num_speculative_tokens=N_DRAFTS)
    assert be.widths == (1, N_DRAFTS + 1)
    eng = Engine(be, tok, eos_token_id=target.config.eos_token_id, max_waiting=16).start()
    reqs = []
    try:
        for i, p in enumerate(_prompts(6, 40, target.config.vocab_size)):
            sp = SamplingRequest(tuple(int(x) for x in p[:20 + 3 * i]), 24, seed=i, speculative=True,
                                 spec_mode="fixed", **SETTINGS[i % 2])
            reqs.append(eng.submit(Request(sp, lambda ev: None, ignore_eos=True)))
        _wait_until_finished(eng, reqs, 600)
    finally:
        eng.shutdown()
    accepted = drafted = 0
    for r in reqs:
        sp = r.sampling
        ref = jdspark.generate(target, drafter, np.array(sp.prompt_ids), max_new_tokens=sp.max_tokens, seed=sp.seed,
                               temperature=sp.temperature, top_p=sp.top_p, eos_token_id=-1,
                               num_speculative_tokens=N_DRAFTS)
        assert r.output_ids == list(ref.tokens), (sp, r.output_ids, ref.tokens)
        u = r.usage()
        accepted, drafted = accepted + u["accepted"], drafted + u["drafted"]
        assert 1.0 <= u["accept_len"] <= N_DRAFTS + 1
    assert be.width_counts.get(N_DRAFTS + 1, 0) > 0 and set(be.width_counts) <= {1, N_DRAFTS + 1}
    assert 0 < accepted < drafted  # drafts both accepted and rejected
    with pytest.raises(ValueError, match=f"num_speculative_tokens: expected an int in 1..{G}"):
        SlotBackend(target, drafter, num_slots=2, max_len=128, prompt_buckets=(64,), num_speculative_tokens=G + 1)
