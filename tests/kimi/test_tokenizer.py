"""kimi.tokenizer: every format against the library that defines it (tiktoken, tokenizers, transformers' chat
templates), incremental decoding of split characters, and the K3 directory layout. No network."""

import base64
import json

import numpy as np
import pytest
import tiktoken
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kimi.tokenizer import (
    KIMI_PAT_STR,
    ByteTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    gpt2_byte_decoder,
    load_tokenizer,
)

TEXT = ("def add(a, b):\n    return a + b  # sum\n\nclass Foo:\n    x = 'héllo wörld'\n"
        "中文English混合 and numbers 1234567, emoji \U0001F600 done.\n")
CORPUS = [TEXT * 3, "for i in range(10):\n    print(i, i ** 2)\n" * 5, "import os\nimport sys\n" * 4,
          "naïve café résumé 日本語のテキスト\n" * 3]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
            "{{ raise_exception('bad role') }}{% endif %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>"
            "{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}")
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "  Sum 2 and 3?  "},
            {"role": "assistant", "content": "5"}, {"role": "user", "content": "Now 中文?"}]
SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
            "[PAD]"]


def _train_bpe(vocab_size=400):
    tk = RustTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<bos>", "<eos>", "<mask>", "<pad>"],
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(CORPUS, trainer=tr)
    return tk


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_tok")
    _train_bpe().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "chat_template": TEMPLATE,
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return d


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    """A K3-layout directory: tiktoken.model (byte ranks from a small BPE's merges) + tokenizer_config.json."""
    d = tmp_path_factory.mktemp("kimi_tok")
    bpe = json.loads(_train_bpe(600).to_str())["model"]
    dec = gpt2_byte_decoder()
    ranks = {bytes([b]): b for b in range(256)}
    for merge in bpe["merges"]:
        a, b = merge if isinstance(merge, list) else merge.split(" ")
        tok = bytes(dec[c] for c in a + b)
        ranks.setdefault(tok, len(ranks))
    with open(d / "tiktoken.model", "w") as f:
        for tok, r in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(tok).decode()} {r}\n")
    n = len(ranks)
    added = {str(n + i): {"content": s, "special": True} for i, s in enumerate(SPECIALS)}
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
         "num_reserved_special_tokens": 16, "chat_template": TEMPLATE}))
    return d, ranks


def test_tiktoken_directory_matches_tiktokens_own_encoding(kimi_dir):
    d, ranks = kimi_dir
    tok = load_tokenizer(d)
    assert isinstance(tok, TiktokenTokenizer)
    n = len(ranks)
    ref = tiktoken.Encoding(name="ref", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                            special_tokens={s: n + i for i, s in enumerate(SPECIALS)})
    for text in [TEXT, *CORPUS, "", "  leading spaces\n\n\ttabs\r\n", "中文English混合"]:
        ids = tok.encode(text)
        assert ids == ref.encode_ordinary(text)
        assert tok.decode(ids) == ref.decode(ids) == text
    # Han runs are their own pre-tokens (the pattern's first branch, Han subtracted from the letter branches)
    assert tok.decode([tok.encode("中文English混合")[0]]) != "中文English混合"
    # special tokens by id, reserved ids named, roles from the config
    assert tok.special_tokens["<|im_end|>"] == n + 2 and tok.bos_id == n and tok.eos_id == n + 1
    assert tok.pad_id == n + 7 and tok.special_tokens[f"<|reserved_token_{n + 8}|>"] == n + 8
    assert tok.vocab_size == n + 16
    with_special = "<|im_user|>hi<|im_end|>"
    assert tok.encode(with_special, allow_special=True) == ref.encode(with_special, allowed_special="all")
    assert tok.encode(with_special) == ref.encode_ordinary(with_special)  # as text unless allowed
    assert tok.decode(tok.encode(with_special, allow_special=True)) == "hi"
    assert tok.decode(tok.encode(with_special, allow_special=True), skip_special=False) == with_special


def test_tokenizer_json_round_trip_and_ids_equal_the_library(hf_dir):
    tok = load_tokenizer(hf_dir)
    assert isinstance(tok, HFTokenizer)
    lib = RustTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    for text in [TEXT, *CORPUS, "unseen wørds ⚙ and \x00 nul"]:
        ids = tok.encode(text)
        assert ids == lib.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == lib.decode(ids) == text
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.mask_id) == (0, 1, 3, 2)
    assert tok.encode("x", bos=True, eos=True) == [0, *lib.encode("x").ids, 1]


