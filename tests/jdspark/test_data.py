"""jdspark.data: tokenizer, split by file, packed iterator (deterministic, resumable), held-out prompts."""

import os
import re
import shutil

import numpy as np
import pytest

from jdspark import data
from kimi.config import KimiConfig


def _corpus(tmp_path, n=60, name="corpus"):
    root = tmp_path / name
    for i in range(n):
        sub = root / f"pkg{i % 4}"
        sub.mkdir(parents=True, exist_ok=True)
        body = "".join(f"def f{i}_{j}(x):\n    return x + {j}  # é\n" for j in range(5 + i % 7))
        (sub / f"mod{i}.txt").write_text(body, encoding="utf-8")
    (root / ".hidden").write_text("never read")
    (root / "blob.bin").write_bytes(b"\x00\x01binary")
    (root / "empty.txt").write_text("")
    return root


# ------------------------------------------------------------------------------------------------ tokenizer
def test_specials_agree_with_demo_config():
    cfg = KimiConfig.demo()
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.vocab_size) == (
        data.BOS_ID, data.EOS_ID, data.PAD_ID, data.VOCAB_SIZE)
    assert data.VOCAB_SIZE % 128 == 0 and data.VOCAB_SIZE >= 260
    assert data.MASK_ID == 258 and len({data.BOS_ID, data.EOS_ID, data.MASK_ID, data.PAD_ID}) == 4


def test_tokenizer_round_trip():
    for s in ["", "hello", "def f(x):\n    return x  # ünïcödé ✓ 🐍\n", "\x00\t\r\n"]:
        ids = data.encode(s)
        assert ids.dtype == np.int32 and ids.max(initial=0) < 256
        assert data.decode(ids) == s
    framed = data.encode("ab", bos=True, eos=True)
    assert framed.tolist() == [data.BOS_ID, 97, 98, data.EOS_ID]
    # specials and padding are dropped; invalid UTF-8 is replaced, never raised
    assert data.decode([data.BOS_ID, 104, 105, data.MASK_ID, data.PAD_ID, data.EOS_ID]) == "hi"
    assert data.decode([0xFF, 104]) == "\ufffdh"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        data.decode([data.VOCAB_SIZE])
    with pytest.raises(ValueError):
        data.encode(b"bytes")


# ------------------------------------------------------------------------------------------------ corpus / split
def test_stdlib_split_is_by_file_and_disjoint():
    train, val, every = (data.list_files(None, s) for s in ("train", "val", "all"))
    assert val and len(train) > 10 * len(val)
    assert not set(train) & set(val)
    assert sorted(set(train) | set(val)) == sorted(every)
    root = data.stdlib_dir()
    rels = [p.relative_to(root).as_posix() for p in every]
    assert all(r.endswith(".py") for r in rels)
    assert not any(part in ("test", "tests", "idlelib", "site-packages") for r in rels for part in r.split("/"))
    assert data.list_files(None, "val") == val  # deterministic


def test_directory_corpus_split_depends_on_relative_paths_only(tmp_path):
    root = _corpus(tmp_path)
    train, val = data.list_files(root, "train", val_fraction=0.2), data.list_files(root, "val", val_fraction=0.2)
    names = {p.relative_to(root).as_posix() for p in train + val}
    assert len(names) == 60 and not {p.name for p in train} & {p.name for p in val}
    assert ".hidden" not in names and "blob.bin" not in names and "empty.txt" not in names
    assert 1 <= len(val) < 30
    moved = tmp_path / "elsewhere"
    shutil.copytree(root, moved)
    assert [p.relative_to(moved) for p in data.list_files(moved, "val", val_fraction=0.2)] == \
        [p.relative_to(root) for p in val]
    with pytest.raises(ValueError, match="not a directory"):
        data.list_files(tmp_path / "missing")
    with pytest.raises(ValueError, match="split"):
        data.list_files(root, "test")


# ------------------------------------------------------------------------------------------------ packed iterator
def _dataset(root, seed=0, batch=3, seq_len=40):
    return data.PackedDataset(data.read_documents(data.list_files(root, "train", val_fraction=0.2)), batch=batch,
                              seq_len=seq_len, seed=seed)


def test_packed_batches_shapes_and_document_ids(tmp_path):
    ds = _dataset(_corpus(tmp_path))
    b = ds.batch_at(0)
    assert b.tokens.shape == b.doc_ids.shape == (3, 41) and b.tokens.dtype == np.int32
    for row_t, row_d in zip(b.tokens, b.doc_ids):
        assert row_d[0] == 0 and np.all(np.diff(row_d) >= 0)
        # a new document starts exactly at each BOS (after the first position) and right after each EOS
        starts = np.flatnonzero(np.diff(row_d)) + 1
        assert np.all(row_t[starts] == data.BOS_ID)
        bos = np.flatnonzero(row_t == data.BOS_ID)
        assert set(bos[bos > 0]) == set(starts)
        assert np.all(row_t[starts - 1] == data.EOS_ID)
    assert set(np.unique(b.tokens)) <= set(range(256)) | {data.BOS_ID, data.EOS_ID}


