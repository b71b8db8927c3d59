"""Constrained decoding (``jdspark.grammar``): the token table against a brute force over every state and token,
generate's constrained greedy output (plain and DSpark, drafts accepted and rejected) against a decoder that masks
the target's teacher-forced logits on the host, and the serving slots' constrained rows (greedy and sampled, beside
unconstrained ones) equal to batch-1 generate token for token."""

import random
import re
import zlib

import numpy as np
import pytest

import jdspark
from jdspark.engine import SamplingRequest
from jdspark.grammar import TokenFSM, choice_automaton, choice_fsm, regex_automaton, token_fsm
from jdspark.slots import SlotBackend
from kimi.tokenizer import ByteTokenizer
from tests.jdspark.test_logprobs import pair  # noqa: F401  (the tiny pair: drafts partly wrong)

EOS = 2


def _brute(choices, token_bytes, V, stops):
    """next[q, v] from the definition: states are the choices' prefixes (q = the trie's numbering, rebuilt here by
    first appearance); v goes from prefix p to p + bytes(v) where that is a prefix of a choice."""
    prefixes = [b""]
    for c in choices:
        for i in range(1, len(c) + 1):
            if c[:i] not in prefixes:
                prefixes.append(c[:i])
    out = np.full((len(prefixes), V), -1, np.int64)
    for q, p in enumerate(prefixes):
        for v in range(V):
            b = token_bytes[v] if v < len(token_bytes) else None
            if v in stops:
                out[q, v] = q if p in choices else -1
            elif b and p + b in prefixes:
                out[q, v] = prefixes.index(p + b)
    return out


@pytest.mark.parametrize("vocab", ["bytes", "pieces"])
def test_token_table_equals_the_definition(vocab):
    """Every state and token: the table's next state is the brute force's (the trie numbers prefixes in order of
    first appearance, as the brute force does); stop ids only where a whole choice ends; special ids never."""
    choices = [b"yes", b"no", b"not sure", "né".encode()]
    if vocab == "bytes":
        tok = ByteTokenizer()
        tb = [tok.token_bytes(v) if v < 256 else None for v in range(tok.vocab_size)]
        got = choice_fsm([c.decode() for c in choices], tok, tok.vocab_size, (tok.eos_id,)).next_QV
        V, stops = tok.vocab_size, {tok.eos_id}
    else:  # multi-byte tokens, one that spans a choice's end and one spanning two characters' bytes
        tb = [None, None, None, b"y", b"yes", b"no", b"not", b" ", b"sure", b"n", b"ot s", b"e", b"s",
              "é".encode()[:1], "é".encode()[1:], "é".encode(), b"o", b"nox", b""]
        V, stops = len(tb), {2}
        delta, accept = choice_automaton(choices)
        got = token_fsm(delta, accept, tb, V, (2,)).next_QV
    want = _brute(choices, tb, V, stops)
    np.testing.assert_array_equal(got, want)
    assert (got >= 0).sum() > len(got)  # several tokens allowed somewhere (not a trivial table)
    if vocab == "bytes":
        assert (np.delete(got[:, 256:], 1, axis=1) < 0).all()  # special ids never, but EOS (257) as the stop
        assert got[:, 257].max() >= 0


PATTERNS = [r"(yes|no)", r"a+b*", r"[a-c]{2,3}x?", r"\d{3}-\d{2}", r"(ab|a)*c", r"[^a-c]+", r"x.y",
            r"(?:foo|bar){1,2}", r"\w+@\w+\.com", r"a|", r"(a|b)*abb", r"é+[0-9]", r"^[\s,]*\D?$", r"o{2,}"]
ALPHABET = "abcfoxyr0129-@.m é\n,"


def _matches(delta, accept, text: str) -> bool:
    q = 0
    for b in text.encode():
        q = int(delta[q, b])
        if q < 0:
            return False
    return bool(accept[q])


@pytest.mark.parametrize("pattern", PATTERNS)
def test_regex_automaton_matches_as_python_re_fullmatch(pattern):
    """Over 4000 strings (random ones from an alphabet that hits the patterns' edges, and pieces of matching ones
    mutated), the automaton accepts exactly what ``re.fullmatch`` does; every state can still reach an accepting
    one (no dead ends), and 0 is the start."""
    delta, accept = regex_automaton(pattern)
    rng = random.Random(zlib.crc32(pattern.encode()))  # fixed per pattern (str hashes vary by process)
    texts = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 8))) for _ in range(3000)]
    words = ["yes", "no", "ab", "abb", "aabb", "ac", "foo", "bar", "foobar", "x@y.com", "123-45", "éé1", "oo", "ooo",
             " ,", "a", "bc", ""]
    texts += [w[:rng.randint(0, len(w))] + rng.choice(["", rng.choice(ALPHABET)]) + w[rng.randint(0, len(w)):]
              for w in words for _ in range(55)]
    got = [_matches(delta, accept, t) for t in texts]
    want = [re.fullmatch(pattern, t) is not None for t in texts]
    assert got == want, [t for t, g, w in zip(texts, got, want) if g != w][:5]
    assert any(want) and not all(want)
    reach = accept.copy()  # states from which an accepting one is reachable: all of them
    for _ in range(len(accept)):
        reach = reach | np.array([reach[r[r >= 0]].any() for r in delta])
    assert reach.all()


