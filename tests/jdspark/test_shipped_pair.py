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


def test_shipped_pair_greedy_dspark_equals_plain_on_held_out_prompts(pair):
    target, drafter = pair
    G = drafter.config.block_size
    docs = jdata.read_documents(jdata.list_files(None, "val"))
    prompts = jdata.prompts_from_documents(docs, 2, 48, seed=11)
    steps = accepted = 0
    for p in prompts:
        ar = jdspark.generate(target, None, p, max_new_tokens=64, eos_token_id=-1)
        sp = jdspark.generate(target, drafter, p, max_new_tokens=64, eos_token_id=-1)
        np.testing.assert_array_equal(sp.tokens, ar.tokens)
        steps += int(sp.stats.target_steps)
        accepted += int(sp.stats.accepted)
    accept_len = (accepted + steps) / steps
    print(f"shipped pair: {accept_len:.2f} tokens per target step on held-out prompts (block {G})")
    assert 1.0 < accept_len < G + 1
