"""Benchmark workloads: prompt documents for code, structured text and prose, found on the machine.

  code        the validation split of the training corpus (the stdlib's held-out files; never trained on)
  structured  JSON / TOML / YAML / INI / CFG files installed on the machine (package metadata, schemas, configs)
  prose       plain English text installed on the machine (licenses, READMEs, documentation)
Any directory of text files can be measured instead (``documents_from_dir``). The target is trained on Python
source only, so structured text and prose are out of distribution for it: they show how acceptance moves with the
workload, which is the question a user asks first.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path
from typing import Iterable, NamedTuple, Optional

from jdspark import data as jdata

WORKLOADS = ("code", "structured", "prose")
_STRUCTURED_EXT = (".json", ".toml", ".yaml", ".yml", ".ini", ".cfg")
_PROSE_NAMES = ("README", "README.txt", "README.md", "README.rst", "LICENSE", "LICENSE.txt", "COPYING", "NOTICE",
                "copyright", "AUTHORS")
_MAX_FILES = 400
_MIN_BYTES = 1024
_MAX_BYTES = 1 << 20


def _roots() -> list[Path]:
    """Places that exist on every machine of this kind (the interpreter, its packages, Debian's shared data)."""
    paths = sysconfig.get_paths()
    cands = [paths.get("purelib"), paths.get("platlib"), os.path.join(sys.prefix, "lib"),
             "/usr/share/common-licenses", "/usr/share/doc", "/usr/share", paths.get("stdlib")]
    seen, out = set(), []
    for c in cands:
        if c and os.path.isdir(c) and os.path.realpath(c) not in seen:
            seen.add(os.path.realpath(c))
            out.append(Path(c))
    return out


def _is_text(data: bytes) -> bool:
    if b"\x00" in data[:4096]:
        return False
    try:
        data[:4096].decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _walk(root: Path, want) -> Iterable[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", ".git", "node_modules"))
        for f in sorted(filenames):
            if want(f):
                yield Path(dirpath) / f


def _collect(want, limit: int = _MAX_FILES) -> list[bytes]:
    docs, seen = [], set()
    for root in _roots():
        for p in _walk(root, want):
            try:
                if not _MIN_BYTES <= p.stat().st_size <= _MAX_BYTES:
                    continue
                data = p.read_bytes()
            except OSError:
                continue
            if data in seen or not _is_text(data):
                continue
            seen.add(data)
            docs.append(data)
            if len(docs) >= limit:
                return docs
    return docs


def documents(workload: str, corpus: Optional[str] = None) -> list[bytes]:
    """The documents prompts of ``workload`` are cut from."""
    if workload == "code":
        return jdata.read_documents(jdata.list_files(corpus, "val"))
    if workload == "structured":
        return _collect(lambda f: f.lower().endswith(_STRUCTURED_EXT))
    if workload == "prose":
        return _collect(lambda f: f in _PROSE_NAMES or (f.lower().endswith((".txt", ".rst")) and
                                                        not f.lower().startswith(("requirements", "entry_points",
                                                                                  "top_level", "dependency"))))
    raise ValueError(f"workload: expected one of {WORKLOADS}, got {workload!r}")


def documents_from_dir(path: str) -> list[bytes]:
    """Every text file under ``path`` (any extension)."""
    if not os.path.isdir(path):
        raise ValueError(f"--corpus: {path} is not a directory")
    docs = []
    for p in _walk(Path(path), lambda f: True):
        try:
            data = p.read_bytes()
        except OSError:
            continue
        if data and _is_text(data):
            docs.append(data)
    if not docs:
        raise ValueError(f"--corpus: no text files under {path}")
    return docs


class TrafficRequest(NamedTuple):
    """One line of an operator's request file: the prompt's token ids (a chat's as the server renders it) and the
    request fields sent with it (``messages`` for a chat, ``response_format``, ``tools``, ``stop``, ...)."""
    line: int
    ids: list
    fields: dict


def read_request_file(path: str, tokenizer, vocab_size: int, reserved=()) -> list[TrafficRequest]:
    """An operator's own traffic, from a JSON Lines file of one request body per line: ``{"prompt": "text"}``,
    encoded as the server's ``/v1/completions`` encodes a text prompt (BOS when the tokenizer has one, then the
    text's ids), or ``{"prompt": [token ids]}``, sent as given, or ``{"messages": [...]}``, a chat conversation,
    counted as ``/v1/chat/completions`` renders it (the chat template, with the line's ``tools``). Any other field
    of a line is a request field sent with it, except the ``reserved`` ones (those its caller sets). Blank lines
    are skipped; any other line that is not such an object is a ValueError naming the line and what was expected
    (nothing is dropped or cut silently)."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--prompt-file {path}: expected a readable UTF-8 JSON Lines file ({e})") from None
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--prompt-file {path}, line {i}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg}); expected {{\"prompt\": \"text\"}}, "
                             f"{{\"prompt\": [token ids]}} or {{\"messages\": [...]}}") from None
        if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
            raise ValueError(f"{where}: expected an object with one of \"prompt\" (a non-empty string or list of "
                             f"token ids) or \"messages\" (a chat), got {line[:80]!r}")
        taken = sorted(set(row) & set(reserved))
        if taken:
            raise ValueError(f"{where}: {taken[0]!r} is set by the benchmark itself (its flags), not by a line; "
                             f"a line may not set {sorted(reserved)}")
        fields = {k: v for k, v in row.items() if k != "prompt"}
        if "messages" in row:
            ids = _chat_ids(row, tokenizer, vocab_size, where)
        else:
            p = row["prompt"]
            if isinstance(p, str) and p:
                ids = tokenizer.encode(p, bos=tokenizer.bos_id is not None)
            elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                bad = [t for t in p if not 0 <= t < vocab_size]
                if bad:
                    raise ValueError(f"{where}: token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
                ids = list(p)
            else:
                raise ValueError(f"{where}: expected an object with \"prompt\": a non-empty string or list of token "
                                 f"ids, got {line[:80]!r}")
        out.append(TrafficRequest(i, ids, fields))
    if not out:
        raise ValueError(f"--prompt-file {path}: no prompts (expected one JSON object per line)")
    return out


def _chat_ids(row: dict, tokenizer, vocab_size: int, where: str) -> list:
    """A chat line's prompt ids as the server renders them (``serve_request.prompt_ids``: the chat template, the
    line's ``tools`` and rendering options; images are not taken here), or a ValueError saying why not."""
    from jdspark import serve_request, tool_calls
    from jdspark.serve_errors import ApiError

    try:
        # (a tool parser named only so that a line's tools are rendered, as a server with its default parser does)
        ids, *_ = serve_request.prompt_ids(row, tokenizer, vocab_size, True, None, tool_calls.PARSERS[0], None)
    except ApiError as e:
        raise ValueError(f"{where}: {e.message}") from None
    return list(ids)


def read_prompt_file(path: str, tokenizer, vocab_size: int) -> list[list[int]]:
    """An operator's own prompts (``read_request_file``'s ``prompt`` lines) for a benchmark that measures a prompt
    alone (``scripts/bench.py``): a line with any other field (a chat, ``response_format``, ...) is a ValueError
    naming it rather than a request measured without what it asked for."""
    reqs = read_request_file(path, tokenizer, vocab_size)
    for r in reqs:
        if r.fields:
            raise ValueError(f"--prompt-file {path}, line {r.line}: {sorted(r.fields)[0]!r} is a request field, "
                             "which this benchmark does not send (it generates from the prompt alone; "
                             "scripts/bench_serve.py sends a line's fields to the server)")
    return [r.ids for r in reqs]
