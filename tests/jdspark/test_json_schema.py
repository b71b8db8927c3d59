"""JSON output (``jdspark.json_schema``): integer ranges against every integer near them, JSON documents a schema
validates (and ones it does not) walked through the minimal byte automaton and Python's ``re``, random documents
in both json.dumps layouts against the free-form object, the refusals naming their keyword, the minimal
automaton against the unminimized one's language and a brute-force count of its states, and the vectorized
builders (row grouping, the vocabulary lift) against slow obvious ones. Host code only: no program is compiled
here."""

import decimal
import json
import random
import re
import zlib

import numpy as np
import pytest

from jdspark.grammar import _row_groups, minimize, regex_automaton, token_fsm
from jdspark.json_schema import (
    MAX_DEPTH,
    RECURSION_DEPTH,
    any_object_regex,
    integer_range_regex,
    json_value_regex,
    number_range_regex,
    schema_regex,
)


def walk(automaton, text: str) -> bool:
    """Whether the automaton accepts ``text``'s UTF-8 bytes whole."""
    delta, accept = automaton
    q = 0
    for b in text.encode("utf-8"):
        q = int(delta[q, b])
        if q < 0:
            return False
    return bool(accept[q])


@pytest.mark.parametrize("lo,hi", [(0, 150), (-37, 1234), (None, -5), (7, None), (-100, -3), (0, 0), (5, 5),
                                   (-9, 9), (10, 99), (None, 0), (-1, None), (199, 2001)])
def test_integer_range_matches_exactly_the_integers_in_it(lo, hi):
    pattern = integer_range_regex(lo, hi)
    automaton = regex_automaton(pattern)
    for n in range(-2500, 2500):
        want = (lo is None or n >= lo) and (hi is None or n <= hi)
        assert bool(re.fullmatch(pattern, str(n))) == want == walk(automaton, str(n)), (n, pattern)
    for text in ("-0", "01", "+1", "00", "-01", "1.0", ""):
        assert not walk(automaton, text) and not re.fullmatch(pattern, text), text


def _decimal(x) -> decimal.Decimal:
    return decimal.Decimal(repr(x) if isinstance(x, float) else x)


@pytest.mark.parametrize("lo,hi,strict_lo,strict_hi", [
    (0, 1, False, False), (0, 1, True, True), (-1.5, 2.25, False, True), (None, -0.05, False, False),
    (0.1, None, True, False), (3.14, 3.15, False, False), (3.14, 3.14, False, False), (-2.5, -2.25, True, False),
    (0, 0, False, False), (None, 0, False, True), (-0.001, 0.001, False, False), (10, 100.5, True, False),
    (1e-3, 2, False, False), (-100, None, False, False), (7, 7.0001, True, True)])