def test_iterator_is_deterministic_and_resumable(tmp_path):
    root = _corpus(tmp_path)
    a, b = _dataset(root, seed=3), _dataset(root, seed=3)
    n = a.windows_per_epoch // a.batch + 3  # crosses an epoch boundary
    full = [x.tokens for x in a.iterate(0, n)]
    resumed = [x.tokens for x in b.iterate(n - 5, 5)]
    for x, y in zip(full[n - 5:], resumed):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(_dataset(root, seed=3).batch_at(7).tokens, full[7])
    assert not np.array_equal(_dataset(root, seed=4).batch_at(0).tokens, full[0])
    # one epoch visits every window once: no window twice, and its tokens are the documents' tokens less the
    # tail that does not fill a window (as a multiset: every token count at most the documents', the deficit
    # under one window)
    wins = [a.window_at(i)[0] for i in range(a.windows_per_epoch)]
    assert len({w.tobytes() for w in wins}) == a.windows_per_epoch
    ep = np.concatenate(wins)
    docs = np.concatenate(a.docs)
    have, total = np.bincount(ep, minlength=65536), np.bincount(docs, minlength=65536)
    assert (have <= total).all() and 0 <= docs.size - ep.size < a.window
    assert not np.array_equal(full[0], full[1])


def test_validation_batches_come_from_validation_files_only(tmp_path):
    root = _corpus(tmp_path, n=200)
    val_files = data.list_files(root, "val")
    train_docs = {bytes(d) for d in data.read_documents(data.list_files(root, "train"))}
    assert not train_docs & {bytes(d) for d in data.read_documents(val_files)}
    vb = data.validation_batches(batch=2, seq_len=64, num_batches=2, corpus=root)
    assert len(vb) == 2 and vb[0].tokens.shape == (2, 65)
    val_docs = data.read_documents(val_files)
    val_names = {m for d in val_docs for m in re.findall(rb"def (f\d+)_", d)}
    train_names = {m for d in train_docs for m in re.findall(rb"def (f\d+)_", d)}
    checked = 0
    for b in vb:
        for row in b.tokens:
            # each file's functions are named f<file>_<j>: every name a window shows (65 bytes always hold one
            # whole "def f<i>_") is a validation file's, never a training file's; its byte runs are in those files
            for run in np.split(row, np.flatnonzero(row >= 256)):
                seg = run[run < 256].astype(np.uint8).tobytes()
                assert any(seg in d for d in val_docs), seg
                for name in re.findall(rb"def (f\d+)_", seg):
                    assert name in val_names and name not in train_names, name
                    checked += 1
    assert checked >= 4
    assert np.array_equal(data.validation_batches(batch=2, seq_len=64, num_batches=2, corpus=root)[1].tokens,
                          vb[1].tokens)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="seq_len"):
        data.PackedDataset([b"abc"], batch=1, seq_len=0)
    with pytest.raises(ValueError, match="shorter than one window"):
        data.PackedDataset([b"abc"], batch=1, seq_len=100)


# ------------------------------------------------------------------------------------------------ prompts
def test_heldout_prompts_cut_at_line_starts_of_validation_files():
    ps = data.heldout_prompts(6, 64)
    assert len(ps) == 6 and all(p.shape == (64,) and p[0] == data.BOS_ID for p in ps)
    val = [d for d in data.read_documents(data.list_files(None, "val"))]
    for p in ps:
        body = p[1:].astype(np.uint8).tobytes()
        hits = [d for d in val if body in d]
        assert hits
        d = hits[0]
        i = d.index(body)
        assert i == 0 or d[i - 1:i] == b"\n"
    assert all(np.array_equal(a, b) for a, b in zip(ps, data.heldout_prompts(6, 64)))
    assert len({p.tobytes() for p in ps}) == 6
    raw = data.heldout_prompts(2, 32, bos=False, seed=1)
    assert raw[0].shape == (32,) and raw[0].max() < 256


def test_heldout_prompts_from_a_directory(tmp_path):
    root = _corpus(tmp_path, n=200)
    ps = data.heldout_prompts(3, 24, corpus=root, min_continuation=16)
    assert len(ps) == 3 and data.decode(ps[0])[:4] in ("def ", "    ")
    assert os.path.isdir(root)
