"""Tokenizers behind one interface: ``load_tokenizer(dir)`` reads what a checkpoint ships.

Three formats, tried in this order:
  * ``tiktoken.model`` + ``tokenizer_config.json`` (Kimi K2/K3, Kimi-Linear): BPE ranks (one ``base64 rank`` line
    each) encoded by ``tiktoken`` with Kimi's pre-tokenizer pattern (``KIMI_PAT_STR``: Han runs split from other
    letters); special tokens and their ids from ``added_tokens_decoder``; the ``num_reserved_special_tokens`` ids
    after the ranks that the config leaves unnamed are ``<|reserved_token_{id}|>``.
  * ``tokenizer.json`` (Hugging Face ``tokenizers``), special ids from its ``added_tokens``.
  * neither: the byte vocabulary (``ByteTokenizer``: ids 0..255 are bytes, then ``<bos> <eos> <mask> <pad>``).

Every tokenizer maps an id to the bytes it stands for (``token_bytes``), so decoding is done on bytes in one place:
``decode`` joins them (invalid UTF-8 -> U+FFFD, special ids dropped unless asked for), and ``IncrementalDecoder``
(``tokenizer.incremental_decoder()``) emits text as tokens arrive and holds back bytes that do not yet form a
character, so a stream never shows a broken character. The chat template (``chat_template`` in
``tokenizer_config.json``) is rendered with jinja2 the way transformers renders it (sandboxed, ``trim_blocks``,
``lstrip_blocks``, ``raise_exception``, ``tojson`` with its options, ``strftime_now``, ``break`` / ``continue``,
``generation`` blocks); a checkpoint without one gets ``PLAIN_CHAT_TEMPLATE``.
"""

from __future__ import annotations

import base64
import bisect
import codecs
import datetime
import functools
import json
import os
from pathlib import Path
from typing import Mapping, NamedTuple, Optional, Sequence

import jinja2.ext
import jinja2.nodes
import numpy as np
import tiktoken
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RustTokenizer

from kimi.jsonfile import read_json_object

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "TiktokenTokenizer", "IncrementalDecoder",
           "load_tokenizer", "KIMI_PAT_STR", "PLAIN_CHAT_TEMPLATE", "SPECIAL_NAMES", "gpt2_byte_decoder"]

# Kimi's pre-tokenizer: Han runs first, letters with Han subtracted, digits in threes, punctuation, newlines, space.
KIMI_PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

# The role names the model's special ids are looked up by (first match wins), for checkpoints of any origin.
SPECIAL_NAMES = {
    "bos": ("<bos>", "[BOS]", "<|begin_of_text|>", "<s>"),
    "eos": ("<eos>", "[EOS]", "<|im_end|>", "<|end_of_text|>", "</s>"),
    "pad": ("<pad>", "[PAD]", "<|pad|>"),
    "mask": ("<mask>", "<|MASK|>", "[MASK]"),
}

