"""simulate.py at K3's million-token context: per-device bytes at batch 1 and 16, the drafter's cache included."""
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_k3_tp16_at_one_million_tokens_fits_at_batch_1(capsys):
    spec = importlib.util.spec_from_file_location("simulate", os.path.join(ROOT, "scripts", "simulate.py"))
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    assert sim.main(["--preset", "k3", "--mesh", "tp16", "--context", "1000000", "--no-compile", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    b1, b16 = out["memory_by_batch"]["1"], out["memory_by_batch"]["16"]
    parts = ("weights", "drafter_weights", "kda_states", "mla_latent_cache", "drafter_cache")
    for m in (b1, b16):
        assert m["total"] == sum(m[k] for k in parts) and m["context"] == 1_000_000
        assert m["fits"] == (m["total"] <= out["hbm_bytes"])
    assert b1["fits"] and b1["drafter_cache"] > 0 and b1["total"] == out["per_device_total_bytes"]
    # tensor parallelism does not split the batch: caches grow 16x, weights do not
    for k in ("mla_latent_cache", "drafter_cache", "kda_states"):
        assert b16[k] == pytest.approx(16 * b1[k], rel=1e-6)
    assert b16["weights"] == b1["weights"]
    # MLA: one 512 + 64 latent per position and MLA layer (24), bf16, replicated over the 16 devices
    assert b1["mla_latent_cache"] == 24 * 1_000_000 * (512 + 64) * 2
