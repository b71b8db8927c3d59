"""generate(): lossless (greedy token for token; sampling in distribution), one compiled program, statistics.

Acceptance must range from none to all, so the drafters here are built, not trained. Greedy: the oracle drafter
(tests/oracle_drafter.py) drafts the reference continuation with one slot per block corrupted on a schedule, so
the acceptance histogram is known exactly and holds every length 0..G; or the target's output projections are
scaled by eps, which makes it (for eps = 0) an exact bigram model g(prev) -> next, and the drafter is given a
full-rank Markov head that encodes g (its backbone output is switched off). eps > 0 lets the context (KDA and MLA
state, MoE, AttnRes) perturb the target, so some drafts fail. Sampling: the law of every emitted token given the
tokens before it: tests/jdspark/test_sampling_law.py (with the helpers here).
"""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jdspark
import kimi
from jdspark import generation, serving_copy, speculative
from tests.oracle_drafter import assert_histogram, greedy_reference, histogram, oracle_drafter

_OUT_PROJ = {"o_proj", "down_proj", "routed_expert_up_proj"}


def scaled_target(cfg, eps: float, seed: int = 0):
    m = kimi.KimiForCausalLM(cfg, rngs=nnx.Rngs(seed))
    gd, st = nnx.split(m)
    d = nnx.to_pure_dict(st)

    def walk(node, name=""):
        if isinstance(node, dict):
            return {k: walk(v, k if k != "kernel" else name) for k, v in node.items()}
        return node * eps if name in _OUT_PROJ else node

    nnx.replace_by_pure_dict(st, walk(d))
    return nnx.merge(gd, st)


def bigram_map(target) -> np.ndarray:
    """g[v] = the target's greedy next token after the one-token context v."""
    V = target.config.vocab_size
    out = target.prefill(np.arange(V, dtype=np.int32)[:, None], target.init_cache(V, 1))
    return np.asarray(jnp.argmax(out.logits[:, 0], -1))


def markov_drafter(target, g: np.ndarray, wrong_frac: float, scale: float, seed: int = 0):
    """A drafter whose block output is zero and whose Markov bias is scale * onehot(g'(prev)), g' = g with a
    fraction of entries moved elsewhere."""
    cfg = target.config
    V = cfg.vocab_size
    dc = jdspark.DSparkConfig.for_target(cfg, block_size=4, markov_rank=V, mask_token_id=cfg.pad_token_id)
    d = jdspark.DSparkDrafter(dc, target=target, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    g2 = g.copy()
    flip = rng.random(V) < wrong_frac
    g2[flip] = (g2[flip] + 1 + rng.integers(0, V - 1, flip.sum())) % V
    d.norm.scale[...] = jnp.zeros_like(d.norm.scale[...])
    d.markov_head.markov_w1.embedding[...] = jnp.eye(V, dtype=jnp.float32)
    d.markov_head.markov_w2.kernel[...] = scale * jax.nn.one_hot(g2, V, dtype=jnp.float32)
    return d


@pytest.fixture(scope="module")
def tiny_cfg():
    return kimi.KimiConfig.tiny()


def test_lossless_greedy_many_seeds(tiny_cfg):
    cfg = tiny_cfg
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, size=n) for n in (3, 9, 17, 30, 41)]
    cases = [(0.0, 0.0), (0.02, 0.0), (0.1, 0.1), (1.0, 0.0)]  # (eps, wrong fraction of the drafter's map)
    accept_lens = []
    n_cases = 0
    hist = np.zeros(5, int)
    for ci, (eps, wrong) in enumerate(cases):
        target = scaled_target(cfg, eps, seed=ci)
        drafter = markov_drafter(target, bigram_map(scaled_target(cfg, 0.0, seed=ci)), wrong, 30.0, seed=ci)
        for p in prompts:
            ar = generation.generate(target, None, p, max_new_tokens=64, eos_token_id=-1)
            sp = generation.generate(target, drafter, p, max_new_tokens=64, eos_token_id=-1)
            assert ar.num_tokens == sp.num_tokens == 64
            np.testing.assert_array_equal(sp.tokens, ar.tokens, err_msg=f"case eps={eps} wrong={wrong} prompt {p}")
            accept_lens.append(sp.stats.accept_len)
            hist = hist + histogram(sp.stats, 4)
            n_cases += 1
    assert n_cases >= 20
    print(f"acceptance histogram, all cases (steps with 0..4 accepted): {hist.tolist()}")
    assert (hist > 0).all(), hist
    # the cases span the whole range: every draft accepted ... almost none
    assert max(accept_lens) == pytest.approx(5.0, abs=0.2)  # block 4 -> at most 4 drafts + 1 bonus per step
    assert min(accept_lens) < 1.5
    assert any(1.5 < a < 4.5 for a in accept_lens)