# A documented fallback for checkpoints without a template (and the shipped default pair's template): one
# "<|im_ROLE|>ROLE<|im_middle|>TEXT<|im_end|>" per message (Kimi's layout); with add_generation_prompt, an open
# assistant turn. With ``tools``, Kimi K2's layout for them: declared first as JSON in a "tool_declare" system turn,
# an assistant's calls written back as its tool-call section, a tool's result headed "## Return of <call id>"
# (the markers are jdspark.tool_calls'); a conversation without them renders as without this part.
PLAIN_CHAT_TEMPLATE = (
    "{% if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>"
    "{% endif %}"
    "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>"
    "{% if m['role'] == 'tool' and 'tool_call_id' in m %}## Return of {{ m['tool_call_id'] }}\n{% endif %}"
    "{{ m['content'] or '' }}"
    "{% if 'tool_calls' in m and m['tool_calls'] %}<|tool_calls_section_begin|>{% for c in m['tool_calls'] %}"
    "<|tool_call_begin|>{{ c['id'] }}<|tool_call_argument_begin|>{{ c['function']['arguments'] }}<|tool_call_end|>"
    "{% endfor %}<|tool_calls_section_end|>{% endif %}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)


@functools.lru_cache(maxsize=1)
def gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte -> printable-character table (the ByteLevel pre-tokenizer's alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return {c: b for b, c in chars.items()}


class IncrementalDecoder:
    """Text from a stream of ids: ``add(ids)`` returns the text that is complete so far; bytes of a character not
    yet finished are held back (never emitted as U+FFFD) until a later id completes it or ``flush()``.

    ``skip_prefix``: text the stream begins with that its reader already has, left out of what is returned (a
    healed prompt's last token, ``Tokenizer.heal``: the first generated token begins with its text), however the
    ids split it."""

    def __init__(self, tokenizer: "Tokenizer", *, skip_special: bool = True, keep_special=frozenset(),
                 skip_prefix: str = ""):
        self._tok = tokenizer
        self._skip, self._keep = skip_special, frozenset(keep_special)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._drop = len(skip_prefix)  # characters of the prefix not yet left out

    def _after_prefix(self, text: str) -> str:
        cut = min(self._drop, len(text))
        self._drop -= cut
        return text[cut:]

    def add(self, ids) -> str:
        return self._after_prefix(self._utf8.decode(
            self._tok.decode_bytes(ids, skip_special=self._skip, keep_special=self._keep), final=False))

    def flush(self) -> str:
        return self._after_prefix(self._utf8.decode(b"", final=True))


class Healing(NamedTuple):
    """``Tokenizer.heal``'s result: the prompt's ids without their last token, that token's text (which the
    completion's text begins with: a reader shows the completion after it), and the ids the first generated token
    may be (those whose bytes begin with the text)."""
    ids: list
    text: str
    first_ids: tuple


class Tokenizer:
    """The interface: ids <-> text, special ids by role, the chat template. Subclasses fill ``_token_bytes``
    (bytes of every ordinary id), ``special_tokens`` (name -> id) and implement ``_encode_ordinary``."""

    kind = "base"

    def __init__(self, token_bytes: Sequence[Optional[bytes]], special_tokens: Mapping[str, int], *,
                 vocab_size: Optional[int] = None, chat_template: Optional[str] = None,
                 roles: Optional[Mapping[str, Optional[int]]] = None):
        self._token_bytes = list(token_bytes)
        self.special_tokens = dict(special_tokens)
        self.special_ids = frozenset(self.special_tokens.values())
        self._special_bytes = {i: n.encode("utf-8") for n, i in self.special_tokens.items()}
        self._by_bytes: Optional[tuple] = None  # Tokenizer.heal's index: the ordinary ids sorted by their bytes
        n = max([len(self._token_bytes) - 1, *self.special_ids, -1]) + 1
        self.vocab_size = int(vocab_size if vocab_size is not None else n)
        if self.vocab_size < n:
            raise ValueError(f"vocab_size: {self.vocab_size} is smaller than the largest id + 1 ({n})")
        self.chat_template = chat_template
        found = {role: next((self.special_tokens[s] for s in names if s in self.special_tokens), None)
                 for role, names in SPECIAL_NAMES.items()}
        found.update(roles or {})
        self.bos_id, self.eos_id = found["bos"], found["eos"]
        self.pad_id, self.mask_id = found["pad"], found["mask"]

    # -------------------------------------------------------------- encode
    def _encode_ordinary(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode(self, text: str, *, bos: bool = False, eos: bool = False, allow_special: bool = False) -> list[int]:
        """Ids of ``text``; special-token strings in it are encoded as text unless ``allow_special``."""
        if not isinstance(text, str):
            raise ValueError(f"encode: expected str, got {type(text).__name__}")
        ids = self._encode_with_specials(text) if allow_special else self._encode_ordinary(text)
        return ([self._need("bos")] if bos else []) + ids + ([self._need("eos")] if eos else [])

    def _encode_with_specials(self, text: str) -> list[int]:
        out, i = [], 0
        names = sorted(self.special_tokens, key=len, reverse=True)
        while i < len(text):
            hits = [(text.find(n, i), n) for n in names]
            hits = [(p, n) for p, n in hits if p >= 0]
            if not hits:
                out += self._encode_ordinary(text[i:])
                break
            p, n = min(hits, key=lambda h: (h[0], -len(h[1])))
            out += self._encode_ordinary(text[i:p]) if p > i else []
            out.append(self.special_tokens[n])
            i = p + len(n)
        return out

    def _need(self, role: str) -> int:
        i = getattr(self, f"{role}_id")
        if i is None:
            raise ValueError(f"this tokenizer has no {role} token (looked for {SPECIAL_NAMES[role]})")
        return i

    # -------------------------------------------------------------- decode
    def check_ids(self, ids) -> np.ndarray:
        """``ids`` as a flat int array, or a ValueError naming the ids outside ``[0, vocab_size)``."""
        arr = np.asarray(ids).reshape(-1)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"token ids: expected integers, got dtype {arr.dtype}")
        bad = arr[(arr < 0) | (arr >= self.vocab_size)]
        if bad.size:
            raise ValueError(f"token ids {bad[:8].tolist()} outside the vocabulary [0, {self.vocab_size})")
        return arr

    def token_bytes(self, i: int) -> bytes:
        """The bytes id ``i`` stands for (a special token's name; b'' for an id that stands for nothing)."""
        if i in self._special_bytes:
            return self._special_bytes[i]
        b = self._token_bytes[i] if i < len(self._token_bytes) else None
        return b or b""

    def decode_bytes(self, ids, *, skip_special: bool = True, keep_special=frozenset()) -> bytes:
        """The bytes of ``ids``; with ``skip_special`` special tokens are left out, but for those in
        ``keep_special`` (ids whose names a reader of the text needs: a tool-call format's markers)."""
        arr = self.check_ids(ids)
        return b"".join(self.token_bytes(int(i)) for i in arr
                        if not (skip_special and int(i) in self.special_ids and int(i) not in keep_special))

    def decode(self, ids, *, skip_special: bool = True, keep_special=frozenset()) -> str:
        return self.decode_bytes(ids, skip_special=skip_special, keep_special=keep_special).decode(
            "utf-8", errors="replace")

    # -------------------------------------------------------------- token healing
    def heal(self, ids) -> Optional["Healing"]:
        """Token healing (as guidance does it) of a prompt's ids: a prompt cut at a point where its text goes on
        inside one token in the training text (code ending in ``"\n"``, whose indentation BPE merges into the
        newline's token; a word's first letters) ends on a token the model rarely saw there. The last token is
        taken off and the first generated token must begin with its bytes. None when the prompt ends on a special
        id, on bytes that are not whole UTF-8 characters alone, or has nothing before its last token."""
        arr = self.check_ids(ids)
        if arr.size < 2 or int(arr[-1]) in self.special_ids:
            return None
        tail = self.token_bytes(int(arr[-1]))
        try:
            text = tail.decode("utf-8")
        except UnicodeDecodeError:
            return None
        return Healing(arr[:-1].tolist(), text, self._extending(tail)) if tail else None

    def heal_index(self) -> tuple:
        """``heal``'s index, built on first use (a K3-sized vocabulary: ~0.4 s; a server builds it at start-up,
        not in its first healed request): (the ordinary ids' bytes sorted, their ids in that order)."""
        if self._by_bytes is None:
            pairs = sorted((b, i) for i, b in enumerate(self._token_bytes) if b and i not in self.special_ids)
            self._by_bytes = ([b for b, _ in pairs], [i for _, i in pairs])
        return self._by_bytes

    def _extending(self, prefix: bytes) -> tuple:
        """The ordinary ids whose bytes begin with ``prefix`` (it among them), in id order: in the vocabulary sorted
        by bytes (``heal_index``) they are one run, found by bisection, O(log V + its length). (A pass over a
        K3-sized vocabulary of 160K ids took ~30 ms a prompt, in the server's request threads.)"""
        keys, ids = self.heal_index()
        lo = hi = bisect.bisect_left(keys, prefix)
        while hi < len(keys) and keys[hi].startswith(prefix):
            hi += 1
        return tuple(sorted(ids[lo:hi]))

    def incremental_decoder(self, *, skip_special: bool = True, keep_special=frozenset(),
                            skip_prefix: str = "") -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special=skip_special, keep_special=keep_special, skip_prefix=skip_prefix)

    # -------------------------------------------------------------- chat
    def apply_chat_template(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = True,
                            **extra) -> str:
        """The prompt text of ``messages`` (list of {"role", "content"}), rendered as transformers renders it."""
        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols, _GenerationTag])
        env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
            json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        names = {f"{r}_token": (None if getattr(self, f"{r}_id") is None else
                                self.token_bytes(getattr(self, f"{r}_id")).decode("utf-8"))
                 for r in ("bos", "eos", "pad")}
        template = env.from_string(self.chat_template or PLAIN_CHAT_TEMPLATE)
        return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                               **names, **extra)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers marks the assistant's tokens with it for training
    masks): rendered as its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, then ``<bos> <eos> <mask> <pad>`` (256..259); the vocabulary padded to 384."""

    kind = "bytes"

    def __init__(self, vocab_size: int = 384, chat_template: Optional[str] = None):
        specials = {"<bos>": 256, "<eos>": 257, "<mask>": 258, "<pad>": 259}
        super().__init__([bytes([b]) for b in range(256)], specials, vocab_size=vocab_size,
                         chat_template=chat_template)

    def _encode_ordinary(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class HFTokenizer(Tokenizer):
    """A ``tokenizer.json`` (Hugging Face ``tokenizers``); byte-level vocabularies decode through GPT-2's
    byte table, others through the library's own per-token decoding."""

    kind = "tokenizer.json"

    def __init__(self, path: os.PathLike | str, *, chat_template: Optional[str] = None,
                 vocab_size: Optional[int] = None, roles: Optional[Mapping[str, Optional[int]]] = None):
        self.path = Path(path)
        spec = read_json_object(self.path)  # first: a broken file is said naming it
        self._tk = RustTokenizer.from_file(str(self.path))
        specials = {t["content"]: int(t["id"]) for t in spec.get("added_tokens", []) if t.get("special", True)}
        vocab = self._tk.get_vocab(with_added_tokens=False)
        byte_level = "ByteLevel" in json.dumps(spec.get("decoder") or {})
        table: list[Optional[bytes]] = [None] * (max(vocab.values(), default=-1) + 1)
        dec = gpt2_byte_decoder()
        for piece, i in vocab.items():
            if byte_level:
                table[i] = bytes(dec[c] for c in piece)
            else:
                table[i] = self._tk.decode([i], skip_special_tokens=False).encode("utf-8")
        super().__init__(table, specials, vocab_size=vocab_size, chat_template=chat_template, roles=roles)

    def _encode_ordinary(self, text: str) -> list[int]:
        return self._tk.encode(text, add_special_tokens=False).ids


