"""jdspark.data with a BPE tokenizer: packed documents, prompts cut at line starts with their real continuations,
bytes per token for bits-per-byte."""

import numpy as np
import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from jdspark import data
from kimi.tokenizer import load_tokenizer

DOCS = [(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n" * 40 + "# é 中 end\n").encode() for i in range(6)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("bpe")
    tk = RustTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator([x.decode() for x in DOCS], trainer=trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<bos>", "<eos>", "<mask>", "<pad>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.save(str(d / "tokenizer.json"))
    return load_tokenizer(d)


def test_packed_documents_are_bos_tokens_eos(tok):
    ds = data.PackedDataset(DOCS, batch=2, seq_len=16, seed=0, tokenizer=tok)
    for d, ids in zip(DOCS, ds.docs):
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        assert tok.decode(ids) == d.decode()
    assert ds.num_tokens < sum(len(d) for d in DOCS)  # BPE: fewer tokens than bytes


def test_prompts_with_continuations_are_the_documents_text(tok):
    out = data.prompts_from_documents(DOCS, 8, 24, tokenizer=tok, continuations=True, min_continuation=64)
    assert len(out) == 8
    for ids, cont in out:
        assert ids.shape == (24,) and ids[0] == tok.bos_id and ids.dtype == np.int32
        text = tok.decode_bytes(ids[1:]) + cont
        assert any(d.endswith(text) for d in DOCS) and len(cont) >= 64
    # bytes without a tokenizer: the same function, ids are the bytes
    ids, cont = data.prompts_from_documents(DOCS, 1, 24, continuations=True)[0]
    assert bytes(ids[1:].astype(np.uint8)) + cont in b"".join(DOCS)


def test_byte_lengths_count_specials_as_one(tok):
    lengths = data.byte_lengths(tok, 384)
    assert lengths.shape == (384,)
    assert lengths[tok.bos_id] == 1 and lengths[tok.eos_id] == 1 and lengths[383] == 1
    ids = tok.encode("    return x")
    assert sum(lengths[i] for i in ids) == len(b"    return x")
    assert (data.byte_lengths(None) == 1).all()
