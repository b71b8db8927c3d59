"""The one safetensors layer the target's and the drafter's checkpoint I/O share: finding a checkpoint's files,
reading them with every header checked, writing them one tensor at a time, and replacing a directory atomically.

  files, weight_map = checkpoint_files(path)        # index (+ shards), or model.safetensors, or *.safetensors
  f = SafetensorsFile(files[0])                     # header parsed and checked; ValueError naming the file
  f.tensors["fc.weight"]                            # TensorInfo(dtype="F32", shape=(64, 192), begin=...)
  f.read("fc.weight")                               # np.ndarray (a memory map for BF16 / FP8)
  write_safetensors(fname, [TensorRecord(name, shape, "F32")], fetch)   # fetch(record) -> the array
  with atomic_directory(out_dir) as tmp: ...        # write into tmp; it replaces out_dir if the block succeeds
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import struct
import tempfile
from typing import Callable, Iterable, Optional

import ml_dtypes
import numpy as np
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors dtype names <-> NumPy dtypes (ml_dtypes for the ones NumPy lacks)
ST_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
NP_TO_ST = {v: k for k, v in ST_DTYPES.items()}
_NUMPY_NATIVE = {"F64", "F32", "F16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL"}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors header."""

    dtype: str  # safetensors dtype name ("F32", "BF16", "U8", ...)
    shape: tuple
    begin: int  # byte offset of its data after the header


@dataclasses.dataclass(frozen=True)
class TensorRecord:
    """One tensor to write: its name, shape and safetensors dtype name."""

    name: str
    shape: tuple
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * ST_DTYPES[self.dtype].itemsize


class SafetensorsFile:
    """One safetensors file: header parsed and checked at open (dtype names, byte counts against shapes,
    contiguity, file size: a truncated or corrupt file is a ValueError naming it); tensors read one at a time
    with ``safe_open`` (a memory map for dtypes NumPy does not know, such as BF16)."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as fh:
                head = fh.read(8)
                if len(head) < 8:
                    raise ValueError(f"{size} bytes, shorter than the 8-byte header length")
                (n,) = struct.unpack("<Q", head)
                if n > size - 8:
                    raise ValueError(f"header of {n} bytes but the file has {size} bytes (truncated?)")
                header = json.loads(fh.read(n).decode("utf-8"))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
            self.data_start = 8 + n
            header.pop("__metadata__", None)
            self.tensors: dict[str, TensorInfo] = {}
            spans = []
            for name, info in header.items():
                dt, shape, (b, e) = info["dtype"], tuple(int(x) for x in info["shape"]), info["data_offsets"]
                if dt not in ST_DTYPES:
                    raise ValueError(f"tensor {name!r} has unknown dtype {dt!r}")
                if e - b != int(np.prod(shape, dtype=np.int64)) * ST_DTYPES[dt].itemsize:
                    raise ValueError(f"tensor {name!r}: {e - b} bytes for shape {list(shape)} {dt}")
                self.tensors[name] = TensorInfo(dt, shape, int(b))
                spans.append((b, e))
            end = 0
            for b, e in sorted(spans):
                if b != end:
                    raise ValueError(f"tensor data is not contiguous at byte {b}")
                end = e
            if self.data_start + end != size:
                raise ValueError(f"the header describes {self.data_start + end} bytes but the file has {size} "
                                 "(truncated or trailing data)")
            self._st = safe_open(path, framework="numpy")  # safetensors' own checks as well
        except Exception as exc:  # OSError, JSON, struct, KeyError, SafetensorError ...
            raise ValueError(f"{path}: not a valid safetensors file: {exc}") from None

    def read(self, name: str, index=None) -> np.ndarray:
        """The tensor ``name`` (or ``tensor[index]``) as a host array."""
        info = self.tensors[name]
        try:
            if info.dtype in _NUMPY_NATIVE:
                if index is None:
                    return self._st.get_tensor(name)
                return np.asarray(self._st.get_slice(name)[index])
            mm = np.memmap(self.path, dtype=ST_DTYPES[info.dtype], mode="r", offset=self.data_start + info.begin,
                           shape=info.shape)
            return np.array(mm if index is None else mm[index])
        except Exception as exc:
            raise ValueError(f"{self.path}: reading tensor {name!r} failed: {exc}") from None


def checkpoint_files(path: str, any_safetensors: bool = True) -> tuple[list[str], Optional[dict]]:
    """(files, weight_map) of a checkpoint directory: the shards an index lists (every one must exist), else
    ``model.safetensors``, else (``any_safetensors``) every ``*.safetensors`` file; weight_map is the index's
    {tensor: file} or None. ValueError when there is none."""
    idx = os.path.join(path, INDEX_FILE)
    if os.path.isfile(idx):
        try:
            with open(idx) as f:
                weight_map = json.load(f)["weight_map"]
        except Exception as exc:
            raise ValueError(f"{idx}: not a valid safetensors index: {exc}") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise ValueError(f"{idx}: lists shard files that do not exist: {missing}")
        return [os.path.join(path, f) for f in files], weight_map
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return [single], None
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) if any_safetensors else []
    if not files:
        raise ValueError(f"{path}: no {SINGLE_FILE}, no {INDEX_FILE}"
                         + (" and no *.safetensors files" if any_safetensors else " found"))
    return [os.path.join(path, f) for f in files], None


def write_safetensors(fname: str, records: Iterable[TensorRecord], fetch: Callable[[TensorRecord], np.ndarray],
                      metadata: Optional[dict] = None):
    """Stream ``records`` into ``fname`` in order; ``fetch(record)`` gives each array (of exactly its bytes) only
    when it is written, so the host holds one tensor at a time."""
    records = list(records)
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    off = 0
    for r in records:
        header[r.name] = {"dtype": r.dtype, "shape": list(r.shape), "data_offsets": [off, off + r.nbytes]}
        off += r.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * (-len(hb) % 8)
    with open(fname, "wb") as fh:
        fh.write(struct.pack("<Q", len(hb)))
        fh.write(hb)
        for r in records:
            a = np.ascontiguousarray(fetch(r))
            if a.nbytes != r.nbytes:
                raise RuntimeError(f"{r.name}: {a.nbytes} bytes, expected {r.nbytes}")
            fh.write(a.reshape(-1).view(np.uint8).data)


@contextlib.contextmanager
def atomic_directory(out_dir: str, own_files: Optional[re.Pattern] = None):
    """Yield a temporary directory next to ``out_dir``; when the block succeeds it replaces ``out_dir`` by a rename
    (with ``own_files``, the files of an existing ``out_dir`` whose names it does not match, such as a tokenizer,
    are carried over; without, the whole directory is replaced); when the block or the swap fails, ``out_dir`` is
    untouched and nothing is left behind."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"{out_dir} exists and is not a directory")
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        yield tmp
        old = None
        if os.path.exists(out_dir):
            if own_files is not None:
                for fname in os.listdir(out_dir):
                    if not own_files.fullmatch(fname) and not os.path.exists(os.path.join(tmp, fname)):
                        src = os.path.join(out_dir, fname)
                        (shutil.copytree if os.path.isdir(src) else shutil.copy2)(src, os.path.join(tmp, fname))
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
            os.rename(out_dir, os.path.join(old, "x"))
        try:
            os.rename(tmp, out_dir)
        except BaseException:
            if old is not None:  # put the previous directory back
                os.rename(os.path.join(old, "x"), out_dir)
                shutil.rmtree(old, ignore_errors=True)
            raise
        tmp = None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------