@pytest.mark.parametrize("kind", ["hf", "kimi"])
def test_chat_template_equals_transformers(kind, hf_dir, kimi_dir):
    d = hf_dir if kind == "hf" else kimi_dir[0]
    tok = load_tokenizer(d)
    # transformers renders the same template from the same config (a fast tokenizer built on our vocabulary)
    ref = PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"), chat_template=TEMPLATE,
                                  bos_token=tok.token_bytes(tok.bos_id).decode())
    for gen in (True, False):
        ours = tok.apply_chat_template(MESSAGES, add_generation_prompt=gen)
        theirs = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert ours == theirs
    with pytest.raises(Exception, match="bad role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("kind", ["bytes", "hf", "kimi"])
def test_incremental_decode_holds_back_split_characters(kind, hf_dir, kimi_dir):
    tok = {"bytes": lambda: ByteTokenizer(), "hf": lambda: load_tokenizer(hf_dir),
           "kimi": lambda: load_tokenizer(kimi_dir[0])}[kind]()
    text = "héllo 世界 \U0001F600 naïve 日本語"
    ids = tok.encode(text)
    # the ids must split some multi-byte character for the test to mean anything
    pieces = [tok.token_bytes(i) for i in ids]
    assert any(not _is_complete_utf8(p) for p in pieces)
    dec = tok.incremental_decoder()
    out = [dec.add([i]) for i in ids] + [dec.flush()]
    assert "".join(out) == text
    assert all("\ufffd" not in o for o in out)
    # a stream that stops inside a character shows nothing of it until the flush
    dec = ByteTokenizer().incremental_decoder()
    assert dec.add(ByteTokenizer().encode("a世")[:3]) == "a" and dec.flush() == "\ufffd"


@pytest.mark.parametrize("kind", ["bytes", "hf", "kimi"])
def test_heal_takes_off_the_last_token_and_lists_what_may_begin_the_answer(kind, hf_dir, kimi_dir):
    """``Tokenizer.heal``: the ids without the last one, its text, and every ordinary id whose bytes begin with it
    (a brute-force pass over the vocabulary here); nothing to heal after a special id, a lone id, or bytes that are
    not whole characters."""
    tok = {"bytes": lambda: ByteTokenizer(), "hf": lambda: load_tokenizer(hf_dir),
           "kimi": lambda: load_tokenizer(kimi_dir[0])}[kind]()
    keys, _ = tok.heal_index()  # built once (a server's start-up), then read by every heal
    assert keys == sorted(keys) and tok.heal_index()[0] is keys
    for text in ("def f(x):\n", "x = foo", "naïve"):
        ids = tok.encode(text, bos=tok.bos_id is not None)
        healed = tok.heal(ids)
        tail = tok.token_bytes(ids[-1])
        assert healed.ids == ids[:-1] and healed.text.encode("utf-8") == tail
        want = [i for i in range(tok.vocab_size)
                if i not in tok.special_ids and tok.token_bytes(i) and tok.token_bytes(i).startswith(tail)]
        assert list(healed.first_ids) == want and ids[-1] in want
    assert tok.heal(tok.encode("x")) is None  # nothing before the last token
    if tok.eos_id is not None:
        assert tok.heal(tok.encode("ab") + [tok.eos_id]) is None
    split = [i for i in tok.encode("日本") if not _is_complete_utf8(tok.token_bytes(i))]
    if split:  # a vocabulary that splits the character: its last byte alone is not healed
        assert tok.heal(tok.encode("a") + [split[-1]]) is None


def _is_complete_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_byte_tokenizer_and_bad_input(tmp_path):
    tok = load_tokenizer(tmp_path)  # no tokenizer files: the byte vocabulary
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 384
    assert tok.encode("é", bos=True, eos=True) == [256, 0xC3, 0xA9, 257]
    assert tok.decode([256, 104, 105, 257]) == "hi"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([1, 384])
    with pytest.raises(ValueError, match="expected integers"):
        tok.decode(np.array([1.5]))
    with pytest.raises(ValueError, match="expected str"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="not a directory"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "tiktoken.model").write_text("AA== 0\nAQ== 5\n")
    with pytest.raises(ValueError, match="ranks are not"):
        load_tokenizer(tmp_path)
