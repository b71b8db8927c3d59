"""generate(): lossless (greedy token for token; sampling in distribution), one compiled program, statistics.

Acceptance must range from none to all, so the drafters here are built, not trained. Greedy: the oracle drafter
(tests/oracle_drafter.py) drafts the reference continuation with one slot per block corrupted on a schedule, so
the acceptance histogram is known exactly and holds every length 0..G; or the target's output projections are
scaled by eps, which makes it (for eps = 0) an exact bigram model g(prev) -> next, and the drafter is given a
full-rank Markov head that encodes g (its backbone output is switched off). eps > 0 lets the context (KDA and MLA
state, MoE, AttnRes) perturb the target, so some drafts fail. Sampling: the law of every emitted token given the
tokens before it, against the NumPy reference (tests/jdspark/sampling_ref.py) on the target's teacher-forced logits.
"""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jdspark
import kimi
from jdspark import speculative
from jdspark.sampling import SamplingParams
from tests.jdspark import sampling_ref
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
            ar = speculative.generate(target, None, p, max_new_tokens=64, eos_token_id=-1)
            sp = speculative.generate(target, drafter, p, max_new_tokens=64, eos_token_id=-1)
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
    speculative.generate(target, drafter, np.arange(3, 13), max_new_tokens=16)
    n = speculative.compiled_programs()
    out = speculative.generate(target, drafter, np.arange(20, 50), max_new_tokens=16, seed=5)  # same bucket (64)
    assert speculative.compiled_programs() == n
    assert out.num_tokens == 16


def test_bad_input(tiny_cfg):
    target = kimi.KimiForCausalLM(tiny_cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="vocabulary"):
        speculative.generate(target, None, [1, tiny_cfg.vocab_size])
    with pytest.raises(ValueError, match="batch 1"):
        speculative.generate(target, None, np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative.generate(target, None, [1, 2], max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        speculative.generate(target, None, [1, 2], temperature=1.0, top_p=0.0)


# ---------------------------------------------------------------------------------------------------- sampling
T_LAW, N_LAW, ALPHA = 11, 3000, 1e-4  # tokens per draw (the prefill's + at least 2 full steps), draws, per check


def _sample(target, drafter, prompt, sp: SamplingParams, threshold: float, n: int, seed: int):
    """n independent generations of T_LAW tokens, vmapped over the key: (tokens [n, T_LAW], GenStats of [n])."""
    t_graph, t_state = nnx.split(target)
    d_graph, d_state = nnx.split(drafter)
    padded = jnp.asarray(np.array(prompt, np.int32)[None])

    def one(k):
        out, _, st = speculative._generate_program(t_graph, d_graph, T_LAW, sp, -1, threshold, t_state, d_state,
                                                   padded, jnp.int32(len(prompt)), k)
        return out[:T_LAW], st

    toks, st = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(seed), n))
    return np.asarray(toks), jax.device_get(st)


def _conditional_law(target, prompt, draws, sp: SamplingParams) -> np.ndarray:
    """p_t(. | prompt, draws[:, :t]) for every draw and position t, by the NumPy reference applied to the target's
    teacher-forced logits (one prefill over all draws): [n, T_LAW, V]."""
    P = len(prompt)
    seqs = np.concatenate([np.broadcast_to(np.asarray(prompt, np.int32), (len(draws), P)), draws], 1)
    logits = []
    for c in range(0, len(seqs), 2000):
        chunk = seqs[c:c + 2000, :-1]
        logits.append(np.asarray(target.prefill(chunk, target.init_cache(len(chunk), chunk.shape[1])).logits))
    logits = np.concatenate(logits)[:, P - 1:]
    return sampling_ref.process(logits, sp.temperature, sp.top_k, sp.top_p)