# Checked loading: where each tensor comes from, and every problem of a load reported at once
@dataclasses.dataclass
class TensorSource:
    """Where an official tensor comes from: ``file[key][index]``."""

    file: "SafetensorsFile"
    key: str
    index: Optional[tuple]
    shape: tuple
    dtype: str

    def where(self) -> str:
        idx = "" if self.index is None else "[" + ", ".join(fmt_index(i) for i in self.index) + "]"
        return f"{self.key}{idx} in {os.path.basename(self.file.path)}"

    def read(self) -> np.ndarray:
        return self.file.read(self.key, self.index)


def fmt_index(i) -> str:
    if isinstance(i, slice):
        return f"{'' if i.start is None else i.start}:{'' if i.stop is None else i.stop}"
    return str(i)


def index_shape(shape: tuple, index) -> tuple:
    if index is None:
        return shape
    out = list(shape)
    dropped = 0
    for ax, i in enumerate(index):
        if isinstance(i, slice):
            out[ax - dropped] = len(range(*i.indices(shape[ax])))
        else:
            out.pop(ax - dropped)
            dropped += 1
    return tuple(out)


def fmt_shape(s) -> str:
    return "[" + ",".join(str(x) for x in s) + "]"


class LoadReport:
    """Collects every problem of a load; raised as one ValueError."""

    def __init__(self, path: str):
        self.path = path
        self.missing, self.unexpected, self.shape, self.dtype, self.other = [], [], [], [], []

    def raise_if_any(self):
        parts = [("missing", self.missing), ("unexpected", self.unexpected), ("mis-shaped", self.shape),
                 ("mis-typed", self.dtype), ("other", self.other)]
        n = sum(len(v) for _, v in parts)
        if not n:
            return
        lines = [f"checkpoint {self.path}: {n} problem(s): " + ", ".join(f"{len(v)} {k}" for k, v in parts if v)]
        for kind, items in parts:
            lines += [f"  {kind}: {it}" for it in items]
        raise ValueError("\n".join(lines))
