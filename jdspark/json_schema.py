"""JSON output (OpenAI's ``response_format`` json_object / json_schema, vLLM's ``guided_json``): a JSON Schema
turned into a regular expression of ``jdspark.grammar``'s subset, whose automaton then constrains decoding as any
``guided_regex`` does. A regular language cannot nest without bound, so nesting is bounded:

    schema_regex(schema)   a text matching it is one JSON document the schema validates (the subset below), in
                           json.dumps' layout: no whitespace but one optional space after ':' and ',' (the
                           separators json.dumps and compact writers both use); properties in the schema's order
    json_value_regex(d)    any JSON value nested at most d deep (json_object: ``any_object_regex``)

Taken: ``type`` (one or a list), ``enum``, ``const``, ``anyOf`` / ``oneOf`` (both as "one of these matches"; a
document valid under two ``oneOf`` branches is not excluded), ``allOf`` of one schema, ``$ref`` to ``#/$defs/..``
or ``#/definitions/..`` or ``#`` (a recursive one expanded ``RECURSION_DEPTH`` times along a path: a document nested
deeper is not generated, so an optional property or an array item that would recurse further is left out there,
and a required one leaves that branch out), ``properties`` + ``required`` (other properties are not written: OpenAI's
strict mode), an object without ``properties`` (any keys, values nested to ``MAX_DEPTH``), ``items``,
``minItems`` / ``maxItems``, ``minLength`` / ``maxLength`` / ``pattern`` / ``format`` (date,
time, date-time, uuid) of strings, ``minimum`` / ``maximum`` / ``exclusiveMinimum`` / ``exclusiveMaximum`` of
integers (exact decimal ranges) and of numbers (a bounded number is written without an exponent:
``number_range_regex``). A keyword that constrains in another way (``multipleOf``, ``uniqueItems``, ``not``, ...)
is refused with a ValueError naming it, never silently dropped; annotations (``title``, ``description``,
``default``, ``examples``, ...) are read past.
"""

from __future__ import annotations

import decimal
import json
import math
import re
from typing import Optional

__all__ = ["literal", "schema_regex", "json_value_regex", "any_object_regex", "integer_range_regex",
           "number_range_regex", "MAX_DEPTH", "RECURSION_DEPTH"]