def _position_pvalues(draws, law) -> list:
    """Per position t, two Pearson tests of the drawn tokens against the conditional laws: cells = token ids, and
    cells = the token's rank under its own law. Under a lossless sampler each draw's token at t is, given its
    prefix, one multinomial draw from law[i, t]; the counts per cell are a sum of independent non-identical
    multinomials whose covariance is at most the multinomial's with the averaged law, so the statistic is
    stochastically at most chi-square (conservative): a correct sampler fails a check with probability <= ALPHA."""
    n, T, V = law.shape
    order = np.argsort(-law, axis=-1, kind="stable")  # rank 0 = most likely, ties by index
    rank = np.argsort(order, axis=-1)
    out = []
    for t in range(T):
        x = draws[:, t]
        p_x = law[np.arange(n), t, x]
        assert (p_x > 0).all(), f"position {t}: sampled a token the processed target law gives probability 0"
        by_token = sampling_ref.pearson_pvalue(np.bincount(x, minlength=V), law[:, t].mean(0))
        r = rank[np.arange(n), t, x]
        by_rank = sampling_ref.pearson_pvalue(np.bincount(r, minlength=V),
                                              np.take_along_axis(law[:, t], order[:, t], -1).mean(0))
        out.append((by_token, by_rank))
    return out


@pytest.fixture(scope="module")
def law_pair():
    # 16 experts: every forward here routes fewer rows than experts, so the MoE takes the gathered path (vmappable)
    cfg = kimi.KimiConfig.tiny(vocab_size=8, bos_token_id=1, eos_token_id=2, pad_token_id=0, num_experts=16)
    target = scaled_target(cfg, 0.5, seed=2)  # eps 0.5: the law depends on the whole context
    g = bigram_map(scaled_target(cfg, 0.0, seed=2))
    drafter = markov_drafter(target, g, 0.2, 1.0, seed=2)  # soft q, partly wrong: accepts and rejects both happen
    # the confidence head reads [hidden ; onehot(prev)] (Markov rank V, W1 = I): a logit per previous token, so
    # under a threshold the number of verified drafts varies with the drafted tokens
    ch = drafter.confidence_head.proj
    D = cfg.hidden_size
    ch.kernel[...] = jnp.zeros_like(ch.kernel[...]).at[D:, 0].set(jnp.linspace(-1.0, 4.0, cfg.vocab_size))
    ch.bias[...] = jnp.zeros_like(ch.bias[...]) + 1.0
    return target, drafter


@pytest.mark.parametrize("temperature,top_k,top_p,threshold", [(1.0, 0, 0.8, 0.0), (0.8, 4, 1.0, 0.3)])
def test_lossless_sampling_law_at_every_position(law_pair, temperature, top_k, top_p, threshold):
    """DSpark sampling (rejection rule, residual resampling, bonus, commit, a second and third step after a
    sampled commit, and under a confidence threshold) draws every token from the target's processed law given
    the tokens before it, the law computed by the NumPy reference. 11 tokens = the prefill's + >= 2 steps of up
    to G+1 = 5 tokens, so every block slot of the first two steps is tested. 2 checks per position at ALPHA:
    a correct sampler fails this test with probability <= 22 * ALPHA = 2.2e-3."""
    target, drafter = law_pair
    sp = SamplingParams(temperature, top_k, top_p)
    prompt = [3, 5, 4]
    draws, st = _sample(target, drafter, prompt, sp, threshold, N_LAW, seed=int(10 * temperature) + top_k)
    total = types.SimpleNamespace(target_steps=np.sum(st.target_steps), accept_counts=np.sum(st.accept_counts, 0))
    hist = histogram(total, 4)  # (linear in the counts: the sum of the draws' histograms)
    print(f"acceptance histogram T={temperature} k={top_k} p={top_p} threshold={threshold} "
          f"(steps with 0..4 accepted, all draws): {hist.tolist()}")
    assert (hist > 0).all(), hist
    assert np.asarray(st.target_steps).min() >= 2
    if threshold > 0:  # verification really truncated, to every length
        assert (np.asarray(st.drafted) < 4 * np.asarray(st.target_steps)).mean() > 0.5
    law = _conditional_law(target, prompt, draws, sp)
    pv = _position_pvalues(draws, law)
    bad = [(t, p) for t, p in enumerate(pv) if min(p) <= ALPHA]
    assert not bad, f"positions failing (token, rank) p-values: {bad}"


