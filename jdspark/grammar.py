"""Constrained decoding: the output must be one of a list of strings (``choice_automaton``), a text a regular
expression matches whole (``regex_automaton``; JSON Schemas become one in ``jdspark.json_schema``), then a stop
token. A byte automaton of the allowed texts is lifted to the vocabulary once, on the host, as one table the device
indexes:

    next_QV[q, v] = the automaton's state after token v's bytes from state q, or -1 where they leave the language
                    (a stop id: q itself where q accepts, a finished text may end; -1 elsewhere)

A stream carries its state q (-1: unconstrained) and the table (on the device by token classes,
``token_classes``); at each position the step verifies, the target's
logits are masked to {v : next_QV[q_j, v] >= 0} with q_j the state after the drafts before j
(``jdspark.stream_logits.penalized``), and the committed tokens advance q. The masked logits are the target's law, so
greedy and rejection sampling stay lossless. The drafter proposes within the language too (its Markov decode masked
by the same table, ``DSparkDrafter.decode_block(automaton=)``): the rejection rule reads that masked proposal, so
any proposal stays lossless, and no draft is spent on a token the target cannot take.

Every token whose bytes walk the automaton is allowed, so every tokenization of an allowed text can be generated,
not only the tokenizer's own. Special tokens (their "bytes" are their names) and tokens of no bytes never are.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import numpy as np

__all__ = ["TokenFSM", "choice_automaton", "token_fsm", "vocab_fsm", "choice_fsm", "regex_automaton", "minimize",
           "after_marker", "regex_fsm", "token_classes"]


@dataclasses.dataclass(frozen=True, eq=False)
class TokenFSM:
    """A constraint over a vocabulary (module doc): state 0 is the start."""
    next_QV: np.ndarray  # int32 [Q, V]

    @property
    def num_states(self) -> int:
        return int(self.next_QV.shape[0])

    @functools.cached_property
    def classes(self) -> tuple:
        """``token_classes`` of the table, unpadded (computed once: a served table is inserted many times)."""
        return token_classes(self.next_QV)

    def device_tables(self, classes: int) -> tuple:
        """(next_QC [Q, classes], class_V [V]): the classes padded with columns of -1 (ValueError: too many)."""
        next_QC, class_V = self.classes
        if next_QC.shape[1] > classes:
            raise ValueError(f"grammar: the automaton tells {next_QC.shape[1]} token classes apart; at most "
                             f"{classes} are taken")
        pad = np.full((next_QC.shape[0], classes - next_QC.shape[1]), -1, np.int32)
        return np.concatenate([next_QC, pad], axis=1), class_V


def token_classes(next_QV: np.ndarray) -> tuple:
    """The table as the device holds it: (next_QC int32 [Q, C], class_V int32 [V]) with next_QV[q, v] =
    next_QC[q, class_V[v]]: tokens the automaton treats alike (the same column) share a class, so a slot's table is
    Q x C + V, not Q x V (json_object over the shipped 4096-token vocabulary: 99 classes; over K3's 163840 a dense
    table would take 170 MB a slot). Padded to a slot's C by ``TokenFSM.device_tables``."""
    next_QV = np.asarray(next_QV, np.int32)
    first_C, class_V = _row_groups(next_QV.T)
    return np.ascontiguousarray(next_QV[:, first_C]), class_V.astype(np.int32)


