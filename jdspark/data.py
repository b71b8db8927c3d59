"""Training data: a byte-level tokenizer, a text corpus split by file, and a packed, shuffled, resumable iterator.

Tokenizer
---------
ids 0..255 are the UTF-8 bytes; then the specials ``BOS_ID = 256``, ``EOS_ID = 257``, ``MASK_ID = 258`` (the
drafter's mask token) and ``PAD_ID = 259``; the vocabulary is padded to a multiple of 128: ``VOCAB_SIZE = 384``
(ids 260..383 are never produced). These agree with ``KimiConfig.demo()``.

Corpus
------
By default the Python standard library source of the running interpreter (``sysconfig.get_paths()["stdlib"]``):
its ``.py`` files outside ``test/``, ``tests/``, ``idlelib/``, ``site-packages/`` and ``__pycache__/``. ``corpus=DIR``
takes every text file under any directory instead (hidden entries, files with a NUL byte in their first 8 KiB and
empty files are skipped). The split is **by file**: a file's relative path (``/``-separated) is hashed (SHA-1) and
about ``VAL_FRACTION`` of the files are validation files, wherever the corpus lies and whatever else it holds.
Validation files are never trained on.

Packed iterator
---------------
A document is ``BOS + bytes + EOS``. Epoch ``e`` shuffles the training documents with a generator seeded by
``(seed, e)``, concatenates them into one stream, cuts the stream into windows of ``seq_len + 1`` tokens (the
tail is dropped) and shuffles the windows, again from ``(seed, e)``. Batch ``step`` is the windows
``[step * batch, (step + 1) * batch)`` of the sequence of epochs. Everything is a function of
``(corpus, seed, batch, seq_len, step)``: a run resumed at ``step`` sees exactly the batches it would have seen.
Each batch carries per-position document ids (0 for the first document of a row, counting up), so a loss or an
attention mask can tell where documents start.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

# ---------------------------------------------------------------------------------------------------------------
# tokenizer
NUM_BYTES = 256
BOS_ID = 256
EOS_ID = 257
MASK_ID = 258
PAD_ID = 259
NUM_SPECIALS = 4
VOCAB_SIZE = 384  # 260 rounded up to a multiple of 128
SPECIAL_TOKENS = {"<bos>": BOS_ID, "<eos>": EOS_ID, "<mask>": MASK_ID, "<pad>": PAD_ID}

VAL_FRACTION = 0.02
_HASH_BUCKETS = 10_000
_STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})

__all__ = [
    "BOS_ID", "EOS_ID", "MASK_ID", "PAD_ID", "VOCAB_SIZE", "SPECIAL_TOKENS", "VAL_FRACTION",
    "encode", "decode", "encode_document", "byte_lengths", "stdlib_dir", "list_files", "split_of", "read_documents",
    "Batch", "PackedDataset", "batch_at", "iterate_batches", "validation_batches", "heldout_prompts",
]


def encode(text: str, *, bos: bool = False, eos: bool = False) -> np.ndarray:
    """UTF-8 bytes of ``text`` as int32 ids (optionally framed by BOS / EOS)."""
    if not isinstance(text, str):
        raise ValueError(f"encode: expected str, got {type(text).__name__}")
    ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
    if bos or eos:
        ids = np.concatenate([[BOS_ID] if bos else [], ids, [EOS_ID] if eos else []]).astype(np.int32)
    return ids


def encode_document(data: bytes, tokenizer=None) -> np.ndarray:
    """``BOS + tokens + EOS`` as uint16 ids (the packed stream's storage type): bytes as ids without a
    ``tokenizer`` (a ``kimi.tokenizer.Tokenizer``), else its ids of the UTF-8 text (invalid bytes -> U+FFFD)."""
    if tokenizer is None:
        out = np.empty(len(data) + 2, np.uint16)
        out[0] = BOS_ID
        out[1:-1] = np.frombuffer(data, dtype=np.uint8)
        out[-1] = EOS_ID
        return out
    if tokenizer.vocab_size > 1 << 16:
        raise ValueError(f"tokenizer: {tokenizer.vocab_size} ids do not fit the uint16 packed stream")
    ids = tokenizer.encode(data.decode("utf-8", errors="replace"), bos=True, eos=True)
    return np.asarray(ids, np.uint16)


def byte_lengths(tokenizer=None, vocab_size: int | None = None) -> np.ndarray:
    """[V] int32: the bytes each id stands for, special ids counted as 1 (as the byte vocabulary's EOS is), so
    a loss summed over tokens divided by these lengths is per byte for any vocabulary."""
    if tokenizer is None:
        return np.ones(vocab_size or VOCAB_SIZE, np.int32)
    n = vocab_size or tokenizer.vocab_size
    out = np.ones(n, np.int32)
    for i in range(min(n, tokenizer.vocab_size)):
        if i not in tokenizer.special_ids:
            out[i] = max(len(tokenizer.token_bytes(i)), 1)
    return out


def decode(ids) -> str:
    """Token ids -> text: special and padding ids (>= 256) are dropped, invalid UTF-8 becomes U+FFFD."""
    arr = np.asarray(ids).reshape(-1)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"decode: expected integer ids, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= VOCAB_SIZE):
        bad = arr[(arr < 0) | (arr >= VOCAB_SIZE)]
        raise ValueError(f"decode: ids {bad[:8].tolist()} outside the vocabulary [0, {VOCAB_SIZE})")
    return arr[arr < NUM_BYTES].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------------------------
# corpus and split
def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_text_file(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(8192)
    except OSError:
        return False
    return bool(head) and b"\x00" not in head


def split_of(rel_path: str, val_fraction: float = VAL_FRACTION) -> str:
    """'train' or 'val' for a corpus-relative path (``/``-separated), by a hash of the path."""
    h = int.from_bytes(hashlib.sha1(rel_path.encode("utf-8")).digest()[:8], "big") % _HASH_BUCKETS
    return "val" if h < round(val_fraction * _HASH_BUCKETS) else "train"


def _resolve_corpus(corpus) -> tuple[Path, bool]:
    if corpus is None:
        return stdlib_dir(), True
    root = Path(corpus).expanduser()
    if not root.is_dir():
        raise ValueError(f"corpus: {str(corpus)!r} is not a directory")
    return root.resolve(), False


def list_files(corpus: Optional[os.PathLike | str] = None, split: str = "train",
               val_fraction: float = VAL_FRACTION) -> list[Path]:
    """The files of one split ('train', 'val' or 'all'), sorted by relative path.

    ``corpus=None`` is the interpreter's standard library (non-test ``.py`` files); a directory takes every text
    file under it.
    """
    if split not in ("train", "val", "all"):
        raise ValueError(f"split: expected 'train', 'val' or 'all', got {split!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction: expected 0 <= f < 1, got {val_fraction}")
    root, is_stdlib = _resolve_corpus(corpus)
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith(".") and not (is_stdlib and x in _STDLIB_SKIP_DIRS)
                         and x != "__pycache__")
        for name in sorted(files):
            if name.startswith("."):
                continue
            p = Path(d) / name
            if is_stdlib:
                if not name.endswith(".py") or not p.is_file():
                    continue
            elif not p.is_file() or not _is_text_file(p):
                continue
            rel = p.relative_to(root).as_posix()
            if split == "all" or split_of(rel, val_fraction) == split:
                out.append((rel, p))
    out.sort()
    if not out:
        raise ValueError(f"corpus {str(root)!r}: no {'' if split == 'all' else split + ' '}files found")
    return [p for _, p in out]


def read_documents(files: Sequence[Path]) -> list[bytes]:
    """File contents as bytes (empty files dropped)."""
    docs = []
    for p in files:
        data = Path(p).read_bytes()
        if data:
            docs.append(data)
    return docs


# ---------------------------------------------------------------------------------------------------------------
# packed iterator
@dataclasses.dataclass
class Batch:
    tokens: np.ndarray  # [B, seq_len + 1] int32: inputs are tokens[:, :-1], targets tokens[:, 1:]
    doc_ids: np.ndarray  # [B, seq_len + 1] int32: 0 for the row's first document, then 1, 2, ...
    step: int


def _rng(seed: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, *[int(k) for k in keys]]))


class PackedDataset:
    """Packed, shuffled windows over a list of documents; ``batch(step)`` is a pure function of the step."""

    def __init__(self, docs: Sequence[bytes], *, batch: int, seq_len: int, seed: int = 0, shuffle: bool = True,
                 tokenizer=None):
        if batch <= 0:
            raise ValueError(f"batch: expected a positive int, got {batch}")
        if seq_len <= 0:
            raise ValueError(f"seq_len: expected a positive int, got {seq_len}")
        self.docs = [encode_document(d, tokenizer) for d in docs]
        if not self.docs:
            raise ValueError("PackedDataset: no documents")
        self.batch, self.seq_len, self.seed, self.shuffle = int(batch), int(seq_len), int(seed), bool(shuffle)
        self.window = self.seq_len + 1
        self.num_tokens = int(sum(len(d) for d in self.docs))
        self.windows_per_epoch = self.num_tokens // self.window
        if self.windows_per_epoch < 1:
            raise ValueError(f"corpus of {self.num_tokens} tokens is shorter than one window of {self.window}")
        self._epoch = None  # (epoch, stream uint16, doc_starts int64, window order int64)

    def _load_epoch(self, epoch: int):
        if self._epoch is not None and self._epoch[0] == epoch:
            return self._epoch
        if self.shuffle:
            rng = _rng(self.seed, epoch, 0)
            order = rng.permutation(len(self.docs))
        else:
            order = np.arange(len(self.docs))
        parts = [self.docs[i] for i in order]
        stream = np.concatenate(parts)
        starts = np.cumsum([0] + [len(p) for p in parts[:-1]]).astype(np.int64)
        n = self.windows_per_epoch
        win = _rng(self.seed, epoch, 1).permutation(n) if self.shuffle else np.arange(n)
        self._epoch = (epoch, stream, starts, win)
        return self._epoch

    def window_at(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``index``-th window of the epoch sequence: (tokens [seq_len+1] int32, doc_ids [seq_len+1] int32)."""
        epoch, j = divmod(int(index), self.windows_per_epoch)
        _, stream, starts, win = self._load_epoch(epoch)
        a = int(win[j]) * self.window
        toks = stream[a:a + self.window].astype(np.int32)
        doc = np.searchsorted(starts, np.arange(a, a + self.window), side="right") - 1
        return toks, (doc - doc[0]).astype(np.int32)

    def batch_at(self, step: int) -> Batch:
        if step < 0:
            raise ValueError(f"step: expected >= 0, got {step}")
        toks, docs = zip(*(self.window_at(step * self.batch + r) for r in range(self.batch)))
        return Batch(np.stack(toks), np.stack(docs), int(step))

    def __iter__(self) -> Iterator[Batch]:
        return self.iterate(0)

    def iterate(self, start_step: int = 0, num_steps: Optional[int] = None) -> Iterator[Batch]:
        step = int(start_step)
        while num_steps is None or step < start_step + num_steps:
            yield self.batch_at(step)
            step += 1

    @property
    def steps_per_epoch(self) -> float:
        return self.windows_per_epoch / self.batch


def _train_dataset(corpus, batch, seq_len, seed, val_fraction=VAL_FRACTION) -> PackedDataset:
    return PackedDataset(read_documents(list_files(corpus, "train", val_fraction)), batch=batch, seq_len=seq_len,
                         seed=seed)


def batch_at(step: int, *, batch: int, seq_len: int, seed: int = 0, corpus=None) -> Batch:
    """One training batch, a pure function of its arguments (builds the dataset: use PackedDataset in loops)."""
    return _train_dataset(corpus, batch, seq_len, seed).batch_at(step)


def iterate_batches(*, batch: int, seq_len: int, seed: int = 0, corpus=None, start_step: int = 0,
                    num_steps: Optional[int] = None) -> Iterator[Batch]:
    """Training batches from ``start_step`` on (resumable: the same batches as an iterator started at 0)."""
    return _train_dataset(corpus, batch, seq_len, seed).iterate(start_step, num_steps)


def validation_batches(*, batch: int, seq_len: int, num_batches: Optional[int] = None, corpus=None,
                       seed: int = 1234, tokenizer=None) -> list[Batch]:
    """A fixed list of packed batches from the validation files (documents in a seeded order, windows in
    stream order, never repeated); ``num_batches=None`` takes all full batches."""
    ds = PackedDataset(read_documents(list_files(corpus, "val")), batch=batch, seq_len=seq_len, seed=seed,
                       shuffle=False, tokenizer=tokenizer)
    # one fixed, seeded document order, then windows in order: every validation window at most once
    order = _rng(seed, 7).permutation(len(ds.docs))
    ds.docs = [ds.docs[i] for i in order]
    total = ds.windows_per_epoch // batch
    if total == 0:
        raise ValueError(f"validation split holds {ds.windows_per_epoch} windows of {seq_len + 1}, fewer than one "
                         f"batch of {batch}")
    n = total if num_batches is None else min(int(num_batches), total)
    return [ds.batch_at(s) for s in range(n)]


# ---------------------------------------------------------------------------------------------------------------
# held-out prompts

def heldout_prompts(n: int, prompt_len: int, *, corpus=None, seed: int = 0, bos: bool = True,
                    min_continuation: int = 256, tokenizer=None) -> list[np.ndarray]:
    """``n`` prompts of exactly ``prompt_len`` token ids cut from the validation files (never trained on) of the
    stdlib corpus (or of ``corpus=DIR``): the code workload's prompts; ``jdspark.workloads`` has the others. See
    ``prompts_from_documents``."""
    return prompts_from_documents(read_documents(list_files(corpus, "val")), n, prompt_len, seed=seed, bos=bos,
                                  min_continuation=min_continuation, tokenizer=tokenizer)


def prompts_from_documents(docs: Sequence[bytes], n: int, prompt_len: int, *, seed: int = 0, bos: bool = True,
                           min_continuation: int = 256, tokenizer=None, continuations: bool = False):
    """``n`` prompts of exactly ``prompt_len`` token ids cut from ``docs`` at line starts.

    Each prompt is ``[BOS] + ids`` when ``bos`` (else ids only): the bytes themselves without a ``tokenizer``,
    else the tokenizer's ids of the text from that line start (its first ``prompt_len - 1`` tokens). It starts at
    the beginning of a line, not in leading blank space, and at least ``min_continuation`` bytes of the document
    follow it. Documents are visited round-robin in a seeded order, so prompts come from as many different
    documents as possible. ``continuations=True`` returns ``(ids, continuation bytes)`` pairs: the rest of the
    document after the prompt's bytes (the real text a generation can be compared with).
    """
    if n <= 0 or prompt_len <= (1 if bos else 0):
        raise ValueError(f"prompts: need n > 0 and prompt_len > {1 if bos else 0}, got {n}, {prompt_len}")
    body = prompt_len - 1 if bos else prompt_len
    bos_id = BOS_ID if tokenizer is None else tokenizer.bos_id
    rng = _rng(seed, 11)
    cands = []  # per file: shuffled usable line starts (enough bytes for a prompt of one byte per token)
    for d in docs:
        if tokenizer is not None and not _is_utf8(d):
            continue
        arr = np.frombuffer(d, np.uint8)
        starts = np.concatenate([[0], np.flatnonzero(arr == ord("\n")) + 1])
        ok = starts[(starts + body + min_continuation <= len(d))]
        ok = np.array([s for s in ok if d[s:s + 1] not in (b"\n", b" ", b"\t", b"\r")], np.int64)
        if ok.size:
            cands.append((d, rng.permutation(ok)))
    if not cands:
        raise ValueError(f"no document is long enough for prompts of {prompt_len} tokens")
    order = rng.permutation(len(cands))
    out, r = [], 0
    while len(out) < n:
        progressed = False
        for fi in order:
            d, starts = cands[fi]
            if r < len(starts):
                progressed = True
                cut = _cut_prompt(d, int(starts[r]), body, min_continuation, tokenizer)
                if cut is None:
                    continue
                ids, end = cut
                ids = np.concatenate([[bos_id], ids]).astype(np.int32) if bos else ids
                out.append((ids, d[end:]) if continuations else ids)
                if len(out) == n:
                    break
        if not progressed:
            raise ValueError(f"only {len(out)} distinct prompts of {prompt_len} tokens in the documents")
        r += 1
    return out


def _is_utf8(d: bytes) -> bool:
    try:
        d.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _cut_prompt(d: bytes, s: int, body: int, min_continuation: int, tokenizer):
    """(``body`` ids from byte ``s`` of ``d``, the byte offset where they end), or None when fewer than
    ``min_continuation`` bytes would follow."""
    if tokenizer is None:
        return np.frombuffer(d[s:s + body], np.uint8).astype(np.int32), s + body
    window = d[s:s + 16 * body + 64]
    while window and not _is_utf8(window):  # the window's end cut a character
        window = window[:-1]
    ids = tokenizer.encode(window.decode("utf-8"))[:body]
    end = s + sum(len(tokenizer.token_bytes(i)) for i in ids)
    if len(ids) < body or end + min_continuation > len(d):
        return None
    return np.asarray(ids, np.int32), end
