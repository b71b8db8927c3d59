"""Stop strings as an automaton over token ids (``jdspark.stop_strings``) against the host's own rule: after every
token, the walk has MATCHED exactly when the text the engine decodes so far (``IncrementalDecoder``: special ids
skipped but the kept ones, bytes of an unfinished character held back, invalid bytes replaced) contains one of the
stop strings. Random id sequences over a byte vocabulary (ill-formed UTF-8, multi-byte characters split across ids,
special ids shown and not) and the shipped BPE vocabulary's encodings of code; the device's batched walk
(``advance_stops``) equals the host's walk row by row."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from jdspark.stop_strings import MATCHED, advance_stops, stop_automaton, stop_fsm
from kimi.tokenizer import ByteTokenizer, load_tokenizer

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "default", "target")


def walk(fsm, ids) -> list:
    """MATCHED after each id, walking the host's tables one id at a time."""
    q, out = 0, []
    for t in ids:
        q = int(fsm.next_QC[q, fsm.class_V[t]]) if q >= 0 else q
        out.append(q == MATCHED)
    return out


def host_rule(tok, stops, ids, keep=frozenset()) -> list:
    """The engine's rule: the text decoded incrementally so far contains a stop string."""
    dec, text, out = tok.incremental_decoder(keep_special=keep), "", []
    for t in ids:
        text += dec.add([t])
        out.append(any(s in text for s in stops))
    return out


def test_the_automaton_of_prefixes_and_overlaps_by_hand():
    """("ab", "bc", "abcd") over bytes: the text "abc" has matched at its "b" (ab), and a text that only ever ends
    with a stop string's prefix never does."""
    delta = stop_automaton([b"ab", b"bc", b"abcd"])
    M = delta.shape[0] - 1
    assert (delta[M] == M).all()  # absorbing

    def run(text):
        q = 0
        for b in text:
            q = int(delta[q, b])
        return q

    assert run(b"a") != M and run(b"ab") == M and run(b"xbc") == M and run(b"aab") == M
    assert run(b"acacb") != M and run(b"bbbb") != M
    with pytest.raises(ValueError, match="non-empty"):
        stop_automaton([b""])


@pytest.mark.parametrize("keep", [frozenset(), frozenset({257})])
def test_random_ids_over_bytes_match_the_host_s_text_after_every_id(keep):
    tok = ByteTokenizer()
    stops = ("aab", "ba", "é中", "\n\n", "s>x")  # "s>x" spans the name of a shown <eos> and the ids after it
    fsm = stop_fsm(stops, tok, keep)
    pieces = [b"a", b"b", b"\n", "é".encode(), "中".encode(), b"x", b"s"]
    rng = np.random.default_rng(0)
    matched = 0
    for _ in range(300):
        ids = []
        while len(ids) < 40:
            r = rng.random()
            if r < 0.6:
                ids += list(pieces[rng.integers(len(pieces))])  # whole or split characters, byte by byte
            elif r < 0.8:
                ids.append(int(rng.integers(0x80, 0x100)))  # a stray continuation or lead byte
            else:
                ids.append(int(rng.integers(256, 260)))  # a special id: skipped, or <eos> shown by its name
        assert walk(fsm, ids) == host_rule(tok, stops, ids, keep), ids
        matched += host_rule(tok, stops, ids, keep)[-1]
    assert 50 < matched < 290  # both outcomes are exercised


def test_the_shipped_vocabulary_s_code_matches_the_host_s_text_after_every_id():
    """HumanEval's stop strings over the shipped 4096-token BPE: a stop string spans ids ("\\n" and "def" are
    separate pre-tokens), so one stop id could not say it."""
    tok = load_tokenizer(SHIPPED)
    stops = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
    fsm = stop_fsm(stops, tok)
    assert fsm.num_states <= 32 and fsm.num_classes < 127  # fits a slot's tables (STOP_STATES, STOP_CLASSES)
    frags = ["    return x\n", "\n", "def", " f(a):\n", "# note\n", "if a:\n", "print(a)", "class C:\n", "    ", "é",
             "ifdef", "classify", "\n\n", "pass"]
    rng = np.random.default_rng(1)
    seen = set()
    for _ in range(200):
        text = "".join(frags[i] for i in rng.integers(len(frags), size=12))
        ids = tok.encode(text)
        got = walk(fsm, ids)
        assert got == host_rule(tok, stops, ids), text
        seen.add(got[-1])
    assert seen == {False, True}


def test_the_device_walk_equals_the_host_walk_row_by_row():
    tok = ByteTokenizer()
    fsm = stop_fsm(("aab", "ba"), tok)
    next_QC, class_V = fsm.device_tables(8, 16, 400)  # a model's vocabulary past the tokenizer's 384 ids
    assert (class_V[384:] == fsm.num_classes).all() and (next_QC[:fsm.num_states, fsm.num_classes]
                                                         == np.arange(fsm.num_states)).all()  # they leave the state
    rng = np.random.default_rng(2)
    B, K = 16, 5
    ids_bK = rng.choice([97, 98, 99, 258], size=(B, K)).astype(np.int32)  # a, b, c, <mask>
    n_b = rng.integers(1, K + 1, size=B).astype(np.int32)
    q0 = np.zeros(B, np.int32)
    q0[:3] = -1  # rows without stop strings stay so
    got = np.asarray(advance_stops(jnp.asarray(q0), jnp.asarray(np.broadcast_to(next_QC, (B,) + next_QC.shape)),
                                   jnp.asarray(np.broadcast_to(class_V, (B, 400))), jnp.asarray(ids_bK),
                                   jnp.asarray(n_b)))
    for r in range(B):
        want = -1 if r < 3 else (MATCHED if walk(fsm, ids_bK[r, :n_b[r]])[-1] else None)
        if want is None:  # not matched: the state the host's walk reaches
            q = 0
            for t in ids_bK[r, :n_b[r]]:
                q = int(fsm.next_QC[q, fsm.class_V[t]])
            want = q
        assert got[r] == want, (r, ids_bK[r], n_b[r])
    assert (got == MATCHED).any() and (got[3:] >= 0).any()
    assert fsm.device_tables(fsm.num_states - 1, 16, 400) is None  # too many states for the slot: not on the device


def test_an_automaton_too_large_for_a_slot_is_not_lifted():
    """More states than a slot holds: no Q x V table is built (over K3's vocabulary a request's many long stop
    strings would take gigabytes), and no slot takes it."""
    stops = tuple(f"{chr(65 + i)} stop {i}" for i in range(40))
    fsm = stop_fsm(stops, ByteTokenizer(), max_states=32)
    assert fsm.num_states > 32 and fsm.next_QC.size == 0
    assert fsm.device_tables(32, 128, 384) is None
    assert stop_fsm(stops[:1], ByteTokenizer(), max_states=32).device_tables(32, 128, 384) is not None
