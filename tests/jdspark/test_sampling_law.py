"""Lossless sampling, tested on the law of every emitted token: batch-1 ``generate`` (rejection rule, residual,
bonus, later steps after sampled commits, a confidence threshold) and the serving slots (rows verified at widths
chosen per step, by the adaptive scheduler and by a fixed cycle, among many rows of one batch). Each token's law
given the tokens before it is computed by the NumPy reference (tests/jdspark/sampling_ref.py) on the target's
teacher-forced logits. The models are built, not trained (tests/jdspark/test_speculative.py): drafts are both
accepted and rejected (the histograms are asserted)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kimi
from jdspark import generation, serving_copy
from jdspark.adaptive import monotone_costs
from jdspark.engine import SamplingRequest
from jdspark.grammar import TokenFSM
from jdspark.sampling import Penalties, SamplingParams, logit_controls
from jdspark.slots import SlotBackend
from tests.jdspark import sampling_ref
from tests.jdspark.test_speculative import bigram_map, markov_drafter, scaled_target
from tests.oracle_drafter import histogram

# thousands of generations (and their teacher-forced logits) in one program each: run time dominates, so these
# are compiled with the optimising backend (the suite's default is -O0, tests/conftest.py)
_OPTIMISED = {"xla_backend_optimization_level": 2}
T_LAW, N_LAW, ALPHA = 11, 3000, 1e-4  # tokens per draw (the prefill's + at least 2 full steps), draws, per check


def _sample(target, drafter, prompt, sp: SamplingParams, threshold: float, n: int, seed: int, penalties=None,
            controls=None):
    """n independent generations of T_LAW tokens, vmapped over the key: (tokens [n, T_LAW], GenStats of [n])."""
    served_t, served_d = serving_copy.serving_pair(target, drafter)
    t_graph, t_state = nnx.split(served_t)
    d_graph, d_state = nnx.split(served_d)
    padded = jnp.asarray(np.array(prompt, np.int32)[None])

    def one(k):
        out, _, st = generation._generate_program(t_graph, d_graph, T_LAW, sp, -1, threshold, t_state, d_state,
                                                   padded, jnp.int32(len(prompt)), k, None, None, None,
                                                   penalties, controls)
        return out[:T_LAW], st

    run = jax.jit(jax.vmap(one), compiler_options=_OPTIMISED)
    toks, st = run(jax.random.split(jax.random.key(seed), n))
    return np.asarray(toks), jax.device_get(st)


def _conditional_law(target, prompt, draws, sp: SamplingParams, penalties=None, fsm=None, **controls) -> np.ndarray:
    """p_t(. | prompt, draws[:, :t]) for every draw and position t, by the NumPy reference applied to the target's
    teacher-forced logits (one prefill over all draws): [n, T_LAW, V]; with ``penalties`` (a ``Penalties``) the
    logits penalised first (``sampling_ref.penalize``: each draw's tokens before t counted, the prompt's seen;
    ``controls`` its logit_bias / stop_ids / min_tokens)."""
    P = len(prompt)
    seqs = np.concatenate([np.broadcast_to(np.asarray(prompt, np.int32), (len(draws), P)), draws], 1)
    graph, state = nnx.split(target)
    prefill = jax.jit(kimi.model._forward_pure, static_argnums=(0, 4, 5), compiler_options=_OPTIMISED)
    logits = []
    for c in range(0, len(seqs), 2000):
        chunk = jnp.asarray(seqs[c:c + 2000, :-1])
        cache = target.init_cache(chunk.shape[0], chunk.shape[1])
        logits.append(np.asarray(prefill(graph, state, chunk, cache, "prefill", ()).logits))
    logits = np.concatenate(logits)[:, P - 1:]
    if penalties is not None:
        V = logits.shape[-1]
        hot = np.eye(V, dtype=np.int64)[draws]  # [n, T, V]
        before = np.cumsum(hot, axis=1) - hot
        logits = sampling_ref.penalize(logits, before, np.isin(np.arange(V), prompt), penalties.repetition,
                                       penalties.frequency, penalties.presence, **controls)
    if fsm is not None:  # the automaton's state after each draw's tokens before t; its table masks the logits
        q = np.zeros(len(draws), np.int64)
        for t in range(draws.shape[1]):
            logits[:, t] = np.where(fsm[q] >= 0, logits[:, t], -np.inf)
            q = fsm[q, draws[:, t]]
            assert (q >= 0).all(), f"position {t}: a token the automaton refuses was drawn"
    return sampling_ref.process(logits, sp.temperature, sp.top_k, sp.top_p, sp.min_p)


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


# the second case's penalties, logit_bias, and min_tokens holding EOS (id 2) back for the first 6 tokens
PEN_CASE = dict(pen=(1.6, 0.4, 0.3), logit_bias={6: 1.5, 7: -2.0, 2: 1.0}, min_tokens=6)


@pytest.mark.parametrize("temperature,top_k,top_p,threshold,pen", [(1.0, 0, 0.8, 0.0, None),
                                                                    (0.8, 4, 1.0, 0.3, PEN_CASE)])
def test_lossless_sampling_law_at_every_position(law_pair, temperature, top_k, top_p, threshold, pen):
    """DSpark sampling (rejection rule, residual resampling, bonus, commit, a second and third step after a
    sampled commit, and under a confidence threshold) draws every token from the target's processed law given
    the tokens before it, the law computed by the NumPy reference. 11 tokens = the prefill's + >= 2 steps of up
    to G+1 = 5 tokens, so every block slot of the first two steps is tested. 2 checks per position at ALPHA:
    a correct sampler fails this test with probability <= 22 * ALPHA = 2.2e-3.

    The second case also applies repetition / frequency / presence penalties (``sampling.Penalties``), which move
    the law at every position with the tokens before it (drafts included at every verified position), a
    logit_bias, and min_tokens (EOS impossible before the sixth token, inside the second step's block): its law is
    ``sampling_ref.penalize`` then ``process`` (in one case, not a test of their own: each law test is a compile
    and 3000 generations of CI time)."""
    target, drafter = law_pair
    sp = SamplingParams(temperature, top_k, top_p)
    controls, ref_controls = None, {}
    if pen is not None:
        V, eos = target.config.vocab_size, target.config.eos_token_id
        controls = logit_controls(V, pen["logit_bias"], pen["min_tokens"], (eos,))
        ref_controls = dict(logit_bias=pen["logit_bias"], stop_ids=(eos,), min_tokens=pen["min_tokens"])
        pen = Penalties(*pen["pen"])
    prompt = [3, 5, 4]
    draws, st = _sample(target, drafter, prompt, sp, threshold, N_LAW, seed=int(10 * temperature) + top_k,
                        penalties=pen, controls=controls)
    total = types.SimpleNamespace(target_steps=np.sum(st.target_steps), accept_counts=np.sum(st.accept_counts, 0))
    hist = histogram(total, 4)  # (linear in the counts: the sum of the draws' histograms)
    print(f"acceptance histogram T={temperature} k={top_k} p={top_p} threshold={threshold} penalties={pen} "
          f"(steps with 0..4 accepted, all draws): {hist.tolist()}")
    assert (hist > 0).all(), hist
    assert np.asarray(st.target_steps).min() >= 2
    if threshold > 0:  # verification really truncated, to every length
        assert (np.asarray(st.drafted) < 4 * np.asarray(st.target_steps)).mean() > 0.5
    law = _conditional_law(target, prompt, draws, sp, pen, **ref_controls)
    if pen is not None:
        assert np.abs(law - _conditional_law(target, prompt, draws, sp)).max() > 0.1  # the penalties move it
        eos_t = (draws == 2).mean(0)
        assert eos_t[:6].max() == 0 and eos_t[6:].max() > 0.01, eos_t  # EOS held back, then drawn
    pv = _position_pvalues(draws, law)
    bad = [(t, p) for t, p in enumerate(pv) if min(p) <= ALPHA]
    assert not bad, f"positions failing (token, rank) p-values: {bad}"


N_SLOTS_LAW = 1000  # rows of one slots batch (one request each)


# a cyclic automaton over the law pair's 8 ids (0, 1, 2: pad, BOS, EOS never): state q = the last token's class
# (v % 3); from state q the ids 3 + q and 6 - q are refused, so the mask moves with every token drawn
FSM = np.array([[-1, -1, -1] + [v % 3 if v not in (3 + q, 6 - q) else -1 for v in range(3, 8)] for q in range(3)],
               np.int32)


def _slots_draws(target, drafter, prompt, sp: SamplingParams, n: int, T: int):
    """n requests of the same prompt (seeds 0..n-1) in one n-slot backend, stepped together until each has T
    tokens; even steps at the adaptive scheduler's width (a cost table that makes it move with the survival
    curves), odd steps cycling through every compiled width. Returns (draws [n, T], backend, drafted, accepted)."""
    be = SlotBackend(target, drafter, num_slots=n, max_len=32, prompt_buckets=(8,), batch_buckets=(n,),
                     adaptive=True, widths=(1, 3, 5), guided_states=FSM.shape[0])
    be.costs = monotone_costs({(n, w): 1.0 + 0.45 * (w - 1) for w in be.widths})
    out = [[] for _ in range(n)]
    for s in range(n):
        out[s] += be.insert(s, SamplingRequest(tuple(prompt), T, sp.temperature, sp.top_p, sp.top_k, seed=s,
                                               min_p=sp.min_p, grammar=TokenFSM(FSM))).tokens
    cycle, t, drafted, accepted = (3, 1, 5), 0, 0, 0
    while min(len(o) for o in out) < T:
        res = be.step(list(range(n)), width=None if t % 2 == 0 else cycle[(t // 2) % len(cycle)])
        for s, r in res.items():
            out[s] += r.tokens
            drafted, accepted = drafted + r.drafted, accepted + r.accepted
        t += 1
    return np.array([o[:T] for o in out], np.int32), be, drafted, accepted


def test_serving_slots_sample_the_target_law_at_every_width(law_pair):
    """The slots backend's sampled tokens follow the target's processed law at every position, with verify widths
    chosen by the adaptive scheduler (from the previous step's survival: lossless) and cycled through 1, 3, 5,
    1000 rows in one batch, each request's top-p and min-p carried by the host columns and its tokens constrained by
    an automaton (``jdspark.grammar``: ``FSM``, whose mask moves with every token). 8 positions x 2 checks at
    ALPHA: false-failure rate <= 1.6e-3.

    In this CPU's sampling form ("bisect", ``dispatch.sampling_form``) only: the other ("sort", a GPU's) differs in
    the primitives alone (the nucleus and the draw), whose laws are tested in both forms (test_sampling.py:
    ``draw``, the rejection rule and residual, processed logits), and whose per-row forms equal the static ones in
    both (test_sampling_rows.py); what this test adds, the slots' keys, widths and commits, is the same code in
    either form. (Run in both it cost ~33 s of a cold CI run each.)"""
    target, drafter = law_pair
    sp = SamplingParams(1.0, 0, 0.9, 0.75)  # the law is flat here (p within ~1.5x of the largest): min-p bites
    prompt = [3, 5, 4]
    assert kimi.dispatch.sampling_form() == "bisect"
    draws, be, drafted, accepted = _slots_draws(target, drafter, prompt, sp, N_SLOTS_LAW, 8)
    print(f"slots law: steps per width {dict(sorted(be.width_counts.items()))}, drafted {drafted}, "
          f"accepted {accepted}")
    assert 0 < accepted < drafted  # drafts both accepted and rejected
    assert all(be.width_counts[w] > 0 for w in be.widths)
    law = _conditional_law(target, prompt, draws, sp, fsm=FSM)
    assert np.abs(law - _conditional_law(target, prompt, draws, SamplingParams(1.0, 0, 0.9), fsm=FSM)).max() > 0.05
    assert np.abs(law - _conditional_law(target, prompt, draws, sp)).max() > 0.05  # the automaton moves it too
    pv = _position_pvalues(draws, law)
    bad = [(t, p) for t, p in enumerate(pv) if min(p) <= ALPHA]
    assert not bad, f"positions failing (token, rank) p-values: {bad}"
