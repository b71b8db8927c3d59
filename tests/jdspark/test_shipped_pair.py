"""The shipped pair (checkpoints/default): it loads, its drafter fits its target, and its greedy DSpark output on
held-out prompts (the validation split, which training never reads) equals plain decoding with acceptance strictly
between 1 and G+1 tokens per step. Sizes, block size and token ids come from the checkpoint's own configs."""
import os

import numpy as np
import pytest

import jdspark
import kimi
from jdspark import data as jdata

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAIR = os.path.join(ROOT, "checkpoints", "default")


@pytest.fixture(scope="module")
def pair():
    assert os.path.isfile(os.path.join(PAIR, "target", "config.json")), "the shipped target is missing"
    assert os.path.isfile(os.path.join(PAIR, "drafter", "config.json")), "the shipped drafter is missing"
    target = kimi.load_checkpoint(os.path.join(PAIR, "target"))
    drafter = jdspark.load_drafter(os.path.join(PAIR, "drafter"), target=target)
    return target, drafter


def test_shipped_pair_loads_and_fits(pair):
    target, drafter = pair
    tc, dc = target.config, drafter.config
    assert tc == kimi.KimiConfig.from_hf_config(os.path.join(PAIR, "target"))
    assert dc.hidden_size == tc.hidden_size and dc.vocab_size == tc.vocab_size
    assert all(0 <= i <= tc.num_hidden_layers for i in dc.aux_hidden_state_layer_ids)
    # served from a ring of the last 64 context positions (checkpoints/default/README.md says why: trained on
    # 256-token windows, it drafts better from its last 64 positions than from a longer context); a stream shorter
    # than the window reads its whole context (test_long_context.py: a window longer than the stream)
    assert dc.context_window == 64
    assert drafter.init_cache(1, 300).max_len == 64 and drafter.init_cache(1, 40).max_len == 40


def test_shipped_pair_greedy_dspark_equals_plain_on_held_out_prompts(pair):
    """20 held-out prompts (one padded length: one compiled program per mode), 40 new tokens each: DSpark's greedy
    output equals plain decoding's token for token, with steps that accepted every length from none to the whole
    block among them (so both the accept and the reject paths ran). On the fp32 serving copy (the checkpoint's
    own numerics, ``kimi.load_checkpoint``'s default): the bf16 copy a server runs by default rounds a verify block
    and a decode step differently enough to split a near-tie now and then (docs/serving.md, "Greedy outputs under
    batching": 2 of 40 held-out prompts x 128 tokens), which a lossless test must not depend on."""
    target, drafter = pair
    G = drafter.config.block_size
    docs = jdata.read_documents(jdata.list_files(None, "val"))
    tok = kimi.load_tokenizer(os.path.join(PAIR, "target"), vocab_size=target.config.vocab_size)
    prompts = jdata.prompts_from_documents(docs, 20, 48, seed=11, tokenizer=tok)
    steps = accepted = 0
    counts = np.zeros(G, np.int64)
    for p in prompts:
        ar = jdspark.generate(target, None, p, max_new_tokens=40, eos_token_id=-1)
        sp = jdspark.generate(target, drafter, p, max_new_tokens=40, eos_token_id=-1)
        np.testing.assert_array_equal(sp.tokens, ar.tokens)
        steps += int(sp.stats.target_steps)
        accepted += int(sp.stats.accepted)
        counts += np.asarray(sp.stats.accept_counts)
    accept_len = (accepted + steps) / steps
    hist = np.append(steps - counts[0], np.append(-np.diff(counts), counts[-1]))  # steps with 0..G accepted
    print(f"shipped pair: {accept_len:.2f} tokens per target step on 20 held-out prompts (block {G}); "
          f"steps with 0..{G} drafts accepted: {hist.tolist()}")
    assert 1.0 < accept_len < G + 1
    assert hist[0] > 0 and hist[-1] > 0 and (hist > 0).sum() >= G // 2 + 1, hist
