"""generate() under real partial acceptance, greedy: the oracle drafter (tests/oracle_drafter.py) drafts the
target's own greedy continuation with one slot per block corrupted on a schedule, so every accepted length 0..G
occurs and the acceptance histogram of a correct run is known exactly. The reference tokens come from the model's
own prefill + step decode (no generate loop). Also: confidence-threshold truncation, EOS inside an accepted block /
as the first token / under sampling, and the stream callback."""
import dataclasses

import numpy as np
import pytest
from flax import nnx

import jdspark
import kimi
from tests.oracle_drafter import assert_histogram, greedy_reference, oracle_drafter

G, N = 4, 48  # block size, tokens generated


@pytest.fixture(scope="module")
def tiny():
    """The tiny target (every feature: KDA + MLA, LatentMoE, AttnRes) with random weights: its tokens depend on
    the whole context, so a wrong KDA/conv/MLA commit changes them."""
    target = kimi.KimiForCausalLM(kimi.KimiConfig.tiny(), rngs=nnx.Rngs(3))
    prompt = np.random.default_rng(3).integers(3, target.config.vocab_size, 17)
    return target, prompt, greedy_reference(target, prompt, N + G + 1)


def test_plain_decoding_equals_the_step_decoder(tiny):
    target, prompt, ref = tiny
    ar = jdspark.generate(target, None, prompt, max_new_tokens=N, eos_token_id=-1)
    np.testing.assert_array_equal(ar.tokens, ref[:N])
    assert int(ar.stats.target_steps) == N - 1 and int(ar.stats.drafted) == 0


def test_greedy_lossless_with_every_accepted_length(tiny):
    target, prompt, ref = tiny
    drafter, want = oracle_drafter(target, prompt, ref, N, block_size=G, seed=0)
    out = jdspark.generate(target, drafter, prompt, max_new_tokens=N, eos_token_id=-1)
    np.testing.assert_array_equal(out.tokens, ref[:N])
    assert_histogram(out.stats, want, "tiny greedy")


def test_confidence_truncation_greedy_lossless(tiny):
    """The confidence head stops verification after n_verify drafts (0..G, on a schedule independent of where the
    drafts go wrong): exactly min(cut, n_verify) accepted, drafted = sum of n_verify, the same tokens."""
    target, prompt, ref = tiny
    drafter, want = oracle_drafter(target, prompt, ref, N, block_size=G, seed=1, truncate=True)
    assert sorted(set(want.verified)) == list(range(G + 1))
    assert any(v < c for c, v in zip(drafter.cuts, drafter.verify_cuts))  # truncation cuts right drafts too
    out = jdspark.generate(target, drafter, prompt, max_new_tokens=N, eos_token_id=-1, confidence_threshold=0.5)
    np.testing.assert_array_equal(out.tokens, ref[:N])
    assert_histogram(out.stats, want, "tiny greedy, confidence-truncated")



def test_fewer_speculative_tokens_greedy_lossless(tiny):
    """``num_speculative_tokens`` n < G: every step verifies only the block's first n drafts, so exactly
    min(cut, n) are accepted (every length 0..n occurs, none longer), n drafted a step, the same tokens; out of
    range: a ValueError naming it; plain decoding ignores it."""
    target, prompt, ref = tiny
    n = 2
    drafter, want = oracle_drafter(target, prompt, ref, N, block_size=G, seed=0, num_drafts=n)
    assert set(want.verified) == {n}
    out = jdspark.generate(target, drafter, prompt, max_new_tokens=N, eos_token_id=-1, num_speculative_tokens=n)
    np.testing.assert_array_equal(out.tokens, ref[:N])
    assert_histogram(out.stats, want, f"tiny greedy, {n} drafts a step", longest=n)
    assert not np.asarray(out.stats.accept_counts)[n:].any()
    for bad in (0, G + 1, 1.5, True):
        with pytest.raises(ValueError, match=f"num_speculative_tokens: expected an int in 1..{G}"):
            jdspark.generate(target, drafter, prompt, max_new_tokens=N, num_speculative_tokens=bad)
    plain = jdspark.generate(target, None, prompt, max_new_tokens=N, eos_token_id=-1, num_speculative_tokens=n)
    np.testing.assert_array_equal(plain.tokens, ref[:N])