MAX_DEPTH = 3  # how deep a free-form value (json_object, an object without properties) may nest
RECURSION_DEPTH = 3  # how many times a recursive $ref is expanded along one path (deeper: the empty language)
_SEP_ITEM, _SEP_KEY = ", ?", ": ?"
_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'  # one character of a JSON string
STRING = f'"{_CHAR}*"'
NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
INTEGER = r"-?(?:0|[1-9][0-9]*)"
_FORMATS = {
    "date": r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])",
    "time": r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])?",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
}
_FORMATS["date-time"] = _FORMATS["date"] + "T" + _FORMATS["time"]
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                "readOnly", "writeOnly", "$defs", "definitions", "strict", "name"}
_TAKEN = {
    "string": {"type", "enum", "const", "minLength", "maxLength", "pattern", "format"},
    "integer": {"type", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "number": {"type", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "boolean": {"type", "enum", "const"},
    "null": {"type", "enum", "const"},
    "array": {"type", "enum", "const", "items", "minItems", "maxItems"},
    "object": {"type", "enum", "const", "properties", "required", "additionalProperties"},
}


def literal(text: str) -> str:
    """``text`` as a pattern matching exactly it (the subset's metacharacters escaped)."""
    return re.sub(r"([\\.^$|?*+()\[\]{}\-])", r"\\\1", text)


def _repeat(item: str, lo: int, hi: Optional[int], sep: str) -> str:
    """``lo`` to ``hi`` (None: any number) of ``item`` separated by ``sep``."""
    if hi is not None and hi < lo:
        raise ValueError(f"a maximum count {hi} below the minimum {lo}")
    if hi == 0:
        return ""
    more = f"(?:{sep}{item})" + (("*" if lo <= 1 else f"{{{lo - 1},}}") if hi is None else
                                  f"{{{max(lo - 1, 0)},{hi - 1}}}")
    body = f"{item}{more}"
    return body if lo > 0 else f"(?:{body})?"


def json_value_regex(depth: int) -> str:
    """Any JSON value whose arrays and objects nest at most ``depth`` deep (0: scalars only)."""
    scalar = f"(?:{STRING}|{NUMBER}|true|false|null)"
    value = scalar
    for _ in range(depth):
        obj = r"\{" + _repeat(f"{STRING}{_SEP_KEY}{value}", 0, None, _SEP_ITEM) + r"\}"
        arr = r"\[" + _repeat(value, 0, None, _SEP_ITEM) + r"\]"
        value = f"(?:{scalar}|{obj}|{arr})"
    return value


def any_object_regex(depth: int = MAX_DEPTH) -> str:
    """A JSON object (json_object mode: the answer is an object) whose values nest at most ``depth - 1`` deeper."""
    return r"\{" + _repeat(f"{STRING}{_SEP_KEY}{json_value_regex(depth - 1)}", 0, None, _SEP_ITEM) + r"\}"


# ------------------------------------------------------------------------------------------------------ integers
def _digits_between(lo: str, hi: str) -> str:
    """The digit strings of one length between ``lo`` and ``hi`` (same length, lo <= hi), as a pattern."""
    if not lo:
        return ""
    if lo == hi:
        return lo
    if lo[0] == hi[0]:
        return lo[0] + _digits_between(lo[1:], hi[1:])
    n = len(lo) - 1
    parts = [lo[0] + _group(_digits_between(lo[1:], "9" * n))]
    if int(hi[0]) - int(lo[0]) > 1:
        mid = _span(chr(ord(lo[0]) + 1), chr(ord(hi[0]) - 1))
        parts.append(mid + (f"[0-9]{{{n}}}" if n else ""))
    parts.append(hi[0] + _group(_digits_between("0" * n, hi[1:])))
    return "(?:" + "|".join(parts) + ")"


def _span(a: str, b: str) -> str:
    return a if a == b else f"[{a}-{b}]"


def _group(p: str) -> str:
    return p if not p or p.isdigit() or p.startswith("(?:") and p.endswith(")") else f"(?:{p})"


def _naturals(lo: int, hi: Optional[int]) -> str:
    """Non-negative integers in [lo, hi] (hi None: unbounded) without leading zeros."""
    parts = []
    top = len(str(hi)) if hi is not None else len(str(lo))
    for n in range(len(str(lo)), top + 1):
        a = max(lo, 10 ** (n - 1) if n > 1 else 0)
        b = min(hi, 10 ** n - 1) if hi is not None else 10 ** n - 1
        if a <= b:
            parts.append(_digits_between(str(a).zfill(n), str(b).zfill(n)))
    if hi is None:
        parts.append(f"[1-9][0-9]{{{len(str(lo))},}}")
    return "(?:" + "|".join(parts) + ")"


def integer_range_regex(lo: Optional[int], hi: Optional[int]) -> str:
    """The decimal integers in [lo, hi] (None: unbounded that side), as JSON writes them (no leading zeros or '+',
    no '-0')."""
    if lo is not None and hi is not None and hi < lo:
        raise ValueError(f"integer bounds: maximum {hi} below minimum {lo}")
    parts = []
    if hi is None or hi >= 0:  # the non-negative ones
        parts.append(_naturals(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:  # the negative ones: '-' and a natural in [max(1, -hi), -lo]
        parts.append("-" + _naturals(max(1, -hi) if hi is not None else 1, -lo if lo is not None else None))
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


# ------------------------------------------------------------------------------------------------------- numbers
# A bounded number is written without an exponent: an integer part and an optional fraction, compared with the
# bound digit by digit. A fraction's digits f stand for 0.f (zeros after); each helper returns (a pattern of the
# non-empty digit strings taken, or None: none; whether the empty string, no fraction, is taken).

def _frac_at_least(d: str, strict: bool) -> tuple:
    """Digit strings f with 0.f >= 0.d (> when ``strict``); ``d`` without trailing zeros."""
    if not d:
        return ("0*[1-9][0-9]*" if strict else "[0-9]+"), not strict
    c, parts = d[0], []
    if c < "9":
        parts.append(_span(chr(ord(c) + 1), "9") + "[0-9]*")
    tail = _then(c, _frac_at_least(d[1:], strict))
    return _either(parts + ([tail] if tail else [])), False


def _frac_at_most(d: str, strict: bool) -> tuple:
    """Digit strings f with 0.f <= 0.d (< when ``strict``)."""
    if not d:
        return (None, False) if strict else ("0+", True)
    c, parts = d[0], []
    if c > "0":
        parts.append(_span("0", chr(ord(c) - 1)) + "[0-9]*")
    tail = _then(c, _frac_at_most(d[1:], strict))
    return _either(parts + ([tail] if tail else [])), True


def _frac_between(lo: str, hi: str, strict_lo: bool, strict_hi: bool) -> tuple:
    """Digit strings f with 0.lo <= 0.f <= 0.hi (each side strict or not); 0.lo <= 0.hi."""
    if not lo and not hi:
        return (None, False) if strict_lo or strict_hi else ("0+", True)
    cl, ch = (lo or "0")[0], (hi or "0")[0]
    if cl == ch:
        tail = _then(cl, _frac_between(lo[1:], hi[1:], strict_lo, strict_hi))
        parts = [tail] if tail else []
    else:
        parts = [t for t in (_then(cl, _frac_at_least(lo[1:], strict_lo)),) if t]
        if ord(ch) - ord(cl) > 1:
            parts.append(_span(chr(ord(cl) + 1), chr(ord(ch) - 1)) + "[0-9]*")
        parts += [t for t in (_then(ch, _frac_at_most(hi[1:], strict_hi)),) if t]
    return _either(parts), not lo and not strict_lo


def _then(digit: str, rest: tuple) -> Optional[str]:
    """``digit`` followed by a string of ``rest`` (pattern, takes empty), or None where there is none."""
    pattern, empty = rest
    if pattern is None:
        return digit if empty else None
    return digit + (f"(?:{pattern})?" if empty else f"(?:{pattern})")


def _either(parts: list) -> Optional[str]:
    return None if not parts else parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _fraction(rest: tuple) -> Optional[str]:
    """The text after an integer part: '.' and a fraction of ``rest``, or nothing where it takes the empty string
    (None: no text at all)."""
    pattern, empty = rest
    if pattern is None:
        return "" if empty else None
    return rf"(?:\.(?:{pattern}))?" if empty else rf"\.(?:{pattern})"


def _split(x) -> tuple:
    """A non-negative bound as (integer part, fraction digits without trailing zeros), exactly as written."""
    text = format(decimal.Decimal(repr(x) if isinstance(x, float) else x), "f")
    whole, _, frac = text.partition(".")
    return int(whole), frac.rstrip("0")


def _unsigned_range(lo, hi, strict_lo: bool, strict_hi: bool) -> Optional[str]:
    """Decimals y (integer part, optional fraction) with lo <= y <= hi (strict as asked; hi None: unbounded),
    0 <= lo; None where there is none."""
    a, fa = _split(lo)
    if hi is not None:
        b, fb = _split(hi)
        if a == b:
            text = _fraction(_frac_between(fa, fb, strict_lo, strict_hi))
            return None if text is None else str(a) + text
    parts = []
    low = _fraction(_frac_at_least(fa, strict_lo))
    if low is not None:
        parts.append(str(a) + low)
    if hi is None or b - a >= 2:
        parts.append(_naturals(a + 1, None if hi is None else b - 1) + r"(?:\.[0-9]+)?")
    if hi is not None:
        high = _fraction(_frac_at_most(fb, strict_hi))
        if high is not None:
            parts.append(str(b) + high)
    return _either(parts)


def number_range_regex(lo=None, hi=None, exclusive_lo: bool = False, exclusive_hi: bool = False) -> str:
    """JSON numbers x with lo <= x <= hi (``exclusive_*``: < instead; None: unbounded that side), written without an
    exponent (an integer part, an optional fraction: '2', '0.25', '-3.5'; no '-0'). ValueError where none is."""
    if lo is not None and hi is not None and (hi < lo or hi == lo and (exclusive_lo or exclusive_hi)):
        raise ValueError(f"number bounds: no number between {lo} and {hi}")
    parts = []
    if hi is None or hi > 0 or hi == 0 and not exclusive_hi:  # x >= 0
        nonneg = (lo, exclusive_lo) if lo is not None and lo >= 0 else (0, False)
        parts.append(_unsigned_range(nonneg[0], hi, nonneg[1], exclusive_hi))
    if lo is None or lo < 0:  # x = -y, y > 0
        low = (-hi, exclusive_hi) if hi is not None and hi < 0 else (0, True)
        y = _unsigned_range(low[0], None if lo is None else -lo, low[1], exclusive_lo)
        parts.append(None if y is None else "-" + (y if y.startswith("(?:") else f"(?:{y})"))
    parts = [p for p in parts if p is not None]
    if not parts:
        raise ValueError(f"number bounds: no number between {lo} and {hi}")
    return _either(parts)


# ------------------------------------------------------------------------------------------------------- schemas
class _Compiler:
    def __init__(self, root: dict):
        self.root, self.open_refs = root, []

    def value(self, s, where: str) -> Optional[str]:
        """The pattern of ``s``'s documents, or None where none is generated (recursion past RECURSION_DEPTH)."""
        if s is True or s == {}:
            return json_value_regex(MAX_DEPTH)
        if not isinstance(s, dict):
            raise ValueError(f"{where}: expected a schema (an object), got {type(s).__name__}")
        if "$ref" in s:
            return self.ref(s, where)
        for key in ("anyOf", "oneOf"):
            if key in s:
                return self.alternatives(s, key, where)
        if "allOf" in s:
            if not isinstance(s["allOf"], list) or len(s["allOf"]) != 1:
                raise ValueError(f"{where}.allOf: only one schema is taken (intersections are not built)")
            return self.value({**{k: v for k, v in s.items() if k != "allOf"}, **s["allOf"][0]}, where)
        if "const" in s:
            self.check(s, set(s) - _ANNOTATIONS - {"const", "type", "enum"}, where)
            return literal(json.dumps(s["const"]))
        if "enum" in s:
            self.check(s, set(s) - _ANNOTATIONS - {"enum", "type"}, where)
            if not isinstance(s["enum"], list) or not s["enum"]:
                raise ValueError(f"{where}.enum: expected a non-empty list")
            return "(?:" + "|".join(literal(json.dumps(v)) for v in s["enum"]) + ")"
        types = s.get("type")
        if types is None:
            types = "object" if "properties" in s else "array" if "items" in s else None
            if types is None:
                self.check(s, set(s) - _ANNOTATIONS, where)
                return json_value_regex(MAX_DEPTH)
        if isinstance(types, list):
            if not types:
                raise ValueError(f"{where}.type: an empty list")
            return _one_of([self.typed({**s, "type": t}, t, where) for t in types])
        return self.typed(s, types, where)

    def check(self, s: dict, keys, where: str) -> None:
        if keys:
            raise ValueError(f"{where}: {sorted(keys)} not taken here (constraints are never dropped silently)")

    def ref(self, s: dict, where: str) -> Optional[str]:
        """The schema a ``$ref`` names (``#``: the root), or None (the empty language) where that reference is
        already open RECURSION_DEPTH times along this path."""
        path = s["$ref"]
        self.check(s, set(s) - _ANNOTATIONS - {"$ref"}, where)
        target = self.root if path == "#" else None
        for prefix in ("#/$defs/", "#/definitions/"):
            if isinstance(path, str) and path.startswith(prefix):
                defs = self.root.get(prefix[2:-1], {})
                if path[len(prefix):] not in defs:
                    raise ValueError(f"{where}.$ref: {path!r} is not defined")
                target = defs[path[len(prefix):]]
        if target is None:
            raise ValueError(f"{where}.$ref: {path!r} not taken (only '#', '#/$defs/NAME' and "
                             "'#/definitions/NAME')")
        if self.open_refs.count(path) >= RECURSION_DEPTH:
            return None  # nested as deep as taken: no document goes on here
        self.open_refs.append(path)
        try:
            return self.value(target, path)
        finally:
            self.open_refs.pop()

    def alternatives(self, s: dict, key: str, where: str) -> Optional[str]:
        options = s[key]
        if not isinstance(options, list) or not options:
            raise ValueError(f"{where}.{key}: expected a non-empty list of schemas")
        base = {k: v for k, v in s.items() if k != key and k not in _ANNOTATIONS}
        return _one_of([self.value({**base, **o} if isinstance(o, dict) else o, f"{where}.{key}[{i}]")
                        for i, o in enumerate(options)])

    def typed(self, s: dict, t, where: str) -> Optional[str]:
        if t not in _TAKEN:
            raise ValueError(f"{where}.type: {t!r} is not a JSON Schema type")
        self.check(s, set(s) - _ANNOTATIONS - _TAKEN[t], where)
        if t == "null":
            return "null"
        if t == "boolean":
            return "(?:true|false)"
        if t == "number":
            return self.number(s, where)
        if t == "integer":
            return self.integer(s, where)
        if t == "string":
            return self.string(s, where)
        if t == "array":
            return self.array(s, where)
        return self.object(s, where)

    def integer(self, s: dict, where: str) -> str:
        lo, hi = s.get("minimum"), s.get("maximum")
        for key, bound, step in (("exclusiveMinimum", "lo", 1), ("exclusiveMaximum", "hi", -1)):
            if key in s:
                x = s[key]
                if isinstance(x, bool) or not isinstance(x, (int, float)):
                    raise ValueError(f"{where}.{key}: expected a number")
                if bound == "lo":
                    lo = max(lo, x + step) if lo is not None else x + step
                else:
                    hi = min(hi, x + step) if hi is not None else x + step
        lo = math.ceil(lo) if lo is not None else None
        hi = math.floor(hi) if hi is not None else None
        if lo is None and hi is None:
            return INTEGER
        return integer_range_regex(lo, hi)

    def number(self, s: dict, where: str) -> str:
        """Unbounded: any JSON number; bounded: ``number_range_regex`` (no exponent), the tighter of ``minimum`` /
        ``exclusiveMinimum`` (and of the maxima) where both are given."""
        bounds = {}
        for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
            if key in s:
                x = s[key]
                if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                    raise ValueError(f"{where}.{key}: expected a finite number")
                bounds[key] = x
        if not bounds:
            return NUMBER
        lows = [(bounds[k], k == "exclusiveMinimum") for k in ("minimum", "exclusiveMinimum") if k in bounds]
        highs = [(bounds[k], k == "exclusiveMaximum") for k in ("maximum", "exclusiveMaximum") if k in bounds]
        lo, strict_lo = max(lows, key=lambda b: (b[0], b[1])) if lows else (None, False)
        hi, strict_hi = min(highs, key=lambda b: (b[0], not b[1])) if highs else (None, False)
        try:
            return number_range_regex(lo, hi, strict_lo, strict_hi)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def string(self, s: dict, where: str) -> str:
        if "pattern" in s or "format" in s:
            if {"minLength", "maxLength"} & set(s) or ("pattern" in s and "format" in s):
                raise ValueError(f"{where}: 'pattern' / 'format' with a length or with each other is not taken")
            if "format" in s:
                if s["format"] not in _FORMATS:
                    raise ValueError(f"{where}.format: {s['format']!r} not taken (one of {sorted(_FORMATS)})")
                return f'"{_FORMATS[s["format"]]}"'
            pattern = s["pattern"]
            if not isinstance(pattern, str):
                raise ValueError(f"{where}.pattern: expected a string")
            return '"(?:' + pattern.removeprefix("^").removesuffix("$") + ')"'
        lo, hi = _count(s, "minLength", 0, where), _count(s, "maxLength", None, where)
        if lo == 0 and hi is None:
            return STRING
        if hi is not None and hi < lo:
            raise ValueError(f"{where}: maxLength {hi} below minLength {lo}")
        return f'"{_CHAR}{{{lo},{"" if hi is None else hi}}}"'

    def array(self, s: dict, where: str) -> Optional[str]:
        lo, hi = _count(s, "minItems", 0, where), _count(s, "maxItems", None, where)
        item = self.value(s.get("items", True), f"{where}.items") if s.get("items", True) is not False else None
        if item is None:  # items false, or nested past RECURSION_DEPTH: only the empty array
            if lo > 0:
                if s.get("items", True) is not False:
                    return None
                raise ValueError(f"{where}: minItems {lo} with items false")
            return r"\[\]"
        return r"\[" + _repeat(item, lo, hi, _SEP_ITEM) + r"\]"

    def object(self, s: dict, where: str) -> Optional[str]:
        props = s.get("properties")
        if props is None:
            if s.get("additionalProperties", True) not in (True, {}) or "required" in s:
                raise ValueError(f"{where}: an object without 'properties' takes no 'required' or "
                                 "'additionalProperties' schema")
            return any_object_regex(MAX_DEPTH)
        if not isinstance(props, dict):
            raise ValueError(f"{where}.properties: expected an object")
        required = s.get("required", [])
        if not isinstance(required, list) or set(required) - set(props):
            raise ValueError(f"{where}.required: expected names among 'properties' ({sorted(props)})")
        if not props:
            return r"\{\}"
        fields = []
        for k, v in props.items():
            text = self.value(v, f"{where}.properties.{k}")
            if text is None:  # nested past RECURSION_DEPTH: left out where optional, no document where required
                if k in required:
                    return None
                continue
            fields.append((f"{literal(json.dumps(k))}{_SEP_KEY}{text}", k in required))
        if not fields:
            return r"\{\}"
        # the properties in order, each optional one may be absent; a comma before every one but the first present
        alternatives, n = [], len(fields)
        for first in range(n):
            body = fields[first][0]
            for text, req in fields[first + 1:]:
                body += f"(?:{_SEP_ITEM}{text})" + ("" if req else "?")
            alternatives.append(body)
            if fields[first][1]:  # a required property cannot be skipped: no later one starts the object
                break
        else:
            alternatives.append("")  # every property optional: {} too
        return r"\{(?:" + "|".join(alternatives) + r")\}"


def _count(s: dict, key: str, default, where: str):
    x = s.get(key, default)
    if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < 0):
        raise ValueError(f"{where}.{key}: expected a non-negative integer")
    return x


def schema_regex(schema) -> str:
    """A pattern of ``jdspark.grammar``'s subset matching the JSON texts (module doc's layout) ``schema``
    validates; ValueError names a keyword or form not taken."""
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"a JSON Schema is an object, got {type(schema).__name__}")
    pattern = _Compiler(schema if isinstance(schema, dict) else {}).value(schema, "schema")
    if pattern is None:
        raise ValueError(f"no document nested at most {RECURSION_DEPTH} deep in its recursive $refs validates "
                         "under the schema")
    return pattern


def _one_of(patterns: list) -> Optional[str]:
    """Any one of the patterns (None among them: an empty language, left out; all None: None)."""
    return _either([p for p in patterns if p is not None])
