"""Drafter training smoke test: a few steps on a tiny exported target, export in speculators format, and an
interrupted run that resumes to the same parameters as an uninterrupted one."""
import os
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import jdspark
import kimi

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import train_drafter  # noqa: E402

ARGS = ["--steps", "4", "--batch", "2", "--seq-len", "48", "--anchors", "8", "--val-every", "4", "--val-batches",
        "1", "--ckpt-every", "2", "--log-every", "2", "--block-size", "4", "--markov-rank", "8",
        "--served-prompts", "0"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("target")
    cfg = kimi.KimiConfig.tiny(vocab_size=384, bos_token_id=256, eos_token_id=257, pad_token_id=259,
                               expert_format="mxfp4", moe_intermediate_size=32, routed_expert_hidden_size=64)
    kimi.save_checkpoint(kimi.KimiForCausalLM(cfg, rngs=nnx.Rngs(0)), str(d))
    return str(d)


@pytest.fixture(scope="module")
def trained(target_dir, tmp_path_factory):
    """One uninterrupted 4-step run, exported: the reference of the resume test and the ``--init`` of the others."""
    d = tmp_path_factory.mktemp("trained")
    res = train_drafter.main(["--target", target_dir, "--out", str(d / "run"), "--export", str(d / "export")] + ARGS)
    return res, str(d / "export")


def _params(drafter):
    return jax.tree.leaves(nnx.state(drafter, nnx.Param))


def test_smoke_and_resume(target_dir, trained, tmp_path):
    full, export = trained
    assert np.isfinite(full["final"]["loss"])
    f = full["final"]
    # greedy accepted length = 1 + sum_k P(drafts 0..k all right) <= 1 + sum_k P(draft k right): a chain
    # probability cannot exceed its last link's
    assert 3 <= len(f["per_position_acc"]) <= 4  # block 4 (less the anchor slot when it is not drafted)
    assert 1.0 <= f["greedy_accept_len"] <= 1.0 + sum(f["per_position_acc"]) + 1e-6, f
    loaded = jdspark.load_drafter(export, target=kimi.load_checkpoint(target_dir))
    for a, b in zip(_params(full["_drafter"]), _params(loaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    train_drafter.main(["--target", target_dir, "--out", str(tmp_path / "b"), "--stop-at", "2"] + ARGS)
    resumed = train_drafter.main(["--target", target_dir, "--out", str(tmp_path / "b"), "--resume"] + ARGS)
    for a, b in zip(_params(full["_drafter"]), _params(resumed["_drafter"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    assert resumed["final"]["loss"] == pytest.approx(full["final"]["loss"], abs=1e-6)


def test_init_continues_from_a_saved_drafter(target_dir, trained, tmp_path):
    """``--init``: a new run from an exported drafter takes its weights and architecture (the flags' different
    Markov rank is not used); at learning rate 0 the weights come out as they went in. ``--layers`` deepens it."""
    first, export = trained
    i = ARGS.index("--markov-rank")
    args = ARGS[:i + 1] + ["4"] + ARGS[i + 2:]  # --markov-rank 4: the init's rank (8) wins, so the programs of the
    # first run (the same shapes) are reused
    again = train_drafter.main(["--target", target_dir, "--out", str(tmp_path / "b"), "--init", export, "--lr",
                                "0"] + args + ["--served-prompts", "2", "--served-tokens", "12"])
    assert again["_drafter"].config.markov_rank == first["_drafter"].config.markov_rank == 8
    for a, b in zip(_params(first["_drafter"]), _params(again["_drafter"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the initial drafter is validated before the first step, on the same held-out batches and keys as the end
    assert again["initial"]["step"] == 0 and first["initial"] is None
    assert again["initial"]["loss"] == pytest.approx(again["final"]["loss"], abs=1e-6)
    # and served (jdspark.generate on held-out prompts, greedy and sampled) before and after: the same drafter
    # and seeds give the same tokens per target step, within 1 .. block + 1
    assert first["final"].get("served") is None
    before, after = again["initial"]["served"], again["final"]["served"]
    assert set(after) == {"T=0", "T=1"} and before == after, (before, after)
    for row in after.values():
        assert 1.0 <= row["accept_len"] <= 1 + 4 and row["target_steps"] >= 12 // 5
        assert all(0.0 <= x <= 1.0 for x in row["per_position_accept"])
        assert row["accept_len"] == pytest.approx(1 + sum(row["per_position_accept"]))
    # ``--layers 2`` deepens the 1-layer drafter: it starts where the 1-layer one was (the same step-0 held-out
    # figures on the same batches and keys) and exports as 2 layers; --layers below the drafter's is refused
    deep = train_drafter.main(["--target", target_dir, "--out", str(tmp_path / "c"), "--init", export, "--layers",
                               "2", "--lr", "0", "--export", str(tmp_path / "export2")] + args)
    for k in ("loss", "greedy_accept_len", "accept_len"):
        assert deep["initial"][k] == pytest.approx(again["initial"][k], abs=1e-5), k
    assert jdspark.load_drafter(str(tmp_path / "export2"), target=kimi.load_checkpoint(target_dir)).config \
        .num_hidden_layers == 2
    with pytest.raises(ValueError, match="deepened, not cut"):
        train_drafter.main(["--target", target_dir, "--out", str(tmp_path / "d"), "--init",
                            str(tmp_path / "export2"), "--layers", "1"] + args)
    with pytest.raises(SystemExit):  # a --target that is not a checkpoint: a usage error before anything loads
        train_drafter.main(["--target", str(tmp_path / "none"), "--out", str(tmp_path / "e")] + args)
    for flag in ("--corpus", "--served-corpus"):  # likewise a text folder that is not there
        with pytest.raises(SystemExit):
            train_drafter.parse_args(["--target", target_dir, flag, str(tmp_path / "none")])



def test_context_window_is_trained_and_exported(target_dir, trained, tmp_path):
    """``--context-window N``: the drafter attends to its last N context positions in training as in serving (the
    held-out loss of the same weights changes when 48-token sequences are cut to 8 positions of context), and the
    export's config carries N; ``none`` on a windowed drafter restores the whole context."""
    common = ["--target", target_dir, "--init", trained[1], "--lr", "0"] + ARGS
    whole = train_drafter.main(["--out", str(tmp_path / "b")] + common)
    ring = train_drafter.main(["--out", str(tmp_path / "c"), "--context-window", "8", "--export",
                               str(tmp_path / "ring")] + common)
    assert whole["_drafter"].config.context_window is None and ring["_drafter"].config.context_window == 8
    assert abs(ring["initial"]["loss"] - whole["initial"]["loss"]) > 1e-4, (ring["initial"], whole["initial"])
    target = kimi.load_checkpoint(target_dir)
    assert jdspark.load_drafter(str(tmp_path / "ring"), target=target).config.context_window == 8
    back = train_drafter.main(["--target", target_dir, "--out", str(tmp_path / "d"), "--init", str(tmp_path / "ring"),
                               "--lr", "0", "--context-window", "none"] + ARGS)
    assert back["_drafter"].config.context_window is None
    assert back["initial"]["loss"] == pytest.approx(whole["initial"]["loss"], abs=1e-6)
