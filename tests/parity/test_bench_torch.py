"""scripts/bench_torch.py on a tiny random transformers KimiLinear checkpoint: one JSON line with both sides'
figures per mode, and ``jdspark.generate``'s greedy tokens (one device program) equal to transformers'
``generate(do_sample=False)`` token for token (scripts/parity.py compares kimi's own prefill + decode loop)."""
import json
import os
import sys

import pytest
import torch  # noqa: F401  (a missing parity dependency fails the run: tests/conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import bench_torch  # noqa: E402
import parity  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _restore_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_json_line_compares_both_sides_and_greedy_tokens_match(dtype, tmp_path, capsys):
    ckpt = parity.build_tiny_hf_checkpoint(tmp_path / "tiny", seed=2, q_lora_rank=16)
    assert bench_torch.main(["--checkpoint", str(ckpt), "--prompt-len", "12", "--new-tokens", "6", "--rounds", "1",
                             "--threads", "1", "--dtype", dtype, "--json"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    assert len(lines) == 1
    r = json.loads(lines[0])
    assert (r["prompt_len"], r["new_tokens"], r["torch_threads"]) == (12, 6, 1)
    assert r["torch_compile"] is False
    for mode in ("greedy", "sampled"):
        row = r[mode]
        for side in ("transformers", "jdspark"):
            assert row[side]["tokens"] == 6  # EOS off: every asked token, on both sides
            assert min(row[side][k] for k in ("prefill_ms", "decode_tok_s", "tok_s", "first_calls_s")) > 0
        ratio = row["jdspark_over_transformers"]
        assert ratio["tok_s"] == pytest.approx(row["jdspark"]["tok_s"] / row["transformers"]["tok_s"], rel=0.05)
    assert r["dtype"] == dtype
    if dtype == "float32":  # bf16 on each side rounds differently: reported, not expected to match
        assert r["greedy"]["greedy_match"] is True and r["greedy"]["greedy_first_mismatch"] is None
    assert "greedy_match" not in r["sampled"]


@pytest.mark.parametrize("flags, message", [(["--new-tokens", "1"], "--new-tokens: expected >= 2"),
                                            (["--modes", "beam"], "--modes"),
                                            (["--checkpoint", "/nonexistent/dir"], "not a directory")])
def test_bad_flags_are_named(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench_torch.main(flags)
    assert message in capsys.readouterr().err


def test_out_keeps_a_checkpoint_both_servers_read_as_text(tmp_path):
    """``--out``'s checkpoint: transformers' files with the shipped tokenizer beside them and its special ids in
    the config, so jdspark's server (``kimi.load_checkpoint``, ``kimi.load_tokenizer``) and ``transformers serve``
    read one vocabulary."""
    import kimi

    out = bench_torch.build_shipped_scale(tmp_path / "target", seed=1)
    model = kimi.load_checkpoint(out, dtype="float32")
    tok = kimi.load_tokenizer(out)
    cfg = model.config
    assert cfg.vocab_size == 4096 and cfg.hidden_size == 384
    assert (cfg.bos_token_id, cfg.eos_token_id) == (tok.bos_id, tok.eos_id)
    assert tok.decode(tok.encode("def f(x):\n    return x", bos=False)) == "def f(x):\n    return x"


def test_transformers_serve_cpu_answers_a_completion(tmp_path):
    """scripts/transformers_serve_cpu.py starts transformers' own server on this CPU without ``accelerate`` and it
    answers an OpenAI completion of the checkpoint (the comparison's other side, docs/performance.md)."""
    import socket
    import subprocess
    import time

    import httpx

    out = bench_torch.build_shipped_scale(tmp_path / "target", seed=1)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "scripts", "transformers_serve_cpu.py"), out,
                             "--port", str(port), "--host", "127.0.0.1"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.time() + 180
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.time() < deadline, "transformers serve did not start in 180 s"
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        r = httpx.post(url + "/v1/completions", json={"model": out, "prompt": "def f(x):", "max_tokens": 4,
                                                      "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        assert 1 <= r.json()["usage"]["completion_tokens"] <= 4
    finally:
        proc.terminate()
        proc.wait(30)