def test_number_range_matches_exactly_the_numbers_in_it(lo, hi, strict_lo, strict_hi):
    """Decimal texts near the bounds (a step of 1e-4 and 1e-5 either side, and trailing zeros) and random ones,
    judged by the automaton and Python's ``re`` against ``decimal.Decimal`` comparisons: taken exactly the numbers
    in the range written without an exponent; never '-0', '01', '1.', '.5', '+1' or an exponent."""
    pattern = number_range_regex(lo, hi, strict_lo, strict_hi)
    automaton = regex_automaton(pattern)
    rng = random.Random(zlib.crc32(pattern.encode()))
    texts = {"-0", "-0.0", "01", "1.", ".5", "+1", "1e3", "", "0", "-1"}
    for _ in range(1500):
        t = ("-" if rng.random() < 0.4 else "") + str(rng.choice([0, 1, 2, 3, 7, 9, 10, 99, 100, 101,
                                                                  rng.randint(0, 200)]))
        if rng.random() < 0.7:
            t += "." + "".join(rng.choice("0123456789" if rng.random() < 0.7 else "0159")
                               for _ in range(rng.randint(1, 5)))
        texts.add(t)
    for b in (lo, hi):
        for step in ("0", "0.0001", "-0.0001", "0.00001", "-0.00001", "1", "-1") if b is not None else ():
            texts |= {format(_decimal(b) + decimal.Decimal(step), "f") + z for z in ("", "0")}
    for t in texts:
        x = decimal.Decimal(t) if re.fullmatch(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?", t) else None
        if x is not None and t.startswith("-") and x == 0:
            x = None  # negative zero: not written
        want = x is not None and (lo is None or (x > _decimal(lo) if strict_lo else x >= _decimal(lo))) and (
            hi is None or (x < _decimal(hi) if strict_hi else x <= _decimal(hi)))
        assert walk(automaton, t) == want == (re.fullmatch(pattern, t) is not None), (t, pattern)


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    "ok": {"type": "boolean"}}, "required": ["name", "age"]}
CASES = [
    (PERSON, [{"name": "Ann", "age": 31}, {"name": "", "age": 0, "ok": False},
              {"name": "Bo \u00e9\"", "age": 150, "tags": ["a", "b"], "ok": True}, {"name": "x", "age": 2, "tags": []}],
     [{"age": 31}, {"name": "Ann"}, {"name": "Ann", "age": 151}, {"name": "Ann", "age": -1},
      {"name": "Ann", "age": 3, "tags": ["c"]}, {"name": "Ann", "age": 3, "tags": ["a", "a", "b"]},
      {"name": "Ann", "age": 3, "extra": 1}, {"age": 3, "name": "Ann"}, {"name": "123456789", "age": 3},
      {"name": "Ann", "age": 3.5}]),
    ({"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": ["string", "null"]}}},
     [{}, {"a": 1}, {"a": -0.5e3}, {"b": None}, {"a": 2, "b": "x"}, {"b": "y"}], [{"b": 1}, {"b": "x", "a": 2}]),
    ({"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                       "required": ["x", "y"]}},
      "type": "array", "items": {"$ref": "#/$defs/pt"}, "minItems": 1, "maxItems": 3},
     [[{"x": 1, "y": -2}], [{"x": 0, "y": 0}] * 3], [[], [{"x": 1}], [{"x": 1, "y": 2}] * 4]),
    ({"anyOf": [{"type": "string", "format": "date"}, {"const": 7}]},
     ["2026-12-06", 7], ["2026-13-01", 8, "7"]),
    ({"type": "string", "pattern": "^[a-c]+x$"}, ["abcx", "ax"], ["x", "abc", "adx"]),
    ({"type": "object"}, [{}, {"k": [1, {"j": None}]}, {"a": "b", "c": 2.5}], [[], {"a": [[[1]]]}]),
    ({"type": "string", "minLength": 2, "maxLength": 3}, ["ab", "\u00e9\u00e9\u00e9", "a\\n"], ["a", "abcd"]),
    ({"type": "object", "properties": {"t": {"type": "number", "minimum": 0, "maximum": 2},
                                       "p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
      "required": ["t"]},
     [{"t": 0}, {"t": 0.7, "p": 1}, {"t": 2.0, "p": 0.001}, {"t": 1.25}],
     [{"t": -0.1}, {"t": 2.01}, {"t": 1, "p": 0}, {"t": 1, "p": 1.5}, {"p": 0.5},
      {"t": 1e-07}]),  # (valid, but a bounded number is written without an exponent)
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_schema_automaton_takes_the_documents_it_validates(case):
    """Valid documents in both json.dumps layouts (compact and with spaces) and with ensure_ascii on and off are
    taken; invalid ones, and valid ones indented over lines, are not."""
    schema, good, bad = CASES[case]
    pattern = schema_regex(schema)
    automaton = regex_automaton(pattern)
    for doc in good:
        for seps in ((",", ":"), (", ", ": ")):
            for ascii_only in (True, False):
                text = json.dumps(doc, separators=seps, ensure_ascii=ascii_only)
                assert walk(automaton, text) and re.fullmatch(pattern, text), text
    for doc in bad:
        text = json.dumps(doc)
        assert not walk(automaton, text) and not re.fullmatch(pattern, text), text
    for doc in good:
        if isinstance(doc, (dict, list)) and doc:
            assert not walk(automaton, json.dumps(doc, indent=2)), doc


def _tree(depth: int, width: int = 2) -> dict:
    node = {"name": f"n{depth}"}
    if depth > 1:
        node["children"] = [_tree(depth - 1, width) for _ in range(width)]
    return node


def test_recursive_refs_are_expanded_to_the_recursion_depth():
    """A recursive $ref is expanded RECURSION_DEPTH times along a path: a tree of nodes (children an array of
    the same node) is taken up to that many levels, empty children arrays at the last, and not one level deeper;
    a linked list through '#' (next: the root or null) up to RECURSION_DEPTH + 1 nodes (the root is not a
    reference); every document taken is valid under the schema."""
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["name"]}}, "$ref": "#/$defs/node"}
    automaton = regex_automaton(schema_regex(tree))
    for depth in range(1, RECURSION_DEPTH + 2):
        for doc in (_tree(depth), _tree(depth, 1)):
            assert walk(automaton, json.dumps(doc)) == (depth <= RECURSION_DEPTH), (depth, doc)
    assert walk(automaton, json.dumps({"name": "a", "children": [{"name": "b", "children": [{"name": "c",
                                                                                           "children": []}]}]}))
    linked = {"type": "object", "properties": {"v": {"type": "integer"},
                                               "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
              "required": ["v", "next"]}
    automaton = regex_automaton(schema_regex(linked))
    for n in range(1, RECURSION_DEPTH + 3):
        doc = None
        for v in range(n):
            doc = {"v": v, "next": doc}
        assert walk(automaton, json.dumps(doc)) == (n <= RECURSION_DEPTH + 1), n


def _random_value(rng, depth):
    kinds = ["str", "int", "float", "bool", "null"] + (["list", "dict"] * 2 if depth > 0 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        return "".join(rng.choice(["a", "Z", " ", '"', "\\", "\n", "\u00e9", "\u4e2d", "\U0001f600", "/", "\t"])
                       for _ in range(rng.randint(0, 5)))
    if kind == "int":
        return rng.randint(-10 ** 6, 10 ** 6)
    if kind == "float":
        return rng.uniform(-1e3, 1e3) * 10 ** rng.randint(-30, 30)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    n = rng.randint(0, 3)
    if kind == "list":
        return [_random_value(rng, depth - 1) for _ in range(n)]
    return {f"k{i}\u00e9": _random_value(rng, depth - 1) for i in range(n)}


def test_free_form_object_takes_random_documents_nested_to_its_depth():
    """json_object: 300 random objects nested up to MAX_DEPTH deep are taken in both layouts; one level deeper,
    a non-object at the top, and trailing text are not."""
    automaton = regex_automaton(any_object_regex())
    rng = random.Random(0)
    for _ in range(300):
        doc = {f"k{i}": _random_value(rng, MAX_DEPTH - 1) for i in range(rng.randint(0, 3))}
        for seps in ((",", ":"), (", ", ": ")):
            for ascii_only in (True, False):
                assert walk(automaton, json.dumps(doc, separators=seps, ensure_ascii=ascii_only)), doc
    deep = {"a": {"b": {"c": {"d": 1}}}}
    assert MAX_DEPTH == 3 and not walk(automaton, json.dumps(deep))
    for text in ("[1]", "1", '"x"', "{} ", '{"a":1}}', "{'a': 1}", '{"a":01}', '{"a":1,}'):
        assert not walk(automaton, text), text
    value = regex_automaton(json_value_regex(1))
    assert walk(value, "[1, 2]") and walk(value, "null") and not walk(value, "[[1]]")


@pytest.mark.parametrize("schema,message", [
    ({"type": "integer", "multipleOf": 3}, "['multipleOf'] not taken"),
    ({"type": "number", "multipleOf": 0.5}, "['multipleOf'] not taken"),
    ({"type": "number", "minimum": 2, "exclusiveMaximum": 2}, "no number between 2 and 2"),
    ({"type": "number", "maximum": "3"}, "maximum: expected a finite number"),
    ({"type": "array", "uniqueItems": True}, "['uniqueItems'] not taken"),
    ({"not": {"type": "string"}}, "['not'] not taken"),
    ({"type": "string", "format": "email"}, "format: 'email' not taken"),
    ({"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
      "$ref": "#/$defs/a"}, "no document nested at most 3 deep"),
    ({"$ref": "#/$defs/missing"}, "is not defined"),
    ({"$ref": "http://x/s.json"}, "not taken (only '#', '#/$defs/NAME'"),
    ({"type": "thing"}, "'thing' is not a JSON Schema type"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required: expected names among"),
    ({"type": "integer", "minimum": 5, "maximum": 2}, "maximum 2 below minimum 5"),
    ({"allOf": [{"type": "string"}, {"maxLength": 2}]}, "only one schema is taken"),
    ([1], "a JSON Schema is an object"),
])
def test_schema_refusals_name_the_keyword(schema, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        schema_regex(schema)


def test_minimized_automaton_is_minimal_and_keeps_the_language():
    """(a|b)*abb has the textbook 4-state minimal automaton; [ab]* one state; a pattern with redundant branches
    shrinks; random strings are judged alike before and after."""
    assert regex_automaton("(a|b)*abb")[0].shape[0] == 4
    assert regex_automaton("[ab]*")[0].shape[0] == 1
    assert regex_automaton("(?:ab|ab|a(?:b))c")[0].shape[0] == 4
    rng = np.random.default_rng(0)
    delta = rng.integers(-1, 6, size=(6, 256)).astype(np.int32)
    delta[:, 100:] = -1
    accept = np.array([False, True, False, True, True, False])
    small = minimize(delta, accept)
    assert small[0].shape[0] <= 6
    for _ in range(2000):
        text = bytes(rng.integers(97, 100, size=rng.integers(0, 8)).tolist())
        q0, q1 = 0, 0
        for b in text:
            q0 = int(delta[q0, b]) if q0 >= 0 else -1
            q1 = int(small[0][q1, b]) if q1 >= 0 else -1
        assert (q0 >= 0 and bool(accept[q0])) == (q1 >= 0 and bool(small[1][q1])), text


@pytest.mark.parametrize("seed", range(6))
def test_minimized_state_count_is_myhill_nerode_s(seed):
    """Random automata over {a, b, c} whose every state is reached from 0 and reaches an accepting one (a chain on
    'a'): the minimal automaton has as many states as there are distinct languages among the states, judged by
    brute force over every string of up to Q letters (two states of Q-state automata that agree that far agree)."""
    rng = np.random.default_rng(seed)
    Q = 7
    delta = np.full((Q, 256), -1, np.int32)
    delta[:, 97:100] = rng.integers(-1, Q, size=(Q, 3))
    delta[np.arange(Q - 1), 97] = np.arange(1, Q)
    accept = rng.random(Q) < 0.3
    accept[Q - 1] = True
    words = [b""]
    for n in range(Q):
        words += [w + c for w in words if len(w) == n for c in (b"a", b"b", b"c")]

    def language(q):
        out = []
        for w in words:
            s = q
            for b in w:
                s = int(delta[s, b]) if s >= 0 else -1
            out.append(s >= 0 and bool(accept[s]))
        return tuple(out)

    want = len({language(q) for q in range(Q)})
    small, small_accept = minimize(delta, accept)
    assert small.shape[0] == want
    assert small_accept.dtype == bool and len(small_accept) == want
    assert (small[:, :97] == -1).all() and (small[:, 100:] == -1).all()


def test_row_groups_group_equal_rows_exactly():
    """``_row_groups`` (hashed) against a dictionary of whole rows, groups numbered by first row; two rows made
    to share a hash (a, 0) and (0, b) with the hash's weights (b, a)... are still told apart."""
    rng = np.random.default_rng(1)
    for n, k, distinct in ((50, 3, 4), (300, 40, 25), (1000, 600, 200), (5, 0, 1)):
        base = rng.integers(-1, 9, size=(distinct, k))
        M = base[rng.integers(0, distinct, size=n)]
        first, group = _row_groups(M)
        seen: dict = {}
        want = np.array([seen.setdefault(tuple(r), len(seen)) for r in M.tolist()])
        np.testing.assert_array_equal(group, want)
        np.testing.assert_array_equal(first, [want.tolist().index(g) for g in range(len(seen))])
    w = np.random.default_rng(0x5EED).integers(1, 2 ** 63, size=2, dtype=np.uint64).astype(np.int64)
    M = np.array([[w[1], 0], [0, w[0]], [w[1], 0]])  # rows 0 and 1 collide: w0 * w1 either way
    first, group = _row_groups(M)
    assert group.tolist() == [0, 1, 0] and first.tolist() == [0, 1]


def test_vocabulary_lift_equals_walking_each_token():
    """``token_fsm`` (every state walks every token at once, tokens longest first) against walking each token's
    bytes from each state in Python: a JSON schema's automaton, 700 tokens of 0-9 bytes drawn from JSON's
    characters (multi-byte UTF-8 and pieces of it among them), unset ids, ids past the list, and two stop ids."""
    delta, accept = regex_automaton(schema_regex(CASES[0][0]))
    rng = random.Random(3)
    alphabet = [c.encode() for c in '{}[]":, 0123456789abcdefghijklmnopqrstuvwxyz\\-.e'] + ["é".encode(),
                "é".encode()[:1], "€".encode()[1:]]
    tb = [None, b""] + [b"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9))) for _ in range(698)]
    V, stops = 710, (5, 709)
    got = token_fsm(delta, accept, tb, V, stops).next_QV
    want = np.full((delta.shape[0], V), -1, np.int64)
    for q in range(delta.shape[0]):
        for v in range(V):
            if v in stops:
                want[q, v] = q if accept[q] else -1
                continue
            s = q if v < len(tb) and tb[v] else -1
            for b in (tb[v] or b"") if v < len(tb) else b"":
                s = int(delta[s, b]) if s >= 0 else -1
            want[q, v] = s
    np.testing.assert_array_equal(got, want)
    assert (got[:, 2:700] >= 0).sum() > delta.shape[0] * 5  # tokens walk somewhere (not a trivial table)


def test_generate_script_builds_the_constraint(tmp_path):
    """scripts/generate.py --json-schema (inline or @PATH, '{}' any object) / --regex: the table generate is handed
    is the schema's / pattern's automaton over the vocabulary, EOS its stop; both at once, or a schema not taken,
    is a usage error naming the flag."""
    import argparse
    import os
    import sys
    import types

    from jdspark.grammar import regex_fsm
    from kimi.tokenizer import ByteTokenizer

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "scripts"))
    import generate as gen

    tok = ByteTokenizer()
    cfg = types.SimpleNamespace(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id)
    ap = argparse.ArgumentParser()
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    for js, rx, pattern in ((json.dumps(schema), None, schema_regex(schema)),
                            (f"@{tmp_path / 's.json'}", None, schema_regex(schema)),
                            ("{}", None, any_object_regex()), (None, "[ab]+", "[ab]+")):
        got = gen.constraint(ap, argparse.Namespace(json_schema=js, regex=rx), tok, cfg)
        np.testing.assert_array_equal(got.next_QV, regex_fsm(pattern, tok, tok.vocab_size, (tok.eos_id,)).next_QV)
    assert gen.constraint(ap, argparse.Namespace(json_schema=None, regex=None), tok, cfg) is None
    for js, rx in (("{}", "a"), ('{"type": "number", "multipleOf": 1}', None), ("{bad", None)):
        with pytest.raises(SystemExit):
            gen.constraint(ap, argparse.Namespace(json_schema=js, regex=rx), tok, cfg)
    with pytest.raises(SystemExit):  # a checkpoint folder that is not there: a usage error, not a random pair
        gen.main(["--checkpoint", str(tmp_path / "none"), "--prompt", "x"])


def test_generate_script_prints_a_healed_token_once(capsys):
    """With token healing the prompt's last token is printed with the prompt; the stream's first characters (the
    same text, which the first new token begins with) are not printed again, however the ids split them."""
    import os
    import sys

    from kimi.tokenizer import ByteTokenizer

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "scripts"))
    import generate as gen

    tok = ByteTokenizer()
    ids = tok.encode("\n  x = é")
    for skip, want in (("", "\n  x = é"), ("\n", "  x = é"), ("\n  ", "x = é"), ("\n  x = é", "")):
        s = gen._Streamer(tok, skip_prefix=skip)
        for i in ids:  # one id at a time: the é's two bytes arrive apart
            s([i])
        s.close()
        assert capsys.readouterr().out == want


@pytest.mark.parametrize("flag,value,said", [("--temperature", "-1", "--temperature: expected >= 0, got -1.0"),
                                             ("--top-p", "0", "--top-p: expected in (0, 1], got 0.0"),
                                             ("--top-k", "-2", "--top-k: expected >= 0"),
                                             ("--min-p", "1.5", "--min-p: expected in [0, 1]"),
                                             ("--heldout", "-1", "--heldout: expected a count >= 0"),
                                             ("--heldout", "2 --no-compare", "0 with --no-compare"),
                                             ("--heldout", "2 --regex a+", "0 with --no-compare, --json-schema"),
                                             ("--num-speculative-tokens", "0", "expected distinct counts >= 1"),
                                             ("--num-speculative-tokens", "3 3", "expected distinct counts >= 1"),
                                             ("--num-speculative-tokens", "2 --no-draft", "none with --no-draft")])
def test_generate_script_names_a_bad_flag(tmp_path, capsys, flag, value, said):
    """A usage error naming the flag, before the pair loads (the folder given is not there: a later error)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "scripts"))
    import generate as gen

    with pytest.raises(SystemExit):
        gen.main(["--checkpoint", str(tmp_path / "none"), "--prompt", "x", flag, *value.split()])
    assert said in capsys.readouterr().err


def test_token_classes_rebuild_the_table():
    """A table by token classes: next_QC[q, class_V[v]] is next_QV[q, v] for every state and id (a schema's table
    over the byte vocabulary), padding columns are -1 and never indexed, fewer classes than asked is refused; the
    server refuses a request whose automaton tells more classes apart than --guided-classes, naming both."""
    from jdspark.grammar import TokenFSM, regex_fsm, token_classes
    from jdspark.serve_request import ApiError, parse_completion
    from kimi.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    table = regex_fsm(schema_regex(CASES[0][0]), tok, tok.vocab_size, (tok.eos_id,)).next_QV
    C = token_classes(table)[0].shape[1]
    assert C < 64 < tok.vocab_size
    next_QC, class_V = TokenFSM(table).device_tables(64)
    assert next_QC.shape == (table.shape[0], 64) and class_V.max() < C
    np.testing.assert_array_equal(next_QC[:, class_V], table)
    assert (next_QC[:, C:] == -1).all()
    with pytest.raises(ValueError, match=f"tells {C} token classes apart; at most {C - 1}"):
        TokenFSM(table).device_tables(C - 1)
    kw = dict(tokenizer=tok, vocab_size=tok.vocab_size, max_context=64, model_name="m", guided_states=64)
    assert parse_completion({"prompt": "q", "guided_regex": "[a-c]+x"}, guided_classes=4, **kw).sampling.grammar
    with pytest.raises(ApiError, match="tells 4 token classes apart; this server takes at most 3 "
                                       r"\(--guided-classes\)"):
        parse_completion({"prompt": "q", "guided_regex": "[a-c]+x"}, guided_classes=3, **kw)