def test_one_program_per_padded_length(tiny_cfg):
    cfg = tiny_cfg
    target = scaled_target(cfg, 0.1)
    drafter = markov_drafter(target, bigram_map(scaled_target(cfg, 0.0)), 0.0, 30.0)
    generation.generate(target, drafter, np.arange(3, 13), max_new_tokens=16)
    n = generation.compiled_programs()
    out = generation.generate(target, drafter, np.arange(20, 50), max_new_tokens=16, seed=5)  # same bucket (64)
    assert generation.compiled_programs() == n
    assert out.num_tokens == 16
    # max_new_tokens 17 .. 32 share one program too (held in its multiple of 16, the count traced), and a shorter
    # generation is the longer one's beginning, its stats counting only its own steps
    longer = generation.generate(target, drafter, np.arange(3, 13), max_new_tokens=32, eos_token_id=-1)
    n = generation.compiled_programs()
    shorter = generation.generate(target, drafter, np.arange(3, 13), max_new_tokens=21, eos_token_id=-1)
    assert generation.compiled_programs() == n
    assert shorter.num_tokens == 21 and list(shorter.tokens) == list(longer.tokens[:21])
    assert 0 < shorter.stats.target_steps < longer.stats.target_steps
    # each step commits its accepted drafts + 1 (the last: its accepted drafts up to the 21st token), the prefill
    # the first token: the steps past the 21st token are not counted
    assert 21 - 1 <= shorter.stats.accepted + shorter.stats.target_steps <= 21


def test_new_tokens_capacity():
    assert [generation.new_tokens_capacity(m, 40) for m in (1, 16, 17, 100)] == [16, 16, 32, 112]
    # a cache cap holds the capacity to what fits, never below what was asked
    assert generation.new_tokens_capacity(17, 40, max_len=60) == 20
    assert generation.new_tokens_capacity(17, 40, max_len=50) == 17