# ---------------------------------------------------------------------------------------------------- EOS, stream
@pytest.fixture(scope="module")
def small():
    """A 2-layer target (KDA, then MLA with the LatentMoE): EOS and stream each compile their own program."""
    cfg = kimi.KimiConfig.tiny(num_hidden_layers=2, kda_layers=(1,), full_attn_layers=(2,), first_k_dense_replace=0)
    target = kimi.KimiForCausalLM(cfg, rngs=nnx.Rngs(4))
    prompt = np.random.default_rng(4).integers(3, cfg.vocab_size, 9)
    ref = greedy_reference(target, prompt, N + G + 1)
    drafter, want = oracle_drafter(target, prompt, ref, N, block_size=G, seed=2)
    return target, prompt, ref, drafter, want


def _eos_inside_a_block(ref, want):
    """(index in the output, step) of a token that is an accepted draft but not its block's first, appears
    nowhere before, and comes after every accepted length has occurred: the latest such one."""
    best, n_out, seen = None, 1, set()
    for step, m in enumerate(want.lengths):
        seen.add(m)
        for j in range(1, m):  # accepted drafts j = 1 .. m-1 of this step (0-based slot j: not the first)
            idx = n_out + j
            if int(ref[idx]) not in ref[:idx].tolist() and len(seen) == G + 1:
                best = (idx, step)
        n_out += m + 1
    assert best is not None
    return best


def test_eos_inside_an_accepted_block_stream_and_first_token(small):
    target, prompt, ref, drafter, want = small
    idx, step = _eos_inside_a_block(ref[:N], want)
    eos = int(ref[idx])
    chunks = []

    def stream(ids):  # one function object for both drafted calls below: stream is static, so one program
        chunks.append(np.array(ids))

    out = jdspark.generate(target, drafter, prompt, max_new_tokens=N, eos_token_id=eos, stream=stream)
    np.testing.assert_array_equal(out.tokens, ref[:idx + 1])  # stopped at EOS, EOS kept, the rest dropped
    trunc = dataclasses.replace(want, lengths=want.lengths[:step + 1], verified=want.verified[:step + 1])
    assert_histogram(out.stats, trunc, "small greedy, EOS inside a block")
    # the stream saw exactly the returned tokens, in order, one chunk per step: the prefill's token, then each
    # step's accepted drafts + bonus, the last cut after EOS
    np.testing.assert_array_equal(np.concatenate(chunks), out.tokens)
    sizes = [1] + [m + 1 for m in want.lengths[:step + 1]]
    sizes[-1] = idx + 1 - sum(sizes[:-1])
    assert [len(c) for c in chunks] == sizes
    plain = jdspark.generate(target, None, prompt, max_new_tokens=N, eos_token_id=eos)
    np.testing.assert_array_equal(plain.tokens, ref[:idx + 1])
    # EOS as the first token: the prompt extended by the tokens before it (same padded length, same positions,
    # same program): the prefill's token is EOS, no step runs, the stream gets just it
    n_chunks = len(chunks)
    first = jdspark.generate(target, drafter, np.concatenate([prompt, ref[:idx]]), max_new_tokens=N,
                             eos_token_id=eos, stream=stream)
    assert first.tokens.tolist() == [eos] and int(first.stats.target_steps) == 0
    assert [c.tolist() for c in chunks[n_chunks:]] == [[eos]]


def test_eos_under_sampling_cuts_the_same_draws(small):
    """The random stream does not depend on EOS: with the same seed, sampling with an EOS id gives the EOS-free
    sample cut after its first EOS."""
    target, prompt, ref, drafter, _ = small
    free = [jdspark.generate(target, drafter, prompt, max_new_tokens=N, temperature=1.0, top_k=20, seed=s,
                             eos_token_id=-1).tokens for s in range(3)]
    eos = next(int(t) for t in free[0][N // 2:] if int(t) not in free[0][:N // 2].tolist())
    for s, f in enumerate(free):
        got = jdspark.generate(target, drafter, prompt, max_new_tokens=N, temperature=1.0, top_k=20, seed=s,
                               eos_token_id=eos).tokens
        hit = np.flatnonzero(f == eos)
        np.testing.assert_array_equal(got, f[:hit[0] + 1] if len(hit) else f, err_msg=f"seed {s}")