class TiktokenTokenizer(Tokenizer):
    """Kimi's format: ``tiktoken.model`` ranks + the special ids of ``tokenizer_config.json``."""

    kind = "tiktoken"

    def __init__(self, model_file: os.PathLike | str, special_tokens: Mapping[str, int], *,
                 num_reserved_special_tokens: int = 256, pat_str: str = KIMI_PAT_STR,
                 chat_template: Optional[str] = None, vocab_size: Optional[int] = None,
                 roles: Optional[Mapping[str, Optional[int]]] = None):
        ranks = read_tiktoken_ranks(model_file)
        n = len(ranks)
        specials = dict(special_tokens)
        named = set(specials.values())
        for i in range(n, n + int(num_reserved_special_tokens)):
            if i not in named:
                specials[f"<|reserved_token_{i}|>"] = i
        for name, i in specials.items():
            if i < n:
                raise ValueError(f"special token {name!r}: id {i} collides with the BPE ranks [0, {n})")
        self.encoding = tiktoken.Encoding(name=Path(model_file).stem, pat_str=pat_str, mergeable_ranks=ranks,
                                          special_tokens=specials)
        table: list[Optional[bytes]] = [None] * n
        for b, r in ranks.items():
            table[r] = b
        super().__init__(table, specials, vocab_size=vocab_size, chat_template=chat_template, roles=roles)

    def _encode_ordinary(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)