def test_bad_input(tiny_cfg):
    target = kimi.KimiForCausalLM(tiny_cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="vocabulary"):
        generation.generate(target, None, [1, tiny_cfg.vocab_size])
    with pytest.raises(ValueError, match="batch 1"):
        generation.generate(target, None, np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generation.generate(target, None, [1, 2], max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        generation.generate(target, None, [1, 2], temperature=1.0, top_p=0.0)
    for kw, said in ((dict(seed=2 ** 70), "seed: expected an int in"),
                     (dict(eos_token_id=tiny_cfg.vocab_size), "eos_token_id: expected a token id in"),
                     (dict(min_tokens=5), r"min_tokens: expected at most max_new_tokens \(4\)"),
                     (dict(prompt_bucket=0), "prompt_bucket: expected an int >= 1")):
        with pytest.raises(ValueError, match=said):  # each said before anything compiles
            generation.generate(target, None, [1, 2], max_new_tokens=4, **kw)


@pytest.fixture(scope="module")
def mxfp4_target():
    """A tiny MXFP4 target, a prompt and the checkpoint model's own prefill logits on it (packed experts, no
    serving copy; the cache greedy_reference(.., 32 + 4 + 1) uses, so that prefill program is compiled once)."""
    cfg = kimi.KimiConfig.tiny(expert_format="mxfp4", moe_intermediate_size=32, routed_expert_hidden_size=64)
    target = kimi.KimiForCausalLM(cfg, rngs=nnx.Rngs(5))
    toks = np.arange(3, 12, dtype=np.int32)[None]
    logits = target.prefill(toks, target.init_cache(1, toks.shape[1] + 32 + 4 + 2)).logits
    return target, toks, logits


def test_serving_layout_matches_the_checkpoint_model(mxfp4_target):
    """The serving copy (MXFP4 unpacked, fused layouts) gives the same logits up to float summation order, and
    the same greedy tokens, with and without the drafter."""
    target, toks, logits = mxfp4_target
    cfg = target.config
    assert kimi.dispatch.serving_copy(target.config, sharded=False)
    dense = kimi.model.with_serving_layout(target)
    assert dense.config.expert_format == "dense"
    ex = dense.model.layers[1].block_sparse_moe.experts
    assert isinstance(ex.all_w13_D2EF, kimi.layers.ServingLayout)
    assert isinstance(ex.used_w13_D2F_0, kimi.layers.ServingLayout)  # per expert, an array of its own
    assert len(ex.used_layout()[0]) == cfg.num_experts
    np.testing.assert_allclose(logits, dense.prefill(toks, dense.init_cache(1, 16)).logits, atol=2e-6, rtol=0)
    # generate serves from the copy it makes itself: its tokens (plain, and DSpark with every accepted length)
    # must equal the checkpoint model's own step decoding (packed experts, no copy, no generate loop)
    ref = greedy_reference(target, toks[0], 32 + 4 + 1)
    drafter, want = oracle_drafter(target, toks[0], ref, 32, block_size=4, seed=6)
    ar = generation.generate(target, None, toks[0], max_new_tokens=32, eos_token_id=-1)
    sp = generation.generate(target, drafter, toks[0], max_new_tokens=32, eos_token_id=-1)
    np.testing.assert_array_equal(ar.tokens, ref[:32])
    np.testing.assert_array_equal(sp.tokens, ref[:32])
    assert_histogram(sp.stats, want, "serving copy")


def test_bf16_serving_is_lossless_and_close_to_fp32(mxfp4_target):
    """serving_dtype bfloat16: the serving copy's matmul weights in bf16 (target and drafter). Greedy DSpark equals
    plain decoding of the same bf16 serving token for token (decode pads its row, verify runs 8: the same
    rounding points); the bf16 serving logits stay within bf16 rounding of the fp32 model's."""
    fp32, toks, ref = mxfp4_target  # serving_dtype changes only the serving copy: ref is this target's logits too
    target = kimi.model.abstract_model(fp32.config.replace(serving_dtype="bfloat16"))
    nnx.update(target, nnx.state(fp32))  # the same weights
    served = kimi.model.with_serving_layout(target)
    lin = served.model.layers[1].block_sparse_moe.routed_expert_down_proj
    assert lin.kernel[...].dtype == jnp.bfloat16
    assert served.model.layers[1].block_sparse_moe.experts.used_layout()[0][0].dtype == jnp.bfloat16
    assert served.model.embed_tokens.embedding[...].dtype == jnp.float32
    got = served.prefill(toks, served.init_cache(1, 16)).logits
    err = float(jnp.max(jnp.abs(got - ref)))
    assert 0 < err < 0.05 * float(jnp.max(jnp.abs(ref)))  # changed (bf16 really used), but only by rounding
    ar = generation.generate(target, None, toks[0], max_new_tokens=32 + 4 + 1, eos_token_id=-1)
    drafter, want = oracle_drafter(target, toks[0], ar.tokens, 32, block_size=4, seed=7)
    served_d = jdspark.drafter.with_serving_layout(drafter, "bfloat16")
    assert served_d.fc.kernel[...].dtype == jnp.bfloat16
    assert served_d.dtype == jnp.float32 and served_d.init_cache(1, 8).k.dtype == jnp.float32  # fp32 activations
    sp = generation.generate(target, drafter, toks[0], max_new_tokens=32, eos_token_id=-1)
    np.testing.assert_array_equal(sp.tokens, ar.tokens[:32])
    assert_histogram(sp.stats, want, "bf16 serving")


def test_bf16_serving_prefill_of_many_rows_reads_the_copy(mxfp4_target, monkeypatch):
    """A prefill of many rows on the bf16 serving copy runs its routed experts either way dispatch.moe_path picks
    on a CPU ('all': the fused pair; 'blocked': experts_blocked_fused over the copy's bf16 per-expert layout, not
    its dense fp32 experts through experts_blocked): both round where the copy's decode and verify round, so
    they agree to fp32 summation order, and both stay within bf16 rounding of the fp32 checkpoint model."""
    from kimi.ops import moe as moe_ops
    fp32 = mxfp4_target[0]
    target = kimi.model.abstract_model(fp32.config.replace(serving_dtype="bfloat16"))
    nnx.update(target, nnx.state(fp32))
    served = kimi.model.with_serving_layout(target)
    toks = (np.arange(40, dtype=np.int32) * 7 % (fp32.config.vocab_size - 3) + 3)[None]
    ref = fp32.prefill(toks, fp32.init_cache(1, 48)).logits
    calls = collections.Counter()
    for name in ("experts_all_fused", "experts_blocked_fused", "experts_blocked"):
        fn = getattr(moe_ops, name)
        monkeypatch.setattr(moe_ops, name, lambda *a, _fn=fn, _name=name, **k: calls.update([_name]) or _fn(*a, **k))
    got = {}
    for path, ratio, max_len in (("all", 1e9, 48), ("blocked", 0.0, 56)):  # a cache of its own: a fresh trace
        monkeypatch.setattr(kimi.dispatch, "MOE_ALL_OVER_BLOCKED", ratio)
        calls.clear()
        got[path] = np.asarray(served.prefill(toks, served.init_cache(1, max_len)).logits)
        n_moe = fp32.config.ffn_kinds.count("moe")
        assert calls == {"experts_all_fused" if path == "all" else "experts_blocked_fused": n_moe}, calls
    scale = float(jnp.max(jnp.abs(ref)))
    np.testing.assert_allclose(got["blocked"], got["all"], rtol=0, atol=1e-4 * scale)
    for path in got:
        err = float(np.max(np.abs(got[path] - np.asarray(ref))))
        assert 0 < err < 0.05 * scale, (path, err)


def test_serving_copy_is_kept_until_the_weights_change(mxfp4_target):
    """generate serves a copy made once per set of weights (``serving_copy.serving_pair``): a second call, and plain
    decoding beside DSpark, reuse the target's copy; weights changed in place (new arrays) get a new copy, so the
    changed model is what is served, token for token, never the stale copy."""
    fixture, toks, _ = mxfp4_target
    target = nnx.merge(*nnx.split(fixture))  # the fixture's arrays in a module of its own (changed below)
    drafter = jdspark.DSparkDrafter(
        jdspark.DSparkConfig.for_target(target.config, block_size=4, mask_token_id=target.config.pad_token_id),
        target=target, rngs=nnx.Rngs(1))
    served_t, served_d = serving_copy.serving_pair(target, drafter)
    assert served_t is not target and served_d is not drafter  # a copy (dequantised, fused)
    again_t, again_d = serving_copy.serving_pair(target, drafter)
    assert again_t is served_t and again_d is served_d
    assert serving_copy.serving_pair(target, None)[0] is served_t  # plain decoding shares the target's copy
    before = generation.generate(target, drafter, toks[0], max_new_tokens=12, eos_token_id=-1).tokens
    assert serving_copy.serving_pair(target, drafter)[0] is served_t

    other = kimi.KimiForCausalLM(target.config, rngs=nnx.Rngs(9))
    nnx.update(target, nnx.state(other))  # the same module, every weight a new array
    assert serving_copy.serving_pair(target, drafter)[0] is not served_t
    assert serving_copy.serving_pair(target, drafter)[1] is served_d  # the drafter's weights did not change
    want = greedy_reference(target, toks[0], 12)
    assert not np.array_equal(want, before)  # the change is visible in the tokens
    np.testing.assert_array_equal(generation.generate(target, drafter, toks[0], max_new_tokens=12,
                                                       eos_token_id=-1).tokens, want)


def test_a_narrow_step_decodes_the_whole_block_s_first_drafts(tiny_cfg):
    """A step that verifies W tokens decodes only W - 1 drafts (``draft_block``'s ``n_slots``): its drafts, their
    proposals and their survival are the whole block's first W - 1 (the same hidden states and keys), greedy and
    sampled, so a serving engine's narrow widths change what a step costs, not what it drafts."""
    from jdspark.sampling import SamplingParams

    cfg = tiny_cfg
    target = kimi.KimiForCausalLM(cfg, rngs=nnx.Rngs(3))
    drafter = jdspark.DSparkDrafter(
        jdspark.DSparkConfig.for_target(cfg, block_size=4, mask_token_id=cfg.pad_token_id), target=target,
        rngs=nnx.Rngs(4))
    assert drafter.confidence_head is not None
    prompt = np.random.default_rng(1).integers(3, cfg.vocab_size, size=(1, 12)).astype(np.int32)
    st, _ = speculative.prefill_stream(target, drafter, jnp.asarray(prompt), jnp.int32(12), jax.random.key(0),
                                       SamplingParams(), 32)
    emb, lm = target.embed_tokens.embedding[...], target.lm_head_DV()

    def block(sp, n=None):
        return speculative.draft_block(drafter, st.dcache, st.anchor, st.cache.length, emb, lm, jax.random.key(7),
                                       sp, 0.0, confidence=True, n_slots=n)

    for sp in (SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9)):
        drafts, logq, n_verify, surv = block(sp)
        assert drafts.shape == (4,) and int(n_verify) == 4
        assert len(set(np.asarray(drafts).tolist())) > 1  # the drafts differ by slot: a comparison that can fail
        for n in (1, 3):
            d_n, lq_n, nv_n, s_n = block(sp, n)
            assert d_n.shape == (n,) and int(nv_n) == n
            np.testing.assert_array_equal(np.asarray(d_n), np.asarray(drafts)[:n])
            np.testing.assert_allclose(np.asarray(lq_n), np.asarray(logq)[:n], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(np.asarray(s_n), np.asarray(surv)[:n], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="n_slots: expected 1..4"):
        block(SamplingParams(), 5)


def test_a_step_that_verifies_no_drafts_draws_as_a_plain_step(tiny_cfg):
    """A seeded stream whose step verifies no drafts (draft cap 0: a ``speculative: false`` request stepped among
    drafting rows, or an adaptive row's narrow step) draws the token a plain decode step draws, with the same key
    after it (``speculative.step_keys``, ``sampling.bonus_key``): its tokens do not depend on which kind of step its
    batch ran. Before, the two split the key differently, and such a request's sampled text changed with its
    neighbours."""
    from jdspark.sampling import SamplingParams

    cfg = tiny_cfg
    target = kimi.KimiForCausalLM(cfg, rngs=nnx.Rngs(5))
    drafter = jdspark.DSparkDrafter(
        jdspark.DSparkConfig.for_target(cfg, block_size=4, mask_token_id=cfg.pad_token_id), target=target,
        rngs=nnx.Rngs(6))
    prompt = np.random.default_rng(2).integers(3, cfg.vocab_size, size=(1, 10)).astype(np.int32)
    plain = jax.jit(lambda st, sp: speculative.plain_step(target, st, sp, drafter=drafter))
    capped = jax.jit(lambda st, sp, w: speculative.spec_step(target, drafter, st, sp, width=w, max_drafts=0),
                     static_argnums=2)
    for sp in (SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.5, top_k=20),
               SamplingParams()):
        st0, _ = speculative.prefill_stream(target, drafter, jnp.asarray(prompt), jnp.int32(10), jax.random.key(3),
                                            sp, 48)
        for w in (2, 5):
            a, b, toks = st0, st0, []
            for _ in range(12):
                a, out_a = plain(a, sp)
                b, out_b = capped(b, sp, w)
                assert int(out_b.n_new) == 1 and int(out_b.drafted) == 0
                assert int(out_a.new_K[0]) == int(out_b.new_K[0])
                toks.append(int(out_a.new_K[0]))
            np.testing.assert_array_equal(jax.random.key_data(a.key), jax.random.key_data(b.key))
            if sp.temperature > 0:
                assert len(set(toks)) > 3  # drawn, not one token repeated: a comparison that can fail


def test_first_token_ids_mask_the_first_draw_only(tiny_cfg):
    """Token healing's mask (``first_token_ids``): the first token is the likeliest of the allowed ids under the
    model's own prefill (an independent reference: public prefill + decode), the tokens after it the plain greedy
    continuation from there, unmasked; DSpark gives the same tokens (the first comes from the prefill in both
    modes), and another allowed set reuses the program (the mask is traced)."""
    cfg = tiny_cfg
    target = scaled_target(cfg, 0.1)
    drafter = markov_drafter(target, bigram_map(scaled_target(cfg, 0.0)), 0.1, 30.0)
    prompt = np.random.default_rng(7).integers(3, cfg.vocab_size, size=11)
    logits = np.asarray(target.prefill(prompt[None].astype(np.int32), target.init_cache(1, 16)).logits)[0, -1]
    order = np.argsort(-logits)
    allowed = tuple(int(i) for i in order[5:9])  # the model's 6th-9th likeliest: never its own first choice
    n = generation.compiled_programs()
    ar = generation.generate(target, None, prompt, max_new_tokens=24, eos_token_id=-1, first_token_ids=allowed)
    assert ar.tokens[0] == order[5]
    want = greedy_reference(target, np.concatenate([prompt, ar.tokens[:1]]), 23)
    np.testing.assert_array_equal(ar.tokens[1:], want)  # the steps after the first are not masked
    sp = generation.generate(target, drafter, prompt, max_new_tokens=24, eos_token_id=-1, first_token_ids=allowed)
    np.testing.assert_array_equal(sp.tokens, ar.tokens)
    again = generation.generate(target, None, prompt, max_new_tokens=24, eos_token_id=-1,
                                 first_token_ids=(int(order[3]),))
    assert again.tokens[0] == order[3] and generation.compiled_programs() == n + 2
    with pytest.raises(ValueError, match="first_token_ids: token ids"):
        generation.generate(target, None, prompt, max_new_tokens=4, first_token_ids=(cfg.vocab_size,))


def test_generate_script_side_by_side_pools_its_prompts(tiny_cfg):
    """``scripts/generate.py``'s side-by-side figures (the demo's and --heldout's): DSpark's acceptance pooled over
    the prompts' steps, (accepted + steps) / steps and per-position counts / steps, equal to the sums of each
    prompt's own generation (two prompts of different acceptance: a mean of per-prompt ratios would differ); with
    no drafter, plain figures only."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "scripts"))
    import generate as gen

    cfg = tiny_cfg
    target = scaled_target(cfg, 0.1)
    drafter = markov_drafter(target, bigram_map(scaled_target(cfg, 0.0)), 0.1, 30.0)
    rng = np.random.default_rng(8)  # (greedy, 64 tokens: test_lossless_greedy_many_seeds' programs)
    runs = [(rng.integers(3, cfg.vocab_size, size=n), dict(max_new_tokens=64, eos_token_id=-1, seed=0))
            for n in (11, 40)]
    stats = [generation.generate(target, drafter, p, **kw).stats for p, kw in runs]
    steps = sum(int(st.target_steps) for st in stats)
    accepted = sum(int(st.accepted) for st in stats)
    assert len({round(st.accept_len, 6) for st in stats}) == 2
    got = gen.side_by_side(target, drafter, runs, repeats=1)
    assert got["accept_len"] == pytest.approx((accepted + steps) / steps)
    counts = sum(np.asarray(st.accept_counts, np.int64) for st in stats)
    np.testing.assert_allclose(got["per_position_accept"], counts / steps)
    assert got["spec_tok_s"] > 0 and got["ar_tok_s"] > 0
    assert got["speedup"] == pytest.approx(got["spec_tok_s"] / got["ar_tok_s"])
    assert set(gen.side_by_side(target, None, runs[:1], repeats=1, also=(1,))) == {"ar_tok_s"}
    # another draft count timed beside it (--num-speculative-tokens N M): pooled over its own generations' steps
    both = gen.side_by_side(target, drafter, runs, repeats=1, also=(1,))
    one = both["also"]["1"]
    stats = [generation.generate(target, drafter, p, num_speculative_tokens=1, **kw).stats for p, kw in runs]
    steps, accepted = sum(int(st.target_steps) for st in stats), sum(int(st.accepted) for st in stats)
    assert one["accept_len"] == pytest.approx((accepted + steps) / steps) and 1.0 < one["accept_len"] <= 2.0
    assert both["accept_len"] == pytest.approx(got["accept_len"])  # the block's figures as without it
    assert one["speedup"] == pytest.approx(one["spec_tok_s"] / both["ar_tok_s"])