def _row_groups(M_NK: np.ndarray, chunk: int = 32) -> tuple:
    """Identical rows of an int matrix grouped: (first_G, group_N) with group g's rows those where group_N == g,
    first_G[g] its first row, groups numbered in order of first row. Exact: rows are hashed (a fixed random linear
    form mod 2^64, ``chunk`` columns at a time: over K3's 163840 ids 42 MB a chunk, never a copy of the whole
    table), every row is compared with its group's first, and on a collision (then ``np.unique`` over whole rows)
    no two rows are merged."""
    N, K = M_NK.shape
    weights_K = np.random.default_rng(0x5EED).integers(1, 2 ** 63, size=K, dtype=np.uint64)
    h_N = np.zeros(N, np.uint64)
    for j in range(0, K, chunk):
        h_N += (M_NK[:, j:j + chunk].astype(np.uint64) * weights_K[j:j + chunk]).sum(axis=1, dtype=np.uint64)
    _, first, group = np.unique(h_N, return_index=True, return_inverse=True)
    group = group.reshape(-1)
    if not all((M_NK[:, j:j + chunk] == M_NK[first[group], j:j + chunk]).all() for j in range(0, K, chunk)):
        _, first, group = np.unique(M_NK, axis=0, return_index=True, return_inverse=True)
        group = group.reshape(-1)
    by_first = np.argsort(first)
    rank = np.empty(len(first), np.int64)
    rank[by_first] = np.arange(len(first))
    return first[by_first], rank[group]


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
    past the list likewise), ``stop_ids`` allowed exactly in accepting states. Every state walks every token at
    once, one byte position at a time (tokens longest first, so position j touches only the tokens longer than
    j; states in chunks of about 4M state-token pairs)."""
    Q = delta_Q256.shape[0]
    n = min(len(token_bytes), vocab_size)
    lens_V = np.array([len(token_bytes[v] or b"") for v in range(n)] + [0] * (vocab_size - n), np.int64)
    order_V = np.argsort(-lens_V, kind="stable")  # longest first
    L = max(1, int(lens_V.max(initial=0)))
    bytes_VL = np.zeros((vocab_size, L), np.int64)  # in that order
    for i, v in enumerate(order_V[:int((lens_V > 0).sum())]):
        bytes_VL[i, :lens_V[v]] = np.frombuffer(token_bytes[v], np.uint8)
    longer_L = [int((lens_V > j).sum()) for j in range(L)]  # tokens with a byte at position j: the first ones
    delta = np.asarray(delta_Q256, np.int32)
    next_QV = np.full((Q, vocab_size), -1, np.int32)
    rows = max(1, (1 << 22) // max(vocab_size, 1))
    for q0 in range(0, Q, rows):
        q_R = np.arange(q0, min(q0 + rows, Q), dtype=np.int32)
        cur_RV = np.repeat(q_R[:, None], longer_L[0], axis=1)
        for j in range(L):
            live = cur_RV[:, :longer_L[j]]
            live[...] = np.where(live >= 0, delta[np.maximum(live, 0), bytes_VL[None, :longer_L[j], j]], -1)
        next_QV[q0:q0 + len(q_R), order_V[:longer_L[0]]] = cur_RV
    stops = np.asarray([s for s in stop_ids if 0 <= s < vocab_size], np.int64)
    if stops.size:
        next_QV[:, stops] = np.where(np.asarray(accept_Q, bool), np.arange(Q, dtype=np.int32), -1)[:, None]
    return TokenFSM(next_QV)


def vocab_fsm(automaton: tuple, tokenizer, vocab_size: int, stop_ids: Sequence[int],
              specials_as_text: Sequence[int] = ()) -> TokenFSM:
    """A byte automaton (delta, accept) lifted to ``tokenizer``'s vocabulary (``token_fsm``; special ids never, but
    ``specials_as_text``, walked as their text: a thinking model's ``</think>`` where it is a special token)."""
    special = set(tokenizer.special_ids) - set(specials_as_text)
    tb = [None if v in special else tokenizer.token_bytes(v) for v in range(min(vocab_size, tokenizer.vocab_size))]
    return token_fsm(*automaton, tb, vocab_size, stop_ids)