def read_tiktoken_ranks(path: os.PathLike | str) -> dict[bytes, int]:
    """``tiktoken.model``: one ``base64(token bytes) rank`` per line; ranks must be 0..n-1, each once."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for ln, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{ln}: expected 'base64 rank', got {line[:60]!r}")
            ranks[base64.b64decode(parts[0])] = int(parts[1])
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not 0..{len(ranks) - 1}, each once")
    return ranks


def _read_tokenizer_config(d: Path) -> dict:
    p = d / "tokenizer_config.json"
    return read_json_object(p) if p.is_file() else {}


def _roles_from_config(cfg: dict, specials: Mapping[str, int]) -> dict[str, Optional[int]]:
    roles = {}
    for role in ("bos", "eos", "pad"):
        name = cfg.get(f"{role}_token")
        if isinstance(name, dict):
            name = name.get("content")
        if isinstance(name, str) and name in specials:
            roles[role] = specials[name]
    return roles


def load_tokenizer(path: os.PathLike | str, *, vocab_size: Optional[int] = None) -> Tokenizer:
    """The tokenizer a checkpoint directory ships: tiktoken.model, tokenizer.json, or (neither) bytes.

    ``vocab_size``: the model's embedding rows (ids past the tokenizer's own are valid but stand for nothing)."""
    d = Path(path)
    if not d.is_dir():
        raise ValueError(f"load_tokenizer: {str(path)!r} is not a directory")
    cfg = _read_tokenizer_config(d)
    template = cfg.get("chat_template")
    if isinstance(template, list):  # transformers' list of named templates
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    if (d / "tiktoken.model").is_file():
        specials = {}
        for i, t in (cfg.get("added_tokens_decoder") or {}).items():
            specials[t["content"] if isinstance(t, dict) else str(t)] = int(i)
        return TiktokenTokenizer(d / "tiktoken.model", specials, chat_template=template, vocab_size=vocab_size,
                                 num_reserved_special_tokens=int(cfg.get("num_reserved_special_tokens", 256)),
                                 roles=_roles_from_config(cfg, specials))
    if (d / "tokenizer.json").is_file():
        spec = read_json_object(d / "tokenizer.json")
        specials = {t["content"]: int(t["id"]) for t in spec.get("added_tokens", [])}
        return HFTokenizer(d / "tokenizer.json", chat_template=template, vocab_size=vocab_size,
                           roles=_roles_from_config(cfg, specials))
    return ByteTokenizer(vocab_size=vocab_size or 384, chat_template=template)