def test_serving_layout_matches_the_checkpoint_model():
    """The serving copy (MXFP4 unpacked, fused layouts) gives the same logits up to float summation order, and
    the same greedy tokens, with and without the drafter."""
    cfg = kimi.KimiConfig.tiny(expert_format="mxfp4", moe_intermediate_size=32, routed_expert_hidden_size=64)
    target = kimi.KimiForCausalLM(cfg, rngs=nnx.Rngs(5))
    assert kimi.dispatch.serving_copy(target.config, sharded=False)
    dense = kimi.model.with_serving_layout(target)
    assert dense.config.expert_format == "dense"
    ex = dense.model.layers[1].block_sparse_moe.experts
    assert isinstance(ex.all_w13_D2EF, kimi.layers.ServingLayout)
    assert isinstance(ex.used_w13_D2F_0, kimi.layers.ServingLayout)  # per expert, an array of its own
    assert len(ex.used_layout()[0]) == cfg.num_experts
    toks = np.arange(3, 12, dtype=np.int32)[None]
    np.testing.assert_allclose(target.prefill(toks, target.init_cache(1, 16)).logits,
                               dense.prefill(toks, dense.init_cache(1, 16)).logits, atol=2e-6, rtol=0)
    # generate serves from the copy it makes itself: its tokens (plain, and DSpark with every accepted length)
    # must equal the checkpoint model's own step decoding (packed experts, no copy, no generate loop)
    ref = greedy_reference(target, toks[0], 32 + 4 + 1)
    drafter, want = oracle_drafter(target, toks[0], ref, 32, block_size=4, seed=6)
    ar = speculative.generate(target, None, toks[0], max_new_tokens=32, eos_token_id=-1)
    sp = speculative.generate(target, drafter, toks[0], max_new_tokens=32, eos_token_id=-1)
    np.testing.assert_array_equal(ar.tokens, ref[:32])
    np.testing.assert_array_equal(sp.tokens, ref[:32])
    assert_histogram(sp.stats, want, "serving copy")


def test_bf16_serving_is_lossless_and_close_to_fp32():
    """serving_dtype bfloat16: the serving copy's matmul weights in bf16 (target and drafter). Greedy DSpark equals
    plain decoding of the same bf16 serving token for token (decode pads its row, verify runs 8: the same
    rounding points); the bf16 serving logits stay within bf16 rounding of the fp32 model's."""
    cfg = kimi.KimiConfig.tiny(expert_format="mxfp4", moe_intermediate_size=32, routed_expert_hidden_size=64,
                               serving_dtype="bfloat16")
    target = kimi.KimiForCausalLM(cfg, rngs=nnx.Rngs(5))
    served = kimi.model.with_serving_layout(target)
    lin = served.model.layers[1].block_sparse_moe.routed_expert_down_proj
    assert lin.kernel[...].dtype == jnp.bfloat16
    assert served.model.layers[1].block_sparse_moe.experts.used_layout()[0][0].dtype == jnp.bfloat16
    assert served.model.embed_tokens.embedding[...].dtype == jnp.float32
    toks = np.arange(3, 12, dtype=np.int32)[None]
    ref = target.prefill(toks, target.init_cache(1, 16)).logits
    got = served.prefill(toks, served.init_cache(1, 16)).logits
    err = float(jnp.max(jnp.abs(got - ref)))
    assert 0 < err < 0.05 * float(jnp.max(jnp.abs(ref)))  # changed (bf16 really used), but only by rounding
    ar = speculative.generate(target, None, toks[0], max_new_tokens=32 + 4 + 1, eos_token_id=-1)
    drafter, want = oracle_drafter(target, toks[0], ar.tokens, 32, block_size=4, seed=7)
    served_d = jdspark.drafter.with_serving_layout(drafter, "bfloat16")
    assert served_d.fc.kernel[...].dtype == jnp.bfloat16
    assert served_d.dtype == jnp.float32 and served_d.init_cache(1, 8).k.dtype == jnp.float32  # fp32 activations
    sp = speculative.generate(target, drafter, toks[0], max_new_tokens=32, eos_token_id=-1)
    np.testing.assert_array_equal(sp.tokens, ar.tokens[:32])
    assert_histogram(sp.stats, want, "bf16 serving")