@pytest.mark.parametrize("pattern,message", [("a(b", "missing ')'"), ("*a", "nothing to repeat"),
                                             ("a{3,1}", "max below min"), (r"\q", "the escape \\q is not taken"),
                                             ("(?=a)", "only (?: ) groups"), ("a^b", "only at the pattern's start"),
                                             ("[z-a]", "ASCII characters, in order"), ("[a", "missing ']'")])
def test_regex_refusals_say_what_and_where(pattern, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        regex_automaton(pattern)


def test_constrained_regex_generate_is_in_the_language(pair):  # noqa: F811
    """A regex constraint through generate (DSpark): the output (ids as bytes) matches the pattern whole, then
    EOS, token for token the host's masked decoder; sampled, every draw matches too."""
    target, drafter = pair
    V = target.config.vocab_size
    pattern = "[\x05-\x0c]{2,4}(\x14|\x15\x16)"
    delta, accept = regex_automaton(pattern)
    fsm = _padded(token_fsm(delta, accept, [None] * 3 + [bytes([v]) for v in range(3, V)], V, (EOS,)))
    prompt = [1, 9, 33, 17, 40, 5]
    want = _reference(target, prompt, fsm, 12)
    got = jdspark.generate(target, drafter, np.asarray(prompt), max_new_tokens=12, grammar=fsm).tokens.tolist()
    assert got == want and got[-1] == EOS and re.fullmatch(pattern, bytes(got[:-1]).decode("latin-1"))
    for seed in range(4):
        out = jdspark.generate(target, drafter, np.asarray(prompt), max_new_tokens=12, grammar=fsm,
                               temperature=1.0, seed=seed).tokens.tolist()
        assert out[-1] == EOS and re.fullmatch(pattern, bytes(out[:-1]).decode("latin-1")), out


Q_PAD = 16  # every table here padded to 16 states (rows of -1, never reached): one generate program per mode


def _padded(fsm):
    t = fsm.next_QV  # (a larger one as it is)
    return type(fsm)(np.concatenate([t, np.full((max(0, Q_PAD - t.shape[0]), t.shape[1]), -1, np.int32)]))


def _ids_fsm(choices, V):
    """A table over a built model's ids: id v (3..V-1) stands for the byte v (0, 1, 2: pad, BOS, EOS)."""
    delta, accept = choice_automaton([bytes(c) for c in choices])
    return _padded(token_fsm(delta, accept, [None] * 3 + [bytes([v]) for v in range(3, V)], V, (EOS,)))


def _reference(target, prompt, fsm, n):
    """Greedy decoding masked on the host: each token the argmax of the target's logits (one prefill of the
    sequence so far, right-padded to a fixed length) among those the table allows, until EOS or n tokens."""
    seq, out, q = list(prompt), [], 0
    T = len(prompt) + n
    for _ in range(n):
        padded = np.zeros((1, T), np.int32)
        padded[0, :len(seq)] = seq
        z = np.asarray(target.prefill(padded, target.init_cache(1, T)).logits, np.float32)[0, len(seq) - 1]
        z = np.where(fsm.next_QV[q] >= 0, z, -np.inf)
        t = int(z.argmax())
        out.append(t)
        q = int(fsm.next_QV[q, t])
        if t == EOS:
            break
        seq.append(t)
    return out


def test_constrained_greedy_generate_equals_the_masked_reference(pair):  # noqa: F811
    """Plain and DSpark: the output is one of the choices then EOS, token for token the host's masked decoder's;
    one choice follows the model's own greedy text, others branch off it at every position: the drafter proposes
    within the language too, and where it takes another branch than the target its draft is rejected."""
    target, drafter = pair
    V = target.config.vocab_size
    rng = np.random.default_rng(3)
    drafted = accepted = 0
    for p in range(3):
        prompt = [1] + rng.integers(3, V, 12).tolist()
        own = [t for t in jdspark.generate(target, None, np.asarray(prompt), max_new_tokens=6,
                                           eos_token_id=-1).tokens.tolist() if t > 2][:5]
        choices = [own, [11, 12, 13, 14, 15, 16, 17]] + [own[:k] + [(own[k] + 7 * k) % (V - 3) + 3, 9 + k]
                                                         for k in range(1, len(own))]
        fsm = _ids_fsm(choices, V)
        want = _reference(target, prompt, fsm, 12)
        assert want[-1] == EOS and want[:-1] in choices, want
        for d in (None, drafter):
            got = jdspark.generate(target, d, np.asarray(prompt), max_new_tokens=12, grammar=fsm)
            assert got.tokens.tolist() == want, (p, d is None, got.tokens, want)
        drafted, accepted = drafted + int(got.stats.drafted), accepted + int(got.stats.accepted)
        free = jdspark.generate(target, None, np.asarray(prompt), max_new_tokens=12).tokens.tolist()
        assert free != want  # unconstrained, it does not stop there
    assert 0 < accepted < drafted


def test_drafts_are_proposed_in_the_language(pair):  # noqa: F811
    """The drafter's Markov decode with the stream's automaton: every draft of a block walks the table (greedy and
    sampled picks, from the start and from a state within a choice), the masked logits are -inf exactly where the
    state refuses; unconstrained (state -1) it is the plain decode."""
    import jax
    import jax.numpy as jnp

    from jdspark.sampling import SamplingParams, propose

    _, drafter = pair
    V, G = drafter.config.vocab_size, drafter.config.block_size
    fsm = _ids_fsm([[5, 6, 7, 8, 9, 10], [5, 11, 12], [20, 21, 22, 23, 24, 25, 26]], V).next_QV
    rng = np.random.default_rng(0)
    base = jnp.asarray(rng.normal(size=(1, G, V)) * 3, jnp.float32)
    hid = jnp.asarray(rng.normal(size=(1, G, drafter.config.hidden_size)), jnp.float32)
    greedy = lambda k, z: (jnp.argmax(z, axis=-1).astype(jnp.int32), ())  # noqa: E731
    sampled = lambda k, z: propose(k, z, SamplingParams(temperature=1.0))  # noqa: E731
    keys = jax.random.split(jax.random.key(1), G)
    device = tuple(jnp.asarray(a) for a in TokenFSM(fsm).device_tables(32))  # the table by token classes, padded
    for pick in (greedy, sampled):
        for q0 in (0, int(fsm[0, 5])):
            toks, z, _, _ = drafter.decode_block(base, hid, jnp.array([3]), pick, keys,
                                                 automaton=(jnp.array([q0]), *device))
            q = q0
            for k, t in enumerate(np.asarray(toks[0]).tolist()):
                np.testing.assert_array_equal(np.isfinite(np.asarray(z[0, k])), fsm[q] >= 0)
                q = int(fsm[q, t])
                assert q >= 0, (q0, k, toks)
        free = drafter.decode_block(base, hid, jnp.array([3]), pick, keys)[0]
        off = drafter.decode_block(base, hid, jnp.array([3]), pick, keys,
                                   automaton=(jnp.array([-1]), *device))[0]
        np.testing.assert_array_equal(np.asarray(free), np.asarray(off))


def test_served_constrained_rows_equal_batch_one_generate(pair):  # noqa: F811
    """A backend with guided slots: a constrained greedy row, a constrained sampled row and an unconstrained one,
    stepped together at the whole block's width (all slots in place) and by twos (rows gathered, the other one
    waiting; each slot's automaton read from the slots' shared table in their own numbering,
    ``slot_programs.slot_automaton``), each equal to batch-1 generate with its own settings; a table past the
    slots' states, or a backend without them, is refused by name."""
    target, drafter = pair
    V = target.config.vocab_size
    be = SlotBackend(target, drafter, num_slots=3, max_len=64, prompt_buckets=(16,), batch_buckets=(2, 3),
                     guided_states=16)
    rng = np.random.default_rng(8)
    words = [[5, 6, 7, 8, 9], [5, 10], [20, 21, 22, 23, 24, 25]]
    words2 = [[30, 31, 32, 33], [34, 35, 36, 37, 38, 39, 40]]
    fsm, fsm2 = _ids_fsm(words, V), _ids_fsm(words2, V)  # each slot its own table
    asks = [([1] + rng.integers(3, V, 10).tolist(), dict(grammar=fsm)),
            ([1] + rng.integers(3, V, 8).tolist(), dict(grammar=fsm2, temperature=1.0, seed=4)),
            ([1] + rng.integers(3, V, 9).tolist(), dict(temperature=1.0, seed=5))]
    outs = [[] for _ in asks]
    for s, (p, kw) in enumerate(asks):
        outs[s] += be.insert(s, SamplingRequest(tuple(p), 12, **kw)).tokens
    turns = [[0, 1, 2], [2, 1], [1, 0], [0, 2]]  # the last three in bucket 2: gathered rows
    for i in range(24):
        if min(map(len, outs)) >= 12:
            break
        for s, r in be.step(turns[i % len(turns)], width=be.G + 1).items():
            outs[s] += r.tokens
    for (p, kw), got in zip(asks, outs):
        ref = jdspark.generate(target, drafter, np.asarray(p), max_new_tokens=12, **kw).tokens.tolist()
        assert got[:len(ref)] == ref, (kw, got, ref)
        if "grammar" in kw:
            assert ref[-1] == EOS and ref[:-1] in (words if kw["grammar"] is fsm else words2), ref
    big = _ids_fsm([list(range(3, 30))], V)
    with pytest.raises(ValueError, match="take at most 16 states"):
        be.insert(0, SamplingRequest((1, 5), 4, grammar=big))
    plain = SlotBackend(target, None, num_slots=1, max_len=64, prompt_buckets=(16,))
    with pytest.raises(ValueError, match="built without it"):
        plain.insert(0, SamplingRequest((1, 5), 4, grammar=fsm))
