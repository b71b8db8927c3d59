"""scripts/bench_long.py on a tiny random pair at a short length: the JSON has every key the issue names, DSpark's
tokens equal plain decoding's, the windowed drafter's cache holds the window only, the chart is written, and the
prompts are the held-out files' tokens."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import bench_long  # noqa: E402

import jdspark  # noqa: E402
import kimi  # noqa: E402
from kimi.tokenizer import ByteTokenizer  # noqa: E402
from tests.random_pair import random_pair  # noqa: E402

KEYS = {"context", "plain_tok_s", "spec_tok_s", "speedup", "accept_len", "prefill_tok_s", "peak_rss_prefill_bytes",
        "peak_rss_decode_bytes", "cache_bytes", "chunk_activation_bytes", "drafter_window"}


@pytest.fixture(scope="module")
def result():
    target, drafter = random_pair(block_size=4)
    # the prompt prefilled once (window none), the window-16 ring cut from its context (share_prefill_from)
    return bench_long.run(target, drafter, ByteTokenizer(), lengths=(70,), windows=(None, 16), max_new=8,
                          chunk_flag=32, repeats=1, share_prefill_from=70)


def test_json_has_the_issue_keys(result):
    rows = result["lengths"]
    assert [(r["context"], r["drafter_window"]) for r in rows] == [(70, None), (70, 16)]
    r, ring_row = rows
    assert KEYS <= set(r) and KEYS <= set(ring_row), KEYS - set(r)
    assert not r["prefill_shared"] and ring_row["prefill_shared"] and ring_row["prefill_tok_s"] is None
    assert ring_row["lossless"] and ring_row["new_tokens"] == 8 and 1.0 <= ring_row["accept_len"] <= 5.0
    assert r["lossless"] and r["new_tokens"] == 8 and r["prefill_chunk"] == 32
    assert r["plain_tok_s"] > 0 and r["spec_tok_s"] > 0 and 1.0 <= r["accept_len"] <= 5.0
    assert r["peak_rss_prefill_bytes"] > 0 and r["peak_rss_decode_bytes"] > 0 and r["chunk_activation_bytes"] > 0
    assert r["cache_bytes"] == r["target_cache_bytes"] + r["drafter_cache_bytes"]
    assert r["memory_ratio"] == pytest.approx(r["prefill_rss_growth_bytes"] / (
        r["cache_bytes"] + r["chunk_activation_bytes"]))
    dc = jdspark.DSparkConfig.for_target(kimi.KimiConfig.tiny(), block_size=4)
    ring = 2 * 16 * dc.num_hidden_layers * dc.num_key_value_heads * dc.head_dim * 4  # k and v, fp32, 16 slots
    assert ring_row["drafter_cache_bytes"] == ring + 4  # + the int32 length
    assert r["drafter_cache_bytes"] == ring // 16 * r["cache_positions"] + 4  # the whole context


def test_plot(result, tmp_path):
    out = tmp_path / "long.png"
    bench_long.plot(result, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_long_prompt_asks_the_same_held_out_question_at_every_length(tmp_path):
    """Every length ends at the same point of the same held-out file and has the same continuation (the file's
    real text); a longer prompt's tail is the shorter prompt; held-out files come first, training files in front
    of them once they run out (held_out_fraction below 1)."""
    tok = ByteTokenizer()
    want = {"val": 3, "train": 4}
    for k in range(100000):  # the corpus splits by a hash of the file's name: names that land in each split
        name = f"mod{k}.py"
        split = jdspark.data.split_of(name, jdspark.data.VAL_FRACTION)
        if want[split]:
            want[split] -= 1
            (tmp_path / name).write_text("".join(f"{split}_{k} = {j}  # line {j}\n" for j in range(40)))
        if not any(want.values()):
            break
    files = {p.name for p in jdspark.data.list_files(tmp_path, "val")}
    assert len(files) == 3
    small, cont_small, held_small = bench_long.long_prompt(tok, 300, 64, corpus=tmp_path)
    big, cont_big, held_big = bench_long.long_prompt(tok, 5000, 64, corpus=tmp_path)
    assert small.shape == (300,) and big.shape == (5000,) and small[0] == big[0] == tok.bos_id
    np.testing.assert_array_equal(cont_small, cont_big)
    np.testing.assert_array_equal(small[1:], big[-299:])
    text = bytes(big[1:].astype(np.uint8)) + bytes(cont_big.astype(np.uint8))
    header, body = text[text.rfind(b"# file: "):].split(b"\n", 1)  # the file the prompt ends in
    name = header[len(b"# file: "):].decode()
    assert name in files  # held out
    real = (tmp_path / name).read_bytes()
    assert real.startswith(body) and len(body) < len(real)  # its own text up to its middle, then its continuation
    assert held_small == 1.0 and 0 < held_big < 1
    assert b"train_" in bytes(big.astype(np.uint8)) and b"train_" not in bytes(small.astype(np.uint8))


def test_divergence_finds_the_first_differing_token_and_plain_decodings_logits_there():
    """A run that differs from plain decoding at token 3: divergence names index 3, and the gap it reports is
    plain decoding's own logit of its token over the other's (teacher-forced decoding predicts plain's token there:
    the gap is at least the top-2 margin, which is >= 0)."""
    from jdspark.speculative import Stream

    cfg = kimi.KimiConfig.tiny()
    target = kimi.KimiForCausalLM(cfg, rngs=nnx.Rngs(0))
    t_graph, t_state = nnx.split(target)
    prompt = jnp.asarray(np.arange(3, 19, dtype=np.int32)[None])
    st, first = bench_long._prefill(t_graph, None, t_state, None, prompt, jnp.int32(16), jax.random.key(0),
                                    max_len=40, chunk=None)
    st = Stream(st.anchor, st.cache, None, st.key)
    toks, _, _, _ = bench_long._decode_run(t_graph, t_state, None, None, st, first, 8, 1)
    assert bench_long.divergence(t_graph, t_state, st, toks, toks) == {"first_divergence": None}
    other = toks.copy()
    other[3] = (toks[3] + 1) % cfg.vocab_size
    d = bench_long.divergence(t_graph, t_state, st, toks, other)
    assert d["first_divergence"] == 3 and d["plain_token"] == toks[3] and d["spec_token"] == other[3]
    assert d["plain_top2_margin"] >= 0 and d["logit_gap_at_divergence"] >= d["plain_top2_margin"] - 1e-6
