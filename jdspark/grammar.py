"""Constrained decoding (vLLM's ``guided_choice`` / ``structured_outputs.choice``): the output must be one of a list
of strings, then a stop token. A byte automaton of the allowed texts is lifted to the vocabulary once, on the host,
as one table the device indexes:

    next_QV[q, v] = the automaton's state after token v's bytes from state q, or -1 where they leave the language
                    (a stop id: q itself where q accepts, a finished text may end; -1 elsewhere)

A stream carries its state q (-1: unconstrained) and the table; at each position the step verifies, the target's
logits are masked to {v : next_QV[q_j, v] >= 0} with q_j the state after the drafts before j
(``jdspark.speculative._penalized``), and the committed tokens advance q. The masked logits are the target's law, so
greedy and rejection sampling stay lossless; the drafter proposes unconstrained (a draft outside the language has
probability 0 and is rejected where it stands, so the states after it are never read).

Every token whose bytes walk the automaton is allowed, so every tokenization of an allowed text can be generated,
not only the tokenizer's own. Special tokens (their "bytes" are their names) and tokens of no bytes never are.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np

__all__ = ["TokenFSM", "choice_automaton", "token_fsm", "vocab_fsm", "choice_fsm", "regex_automaton", "regex_fsm"]


class TokenFSM(NamedTuple):
    """A constraint as the device reads it (module doc): state 0 is the start."""
    next_QV: np.ndarray  # int32 [Q, V]

    @property
    def num_states(self) -> int:
        return int(self.next_QV.shape[0])


def choice_automaton(choices: Sequence[bytes]) -> tuple:
    """The trie of ``choices`` as a byte automaton: (delta [Q, 256] int32, the next state or -1; accept [Q] bool).
    Every state leads to an accepting one (a trie has no dead ends)."""
    if not choices or any(not isinstance(c, bytes) or not c for c in choices):
        raise ValueError("choices: expected a non-empty list of non-empty byte strings")
    delta, accept = [np.full(256, -1, np.int32)], [False]
    for c in choices:
        q = 0
        for b in c:
            if delta[q][b] < 0:
                delta[q][b] = len(delta)
                delta.append(np.full(256, -1, np.int32))
                accept.append(False)
            q = int(delta[q][b])
        accept[q] = True
    return np.stack(delta), np.asarray(accept)


def token_fsm(delta_Q256: np.ndarray, accept_Q: np.ndarray, token_bytes: Sequence[Optional[bytes]],
              vocab_size: int, stop_ids: Sequence[int]) -> TokenFSM:
    """The automaton lifted to a vocabulary: ``token_bytes[v]`` the text of id v (None or b"": never allowed; ids
    past the list likewise), ``stop_ids`` allowed exactly in accepting states. All tokens walk in parallel, one byte
    position at a time (Q x the longest token's length NumPy passes over the vocabulary)."""
    Q = delta_Q256.shape[0]
    n = min(len(token_bytes), vocab_size)
    lens = np.array([len(token_bytes[v] or b"") for v in range(n)] + [0] * (vocab_size - n), np.int64)
    L = max(1, int(lens.max(initial=0)))
    bytes_VL = np.zeros((vocab_size, L), np.int64)
    for v in range(n):
        b = token_bytes[v]
        if b:
            bytes_VL[v, :len(b)] = np.frombuffer(b, np.uint8)
    stops = np.asarray([s for s in stop_ids if 0 <= s < vocab_size], np.int64)
    next_QV = np.full((Q, vocab_size), -1, np.int32)
    for q in range(Q):
        cur = np.full(vocab_size, q, np.int64)
        for j in range(L):
            live = (j < lens) & (cur >= 0)
            cur = np.where(live, delta_Q256[np.maximum(cur, 0), bytes_VL[:, j]], cur)
        cur = np.where(lens > 0, cur, -1)
        if stops.size:
            cur[stops] = q if accept_Q[q] else -1
        next_QV[q] = cur
    return TokenFSM(next_QV)


def vocab_fsm(automaton: tuple, tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> TokenFSM:
    """A byte automaton (delta, accept) lifted to ``tokenizer``'s vocabulary (``token_fsm``; special ids never)."""
    special = set(tokenizer.special_ids)
    tb = [None if v in special else tokenizer.token_bytes(v) for v in range(min(vocab_size, tokenizer.vocab_size))]
    return token_fsm(*automaton, tb, vocab_size, stop_ids)


def choice_fsm(choices: Sequence[str], tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> TokenFSM:
    """The constraint "one of ``choices`` (UTF-8), then a stop id" over ``tokenizer``'s vocabulary."""
    automaton = choice_automaton([c.encode("utf-8") if isinstance(c, str) else c for c in choices])
    return vocab_fsm(automaton, tokenizer, vocab_size, stop_ids)


# ------------------------------------------------------------------------------------------------------------ regex
# A regular expression (the common subset: literals and escapes, ``.``, classes ``[a-z]`` / ``[^...]``, ``\d \w \s``
# and their negations, groups ``( )`` / ``(?: )``, ``|``, ``* + ?`` and ``{m}`` / ``{m,}`` / ``{m,n}``) matched
# whole (as ``re.fullmatch``) over the text's UTF-8 bytes: a Thompson NFA over bytes, made deterministic by subsets,
# then every state that cannot reach an accepting one removed (a stream is never led where no text can end).
# Characters are Unicode: ``.`` (but a newline, as Python's) and a negated class match any character's byte
# sequence (ASCII ranges only in classes).

_ANY_UTF8 = [  # one character's UTF-8 bytes, as ranges per byte
    [(0x00, 0x7F)], [(0xC2, 0xDF), (0x80, 0xBF)], [(0xE0, 0xEF), (0x80, 0xBF), (0x80, 0xBF)],
    [(0xF0, 0xF4), (0x80, 0xBF), (0x80, 0xBF), (0x80, 0xBF)]]
_CLASSES = {"d": [(0x30, 0x39)], "w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
            "s": [(0x09, 0x0D), (0x20, 0x20)]}
MAX_REGEX_STATES = 4096  # a pattern whose automaton grows past this is refused (ValueError)


class _Parser:
    """Pattern -> AST: ("cat", [..]), ("alt", [..]), ("rep", node, m, n or None), ("set", ascii ranges, negated),
    ("seq", bytes) (a literal's UTF-8), ("any",)."""

    def __init__(self, pattern: str):
        self.p, self.i = pattern, 0

    def fail(self, what: str):
        raise ValueError(f"regex {self.p!r}: {what} at position {self.i}")

    def peek(self):
        return self.p[self.i] if self.i < len(self.p) else None

    def parse(self):
        node = self.alt()
        if self.i != len(self.p):
            self.fail("unbalanced ')'")
        return node

    def alt(self):
        parts = [self.cat()]
        while self.peek() == "|":
            self.i += 1
            parts.append(self.cat())
        return parts[0] if len(parts) == 1 else ("alt", parts)

    def cat(self):
        items = []
        while self.peek() not in (None, "|", ")"):
            items.append(self.repeat(self.atom()))
        return ("cat", items)

    def repeat(self, node):
        while True:
            c = self.peek()
            if c in ("*", "+", "?"):
                self.i += 1
                node = ("rep", node, {"*": 0, "+": 1, "?": 0}[c], None if c != "?" else 1)
            elif c == "{" and (mn := self._counted()) is not None:
                node = ("rep", node, *mn)
            else:
                return node
            if self.peek() == "?":  # lazy quantifiers match the same language
                self.i += 1

    def _counted(self):
        j = self.p.find("}", self.i)
        body = self.p[self.i + 1:j] if j > 0 else ""
        lo, _, hi = body.partition(",")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return None
        self.i = j + 1
        m, n = int(lo), (int(hi) if hi else (None if "," in body else int(lo)))
        if n is not None and n < m:
            self.fail(f"{{{m},{n}}}: max below min")
        return m, n

    def atom(self):
        c = self.peek()
        if c == "(":
            self.i += 1
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                self.fail("only (?: ) groups are taken")
            node = self.alt()
            if self.peek() != ")":
                self.fail("missing ')'")
            self.i += 1
            return node
        if c in ("*", "+", "?", "{"):
            self.fail(f"nothing to repeat before {c!r}")
        if c in ("^", "$"):
            self.i += 1
            if (c == "^" and self.i != 1) or (c == "$" and self.i != len(self.p)):
                self.fail(f"{c!r} only at the pattern's {'start' if c == '^' else 'end'} (it matches whole)")
            return ("cat", [])
        if c == ".":
            self.i += 1
            return ("any",)
        if c == "[":
            return self._set()
        if c == "\\":
            return self._escape(in_set=False)
        self.i += 1
        return ("seq", c.encode("utf-8"))

    def _escape(self, in_set: bool):
        self.i += 1
        c = self.peek()
        if c is None:
            self.fail("a trailing backslash")
        self.i += 1
        if c.lower() in _CLASSES:
            return ("set", _CLASSES[c.lower()], c.isupper())
        simple = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}
        if c in simple:
            c = simple[c]
        elif c.isalnum():
            self.fail(f"the escape \\{c} is not taken")
        return ("seq", c.encode("utf-8"))

    def _set(self):
        self.i += 1
        neg = self.peek() == "^"
        self.i += neg
        ranges, first = [], True
        while self.peek() != "]" or first:
            if self.peek() is None:
                self.fail("missing ']'")
            first = False
            if self.peek() == "\\":
                node = self._escape(in_set=True)
                if node[0] == "set":
                    if node[2]:
                        self.fail("a negated class inside a class is not taken")
                    ranges += node[1]
                    continue
                lo = node[1]
            else:
                lo = self.peek().encode("utf-8")
                self.i += 1
            hi = lo
            if self.peek() == "-" and self.p[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                if self.peek() == "\\":
                    node = self._escape(in_set=True)
                    if node[0] == "set":
                        self.fail("a class as a range's end")
                    hi = node[1]
                else:
                    hi = self.peek().encode("utf-8")
                    self.i += 1
            if len(lo) != 1 or len(hi) != 1 or hi < lo:
                self.fail("class ranges are of ASCII characters, in order")
            ranges.append((lo[0], hi[0]))
        self.i += 1
        return ("set", ranges, neg)


class _NFA:
    def __init__(self):
        self.eps, self.edges = [], []  # per state: [targets], [(lo, hi, target)]

    def state(self) -> int:
        self.eps.append([])
        self.edges.append([])
        if len(self.eps) > 64 * MAX_REGEX_STATES:
            raise ValueError("regex: the pattern's automaton is too large")
        return len(self.eps) - 1

    def build(self, node) -> tuple:
        """(start, end) of a fragment matching ``node``."""
        kind = node[0]
        s, e = self.state(), None
        if kind == "cat":
            cur = s
            for item in node[1]:
                a, b = self.build(item)
                self.eps[cur].append(a)
                cur = b
            return s, cur
        e = self.state()
        if kind == "alt":
            for item in node[1]:
                a, b = self.build(item)
                self.eps[s].append(a)
                self.eps[b].append(e)
        elif kind == "seq":
            cur = s
            for byte in node[1]:
                nxt = self.state()
                self.edges[cur].append((byte, byte, nxt))
                cur = nxt
            self.eps[cur].append(e)
        elif kind == "set":
            ranges, neg = node[1], node[2]
            if neg:  # every character but the listed ASCII ones
                self.edges[s] += [(lo, hi, e) for lo, hi in _complement(ranges)]
                for seq in _ANY_UTF8[1:]:
                    self._chain(s, e, seq)
            else:
                self.edges[s] += [(lo, hi, e) for lo, hi in ranges]
        elif kind == "any":  # any character but a newline (Python's ``.``)
            self.edges[s] += [(0x00, 0x09, e), (0x0B, 0x7F, e)]
            for seq in _ANY_UTF8[1:]:
                self._chain(s, e, seq)
        elif kind == "rep":
            sub, m, n = node[1], node[2], node[3]
            cur = s
            for _ in range(m):
                a, b = self.build(sub)
                self.eps[cur].append(a)
                cur = b
            if n is None:  # then any number more
                a, b = self.build(sub)
                self.eps[cur] += [a, e]
                self.eps[b] += [a, e]
            else:
                for _ in range(n - m):
                    a, b = self.build(sub)
                    self.eps[cur] += [a, e]
                    cur = b
                self.eps[cur].append(e)
        return s, e

    def _chain(self, s: int, e: int, seq) -> None:
        cur = s
        for k, (lo, hi) in enumerate(seq):
            nxt = e if k == len(seq) - 1 else self.state()
            self.edges[cur].append((lo, hi, nxt))
            cur = nxt


def _complement(ranges) -> list:
    """The ASCII bytes (0..127) outside ``ranges``, as ranges."""
    out, lo = [], 0
    for a, b in sorted(ranges):
        if a > lo:
            out.append((lo, min(a - 1, 0x7F)))
        lo = max(lo, b + 1)
    if lo <= 0x7F:
        out.append((lo, 0x7F))
    return [(a, b) for a, b in out if a <= b and a <= 0x7F]


def regex_automaton(pattern: str) -> tuple:
    """(delta [Q, 256] int32, accept [Q] bool) of ``pattern`` matched whole (the section's comment); a ValueError
    names what is not taken, or a pattern whose automaton exceeds MAX_REGEX_STATES states."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError("regex: expected a non-empty pattern")
    nfa = _NFA()
    start, end = nfa.build(_Parser(pattern).parse())

    def closure(states):
        stack, seen = list(states), set(states)
        while stack:
            for t in nfa.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(seen)

    first = closure([start])
    index, order, rows = {first: 0}, [first], []
    while len(rows) < len(order):
        S = order[len(rows)]
        row = np.full(256, -1, np.int32)
        moves: dict = {}
        for q in S:
            for lo, hi, t in nfa.edges[q]:
                for b in range(lo, hi + 1):
                    moves.setdefault(b, set()).add(t)
        for b, ts in moves.items():
            T = closure(ts)
            if T not in index:
                if len(order) >= MAX_REGEX_STATES:
                    raise ValueError(f"regex {pattern!r}: its automaton exceeds {MAX_REGEX_STATES} states")
                index[T] = len(order)
                order.append(T)
            row[b] = index[T]
        rows.append(row)
    delta, accept = np.stack(rows), np.array([end in S for S in order])
    # keep the states from which an accepting one can be reached, renumbered in order (the start stays 0)
    live = accept.copy()
    while True:
        grown = live | np.array([bool((live[r[r >= 0]]).any()) for r in delta])
        if (grown == live).all():
            break
        live = grown
    if not live[0]:
        raise ValueError(f"regex {pattern!r}: matches no text")
    new = np.cumsum(live) - 1
    delta = np.where(delta >= 0, np.where(live[np.maximum(delta, 0)], new[np.maximum(delta, 0)], -1), -1)
    return delta[live].astype(np.int32), accept[live]


def regex_fsm(pattern: str, tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> TokenFSM:
    """The constraint "a text ``pattern`` matches whole, then a stop id" over ``tokenizer``'s vocabulary."""
    return vocab_fsm(regex_automaton(pattern), tokenizer, vocab_size, stop_ids)
