#!/usr/bin/env python
"""Train the default model's byte-level BPE vocabulary on the training split only (held-out files never seen).

    python scripts/train_tokenizer.py --out checkpoints/default/target --vocab-size 4096

Writes ``tokenizer.json`` (Hugging Face ``tokenizers``: ByteLevel pre-tokenizer and decoder, so every byte
sequence is encodable) and ``tokenizer_config.json`` (special tokens by role, Kimi-style chat template) into
``--out``; ``kimi.load_tokenizer(out)`` reads them. Special ids come first: ``SPECIALS`` in order from 0.
With ``--json`` prints one summary line (vocabulary size, bytes per token on the held-out files).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jdspark import data as jdata
from kimi.tokenizer import PLAIN_CHAT_TEMPLATE, load_tokenizer

SPECIALS = ("<bos>", "<eos>", "<mask>", "<pad>", "<|im_system|>", "<|im_user|>", "<|im_assistant|>",
            "<|im_middle|>", "<|im_end|>")


def train_bpe(docs: list[bytes], vocab_size: int) -> Tokenizer:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tk.train_from_iterator((d.decode("utf-8", errors="replace") for d in docs), trainer=trainer, length=len(docs))
    return tk


def write_tokenizer(tk: Tokenizer, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json, each written to a temporary name and renamed."""
    out.mkdir(parents=True, exist_ok=True)
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "mask_token": "<mask>",
              "chat_template": PLAIN_CHAT_TEMPLATE, "model_max_length": 1 << 20,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    for name, text in (("tokenizer.json", tk.to_str()), ("tokenizer_config.json", json.dumps(config, indent=2))):
        fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, out / name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--corpus", default=None, help="directory of text files (default: the stdlib)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.vocab_size < 256 + len(SPECIALS):
        ap.error(f"--vocab-size: at least {256 + len(SPECIALS)} (bytes + specials), got {a.vocab_size}")
    docs = jdata.read_documents(jdata.list_files(a.corpus, "train"))
    write_tokenizer(train_bpe(docs, a.vocab_size), a.out)
    tok = load_tokenizer(a.out)
    val = jdata.read_documents(jdata.list_files(a.corpus, "val"))
    n_bytes = sum(len(d) for d in val)
    n_tok = sum(len(tok.encode(d.decode("utf-8"))) for d in val)
    exact = all(tok.decode(tok.encode(d.decode("utf-8"))) == d.decode("utf-8") for d in val)
    summary = {"vocab_size": tok.vocab_size, "train_files": len(docs), "val_bytes_per_token": n_bytes / n_tok,
               "val_round_trip_exact": exact}
    print(json.dumps(summary) if a.json else summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
