"""scripts/bench.py's pieces that need no timing: the chart from a result, acceptance -> p, degeneracy rows."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import bench  # noqa: E402

from jdspark import costmodel  # noqa: E402
from kimi.tokenizer import ByteTokenizer  # noqa: E402


def _row(accept_len, speedup):
    return {"accept_len": accept_len, "speedup": speedup, "per_position_accept": [0.9, 0.8, 0.7],
            "r_draft_over_step": 0.2, "v_verify_over_step": 1.5}


def test_p_from_accept_len_inverts_the_cost_model():
    for p in (0.0, 0.3, 0.73, 0.95):
        assert bench._p_from_accept_len(costmodel.expected_tokens_per_step(p, 7), 7) == pytest.approx(p, abs=1e-9)


def test_plot_writes_a_png(tmp_path):
    result = {"block_size": 3, "backend": "cpu",
              "workloads": {"code": {"greedy": _row(3.1, 2.0), "sampled": _row(2.2, 1.3)},
                            "prose": {"greedy": _row(2.5, 1.5)}}}
    out = tmp_path / "chart.png"
    bench.plot(result, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["chart.png"]  # no temporary file left


def test_replot_draws_a_saved_run_s_chart_and_names_a_bad_file(tmp_path, capsys):
    result = {"block_size": 3, "backend": "cpu", "workloads": {"code": {"greedy": _row(3.1, 2.0)}}}
    saved = tmp_path / "run.json"
    saved.write_text("[bench] a line of the run's log\n" + json.dumps(result) + "\n\n")
    out = tmp_path / "again.png"
    assert bench.main(["--replot", str(saved), "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for text, said in (("{\"workloads\": 3}", "expected bench.py --json's object"), ("{not json", "is not JSON"),
                       ("", "expected bench.py --json's object")):
        saved.write_text(text)
        with pytest.raises(SystemExit):
            bench.main(["--replot", str(saved), "--plot", str(out)])
        assert said in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--replot", str(saved)])
    assert "--replot needs --plot" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--replot", str(tmp_path / "missing.json"), "--plot", str(out)])
    assert "missing.json" in capsys.readouterr().err


def test_degeneracy_figures_compare_with_the_real_continuation_at_the_same_length():
    tok = ByteTokenizer()
    loop = tok.encode(" " * 100)
    fig = bench.degeneracy_figures(tok, [loop], [b"def f():\n    return 1\n" * 20])
    assert fig["run_share"] == 1.0 and fig["reference"]["run_share"] == 0.0
    assert fig["reference"]["distinct8"] > 0.2


def test_an_operator_s_prompts_have_no_reference(tmp_path, capsys):
    """--prompt-file rows: no real continuation, so ``reference`` is null (not a made-up figure); a bad file stops the
    run naming its line."""
    tok = ByteTokenizer()
    fig = bench.degeneracy_figures(tok, [tok.encode("x = 1\n" * 9)], [None])
    assert fig["reference"] is None and fig["distinct8"] > 0
    assert bench._reference_text(None) == "no real continuation to compare with"
    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "def f():"}\n{"prompt": "ok", }\n')
    with pytest.raises(SystemExit):
        bench.main(["--prompt-file", str(f)])
    assert "mine.jsonl, line 2: not JSON" in capsys.readouterr().err
    # a --corpus folder without text, or a checkpoint folder that is not there: said before the pair loads
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        bench.main(["--corpus", str(tmp_path / "empty")])
    assert "no text files under" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no such folder"):
        bench.main(["--checkpoint", str(tmp_path / "none")])


def test_greedy_divergence_names_the_first_differing_token_and_both_models_gaps():
    """On a tiny bf16-served model: the first differing position, and the logit gaps there equal the ones read off
    one-pass prefills of the prompt + the plain tokens before it (fp32 checkpoint and bf16 serving copy)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import kimi
    from kimi.model import with_serving_layout

    cfg = kimi.KimiConfig.tiny(serving_dtype="bfloat16")
    target = kimi.KimiForCausalLM(cfg, rngs=nnx.Rngs(0))
    prompt = np.array([1, 5, 9, 13], np.int32)
    plain = np.array([20, 21, 22, 23, 24], np.int32)
    spec = np.array([20, 21, 22, 40, 24, 25], np.int32)
    d = bench.greedy_divergence(target, prompt, plain, spec)
    seq = jnp.asarray(np.concatenate([prompt, plain[:3]]))[None]
    fp32 = np.asarray(target.forward(seq, target.init_cache(1, 7), mode="prefill").logits[0, -1])
    served = with_serving_layout(target)
    bf16 = np.asarray(served.forward(seq, served.init_cache(1, 7), mode="prefill").logits[0, -1])
    assert (d["at"], d["plain_token"], d["spec_token"]) == (3, 23, 40)
    assert d["gap_fp32"] == pytest.approx(fp32[23] - fp32[40], abs=1e-5)
    assert d["gap_bf16"] == pytest.approx(bf16[23] - bf16[40], abs=1e-5)
    assert d["bf16_shift"] == pytest.approx(np.abs(bf16 - fp32).max(), abs=1e-5) and d["bf16_shift"] > 0


def test_run_workload_times_more_draft_counts_in_the_same_rounds():
    """``run_workload(also=...)``: each extra count is a DSpark mode of its own, its acceptance pooled over the
    prompts' steps exactly as ``jdspark.generate`` with that ``num_speculative_tokens`` reports them (one draft a
    step: no accepted length above 1), greedy output equal to plain decoding's; the main row is the whole block's."""
    import numpy as np

    import jdspark
    import kimi
    from tests.jdspark.test_speculative import bigram_map, markov_drafter, scaled_target

    cfg = kimi.KimiConfig.tiny()
    target = scaled_target(cfg, 0.1)
    drafter = markov_drafter(target, bigram_map(scaled_target(cfg, 0.0)), 0.1, 30.0)
    rng = np.random.default_rng(8)  # greedy, 64 new tokens: test_speculative's programs
    prompts = [rng.integers(3, cfg.vocab_size, size=n) for n in (11, 40)]
    row = bench.run_workload(target, drafter, prompts, 64, repeats=1, also=(1,))

    def pooled(n):
        st = [jdspark.generate(target, drafter, p, max_new_tokens=64, eos_token_id=-1, seed=i,
                               num_speculative_tokens=n).stats for i, p in enumerate(prompts)]
        steps, accepted = sum(int(s.target_steps) for s in st), sum(int(s.accepted) for s in st)
        return (accepted + steps) / steps, sum(np.asarray(s.accept_counts) for s in st) / steps

    one = row["also"]["1"]
    assert set(row["also"]) == {"1"} and one["greedy_mismatches"] == 0 == row["greedy_mismatches"]
    for got, n in ((row, None), (one, 1)):
        accept_len, per_position = pooled(n)
        assert got["accept_len"] == pytest.approx(accept_len)
        np.testing.assert_allclose(got["per_position_accept"], per_position)
        assert got["speedup"] > 0 and got["spec_tok_s"] > 0
    assert 1.0 < one["accept_len"] <= 2.0 < row["accept_len"]
    assert not any(one["per_position_accept"][1:])
