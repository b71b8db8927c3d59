"""scripts/distill_corpus.py: the shipped target's continuations of training-split prompts, written whole."""

import importlib.util
import os

import numpy as np
import pytest

import jdspark
import kimi
from jdspark import data as jdata

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("distill_corpus", os.path.join(_ROOT, "scripts", "distill_corpus.py"))
dc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dc)


def test_writes_prompt_plus_continuation_from_the_training_split(tmp_path, capsys):
    out = tmp_path / "corpus"
    assert dc.main(["--out", str(out), "--prompts", "2", "--prompt-len", "24", "--max-new-tokens", "6",
                    "--temperatures", "0,1.0"]) == 0
    files = sorted(os.listdir(out))
    assert files == ["gen_00000.txt", "gen_00001.txt"]  # no temporary names left behind
    assert "UNTRAINED" not in capsys.readouterr().err  # the shipped pair, not the random fallback
    train = jdata.read_documents(jdata.list_files(None, "train"))
    tdir = os.path.join(_ROOT, "checkpoints", "default", "target")
    target = kimi.load_checkpoint(tdir, config_overrides={"serving_dtype": "bfloat16"})
    tok = kimi.load_tokenizer(tdir, vocab_size=target.config.vocab_size)
    prompts = jdata.prompts_from_documents(train, 2, 24, seed=0, tokenizer=tok)
    for name, p in zip(files, prompts):
        text = (out / name).read_bytes()
        head = tok.decode_bytes(p)  # the prompt's text (BOS dropped)
        assert text.startswith(head) and len(text) > len(head)  # then the continuation (up to 6 tokens)
        assert any(head in d for d in train)
    # the greedy file (temperature 0, the first prompt) holds the shipped target's greedy continuation of the
    # first prompt cut as the script cuts them (served as the script serves it: bf16 matmul weights)
    ids = np.concatenate([prompts[0], jdspark.generate(target, None, prompts[0], max_new_tokens=6).tokens])
    assert (out / files[0]).read_bytes() == tok.decode_bytes(ids)
    # the files are a corpus train_drafter.py can read
    assert len(jdata.read_documents(jdata.list_files(out, "all"))) == 2


def test_rejects_bad_temperatures(tmp_path):
    with pytest.raises(SystemExit):
        dc.main(["--out", str(tmp_path), "--temperatures", "0,hot"])