def choice_fsm(choices: Sequence[str], tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> TokenFSM:
    """The constraint "one of ``choices`` (UTF-8), then a stop id" over ``tokenizer``'s vocabulary."""
    automaton = choice_automaton([c.encode("utf-8") if isinstance(c, str) else c for c in choices])
    return vocab_fsm(automaton, tokenizer, vocab_size, stop_ids)


# ------------------------------------------------------------------------------------------------------------ regex
# A regular expression (the common subset: literals and escapes (``\xHH``, ``\uHHHH`` too), ``.``, classes
# ``[a-z]`` / ``[^...]``, ``\d \w \s`` and their negations, groups ``( )`` / ``(?: )``, ``|``, ``* + ?`` and
# ``{m}`` / ``{m,}`` / ``{m,n}``) matched whole (as ``re.fullmatch``) over the text's UTF-8 bytes: a Thompson NFA
# over bytes, made deterministic by subsets, then every state that cannot reach an accepting one removed (a stream
# is never led where no text can end) and the automaton minimized (``minimize``: the table the device holds is Q x V).
# Characters are Unicode: ``.`` (but a newline, as Python's) and a negated class match any character's byte
# sequence (ASCII ranges only in classes).

_ANY_UTF8 = [  # one character's UTF-8 bytes, as ranges per byte
    [(0x00, 0x7F)], [(0xC2, 0xDF), (0x80, 0xBF)], [(0xE0, 0xEF), (0x80, 0xBF), (0x80, 0xBF)],
    [(0xF0, 0xF4), (0x80, 0xBF), (0x80, 0xBF), (0x80, 0xBF)]]
_CLASSES = {"d": [(0x30, 0x39)], "w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
            "s": [(0x09, 0x0D), (0x20, 0x20)]}
MAX_REGEX_STATES = 4096  # a pattern whose minimal automaton is larger is refused (ValueError)
MAX_SUBSET_STATES = 8 * MAX_REGEX_STATES  # and one whose subset construction grows past this


class _Parser:
    """Pattern -> AST: ("cat", [..]), ("alt", [..]), ("rep", node, m, n or None), ("set", ascii ranges, negated),
    ("seq", bytes) (a literal's UTF-8), ("any",)."""

    def __init__(self, pattern: str):
        self.p, self.i = pattern, 0

    def fail(self, what: str):
        shown = self.p if len(self.p) <= 80 else self.p[:77] + "..."
        raise ValueError(f"regex {shown!r}: {what} at position {self.i}")

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
        elif c in ("x", "u"):  # \xHH, \uHHHH: the character of that code point
            digits = self.p[self.i:self.i + (2 if c == "x" else 4)]
            if len(digits) != (2 if c == "x" else 4) or any(d not in "0123456789abcdefABCDEF" for d in digits):
                self.fail(f"\\{c} takes {2 if c == 'x' else 4} hex digits")
            self.i += len(digits)
            c = chr(int(digits, 16))
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
    shown = pattern if len(pattern) <= 80 else pattern[:77] + "..."
    # bytes no edge tells apart move alike: walk one class of them at a time (the classes' bounds: every edge's)
    cuts = sorted({0, 256} | {b for edges in nfa.edges for lo, hi, _ in edges for b in (lo, hi + 1)})
    class_of = [0] * 257
    for c, (a, b) in enumerate(zip(cuts, cuts[1:])):
        class_of[a:b] = [c] * (b - a)
    moves_of = [[(c, t) for lo, hi, t in edges for c in range(class_of[lo], class_of[hi] + 1)]
                for edges in nfa.edges]  # per NFA state: (byte class, target) pairs
    # a subset is kept as the NFA states of its closure that read a byte, and whether the end is among them (the
    # other states only lead on by epsilon: two closures alike on these have the same future)
    kept = frozenset(q for q, m in enumerate(moves_of) if m) | {end}

    def closure(states):
        stack, seen = list(states), set(states)
        while stack:
            for t in nfa.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(seen & kept)

    first = closure([start])
    index, order, rows, closed = {first: 0}, [first], [], {}
    while len(rows) < len(order):
        row = [-1] * (len(cuts) - 1)
        moves: dict = {}
        for q in order[len(rows)]:
            for c, t in moves_of[q]:
                moves.setdefault(c, []).append(t)
        for c, ts in moves.items():
            ts = frozenset(ts)
            T = closed.get(ts)
            if T is None:  # bytes leading to the same NFA states share one closure
                T = closed[ts] = closure(ts)
            i = index.get(T)
            if i is None:
                if len(order) >= MAX_SUBSET_STATES:
                    raise ValueError(f"regex {shown!r}: its automaton exceeds {MAX_SUBSET_STATES} states before "
                                     "minimizing")
                i = index[T] = len(order)
                order.append(T)
            row[c] = i
        rows.append(row)
    rows = np.asarray(rows, np.int32)[:, np.asarray(class_of[:256])]
    delta, accept = rows, np.array([end in S for S in order])
    # keep the states from which an accepting one can be reached, renumbered in order (the start stays 0)
    live, leads = accept.copy(), delta >= 0
    target = np.maximum(delta, 0)
    while True:
        grown = live | (live[target] & leads).any(axis=1)
        if (grown == live).all():
            break
        live = grown
    if not live[0]:
        raise ValueError(f"regex {shown!r}: matches no text")
    new = np.cumsum(live) - 1
    delta = np.where(delta >= 0, np.where(live[np.maximum(delta, 0)], new[np.maximum(delta, 0)], -1), -1)
    delta, accept = minimize(delta[live].astype(np.int32), accept[live])
    if delta.shape[0] > MAX_REGEX_STATES:
        raise ValueError(f"regex {shown!r}: its automaton has {delta.shape[0]} states, more than "
                         f"{MAX_REGEX_STATES}")
    return delta, accept


def minimize(delta_Q256: np.ndarray, accept_Q: np.ndarray) -> tuple:
    """The smallest automaton of the same language (Moore's partition refinement: states stay together while
    they agree on accepting and on the class each byte leads to; -1 leads to a dead state of its own). States are
    renumbered in order of first reach from the start (0), breadth first, bytes in order."""
    Q = delta_Q256.shape[0]
    to_Q256 = np.where(delta_Q256 >= 0, delta_Q256, Q).astype(np.int64)  # Q: the dead state
    first_K, col_256 = _row_groups(to_Q256.T)  # bytes the automaton treats alike: one column each (by first byte)
    to_QK = np.vstack([to_Q256[:, first_K], np.full((1, len(first_K)), Q)])  # [Q + 1, K]
    cls = np.append(np.asarray(accept_Q, np.int64), 2)  # the dead state never accepts, nor reaches what does
    count = len(np.unique(cls))
    while True:
        _, new = _row_groups(np.concatenate([cls[:, None], cls[to_QK]], axis=1))
        if new.max() + 1 == count:
            break
        cls, count = new, int(new.max()) + 1
    _, rep, cls = np.unique(cls, return_index=True, return_inverse=True)  # each class's first state
    cls = cls.reshape(-1)
    dead = int(cls[Q])
    next_CK = cls[to_QK[rep]]
    number = {int(cls[0]): 0}  # breadth first from the start's class (columns in order of their first byte)
    frontier = [int(cls[0])]
    for c in frontier:
        for t in next_CK[c].tolist():
            if t != dead and t not in number:
                number[t] = len(number)
                frontier.append(t)
    renumber = np.full(count, -1, np.int64)
    renumber[list(number)] = list(number.values())
    order = np.asarray(frontier, np.int64)
    out = renumber[next_CK[order]][:, col_256].astype(np.int32)
    return out, np.asarray(accept_Q, bool)[rep[order]]


def after_marker(automaton: tuple, marker: bytes) -> tuple:
    """Any text up to the first ``marker`` (a thinking model's reasoning and its ``</think>``), then a text of
    ``automaton``: the marker's Knuth-Morris-Pratt automaton (state i: the last i bytes read are the marker's
    first i; the text before holds no whole marker) with its completion leading to ``automaton``'s start. The
    answer's states follow the marker's m, renumbered by m; only they accept."""
    if not isinstance(marker, bytes) or not marker:
        raise ValueError("after_marker: expected a non-empty byte marker")
    delta, accept = automaton
    m = len(marker)
    kmp = np.zeros((m, 256), np.int64)
    kmp[0, marker[0]] = 1
    fallback = 0  # the state of the longest proper border of the prefix read so far
    for i in range(1, m):
        kmp[i] = kmp[fallback]
        kmp[i, marker[i]] = i + 1
        fallback = int(kmp[fallback, marker[i]])
    head = kmp.astype(np.int32)  # completing the marker (state m): the answer's start
    body = np.where(delta >= 0, delta + m, -1).astype(np.int32)
    return np.concatenate([head, body]), np.concatenate([np.zeros(m, bool), accept])


def regex_fsm(pattern: str, tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> TokenFSM:
    """The constraint "a text ``pattern`` matches whole, then a stop id" over ``tokenizer``'s vocabulary."""
    return vocab_fsm(regex_automaton(pattern), tokenizer, vocab_size, stop_ids)
