#!/usr/bin/env python
"""jdspark against PyTorch on one checkpoint: transformers' KimiLinear and ``jdspark.generate``, side by side (JSON).

    python scripts/bench_torch.py --json                       # a random KimiLinear at the shipped target's scale
    python scripts/bench_torch.py --checkpoint DIR --json      # any transformers KimiLinear checkpoint directory
    python scripts/bench_torch.py --json --new-tokens 256 --prompt-len 512 --rounds 5
    python scripts/bench_torch.py --json --out DIR             # keep the random checkpoint (DIR/target) to serve

The mission's comparison at batch 1: the same checkpoint loaded by transformers (``KimiLinearForCausalLM``, fp32,
eager attention, its cache; on a CPU its KDA and short convolutions run transformers' PyTorch reference forms, as
FLA's and causal-conv1d's kernels are GPU-only) and by ``kimi.load_checkpoint`` (fp32), the same prompt, the same
number of new tokens, EOS off. Per mode (``greedy``; ``sampled``: T = 1, top-p 0.95, each side its own seed):

  * ``prefill_ms``: a generation of 1 token (the prompt's prefill and the first draw), the median over rounds;
  * ``decode_tok_s``: the tokens after the first over the time a generation of ``--new-tokens`` takes beyond
    the 1-token one (``(N - 1) / (t_N - t_1)``, each the median over rounds);
  * ``tok_s``: ``N / t_N``, prefill included (what a user waits on);
  * ``jdspark_over_transformers``: the ratio of each figure (prefill: transformers' time over ours).

Rounds alternate the two sides (transformers, then jdspark, ``--rounds`` times), so the machine's drift falls on
both. Each side's first call of each size runs before the rounds, outside every other figure (``first_calls_s``:
jdspark's compile its programs there; with ``--torch-compile`` transformers' forward, wrapped in ``torch.compile``,
compiles there too: minutes on a small CPU). ``greedy_match``: the greedy tokens equal transformers'
``generate(do_sample=False)`` token for token (``greedy_first_mismatch`` otherwise: fp32 summation order can split
a near-tie of two logits, as in ``scripts/parity.py``). transformers has no DSpark loop (vLLM's lives in its GPU
engine), so DSpark is not a row here; ``scripts/bench.py`` compares it with jdspark's plain decoding on the shipped
pair. The default checkpoint is built here with random weights at the shipped target's dimensions (KimiLinear's
features only: transformers has no AttnRes, LatentMoE, SiTU or MXFP4 experts; ``scripts/parity.py``'s list), so
timings, not text, are the point. ``--dtype bfloat16``: each side as it serves in bf16 (transformers' weights and
activations bf16; jdspark's serving copy, bf16 matmul weights with fp32 activations and sums, as the shipped pair
is served): the numerics differ, so ``greedy_match`` is reported, not expected.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
for _p in (_ROOT, _ROOT / "scripts"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import numpy as np  # noqa: E402

# the shipped target's dimensions (checkpoints/default/target/config.json) in KimiLinear's fields
SHIPPED_SCALE = dict(
    vocab_size=4096, hidden_size=384, intermediate_size=768, moe_intermediate_size=192, num_hidden_layers=6,
    num_attention_heads=6, num_key_value_heads=6, kv_lora_rank=96, q_lora_rank=192, qk_rope_head_dim=16,
    qk_nope_head_dim=32, v_head_dim=32, n_shared_experts=1, num_local_experts=8, num_experts_per_tok=2,
    linear_attn_config={"num_heads": 6, "head_dim": 64, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 3, 5],
                        "full_attn_layers": [4, 6]})
MODES = {"greedy": (0.0, 1.0), "sampled": (1.0, 0.95)}  # (temperature, top_p)
SHIPPED_TARGET = _ROOT / "checkpoints" / "default" / "target"


def build_shipped_scale(out_dir, seed: int = 0) -> str:
    """A random KimiLinear at ``SHIPPED_SCALE`` written by transformers into ``out_dir`` (``save_pretrained``), with
    the shipped target's tokenizer files beside it and their special ids in its config: a checkpoint both
    ``transformers serve out_dir`` and ``python -m jdspark.serve --checkpoint <its parent>`` serve as text."""
    import shutil

    import parity

    special = {k: json.loads((SHIPPED_TARGET / "config.json").read_text())[k]
               for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    out = parity.build_tiny_hf_checkpoint(out_dir, seed=seed, initializer_range=0.02, **special, **SHIPPED_SCALE)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED_TARGET / name, os.path.join(out, name))
    return out


def ours_generate(model, prompt_1T: np.ndarray, n: int, temperature: float, top_p: float, seed: int) -> list:
    """``jdspark.generate``'s plain decoding of ``n`` new tokens (EOS off), one device program."""
    import jdspark

    out = jdspark.generate(model, None, prompt_1T[0], max_new_tokens=n, temperature=temperature, top_p=top_p,
                           seed=seed, eos_token_id=-1)
    return [int(t) for t in np.asarray(out.tokens)[: int(out.num_tokens)]]


def _timed(fn, *args) -> tuple:
    t = time.perf_counter()
    toks = fn(*args)
    return time.perf_counter() - t, toks


def compare(hf, ours, prompt_1T: np.ndarray, new_tokens: int, rounds: int, modes=tuple(MODES), seed: int = 0) -> dict:
    """Both sides' figures per mode (the module docstring's fields), rounds alternating the sides."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens: expected >= 2 (decode speed is timed beyond the first token), got {new_tokens}")
    if rounds < 1:
        raise ValueError(f"rounds: expected >= 1, got {rounds}")
    import parity

    sides = {"transformers": (parity.hf_generate, hf), "jdspark": (ours_generate, ours)}
    result = {}
    for mode in modes:
        temp, top_p = MODES[mode]
        first = {s: sum(_timed(fn, model, prompt_1T, n, temp, top_p, seed)[0] for n in (1, new_tokens))
                 for s, (fn, model) in sides.items()}
        times = {s: {1: [], new_tokens: []} for s in sides}
        toks = {}
        for _ in range(rounds):
            for side, (fn, model) in sides.items():
                for n in (1, new_tokens):
                    dt, toks[side] = _timed(fn, model, prompt_1T, n, temp, top_p, seed)
                    times[side][n].append(dt)
        row = {}
        for side in sides:
            t1, tn = (statistics.median(times[side][n]) for n in (1, new_tokens))
            row[side] = {"prefill_ms": round(t1 * 1e3, 2),
                         "decode_tok_s": round((new_tokens - 1) / max(tn - t1, 1e-9), 1),
                         "tok_s": round(new_tokens / tn, 1), "tokens": len(toks[side]),
                         "first_calls_s": round(first[side], 2)}
        a, b = row["transformers"], row["jdspark"]
        row["jdspark_over_transformers"] = {"prefill": round(a["prefill_ms"] / b["prefill_ms"], 2),
                                            "decode_tok_s": round(b["decode_tok_s"] / a["decode_tok_s"], 2),
                                            "tok_s": round(b["tok_s"] / a["tok_s"], 2)}
        if temp == 0.0:
            ref, mine = toks["transformers"], toks["jdspark"]
            row["greedy_match"] = ref == mine
            row["greedy_first_mismatch"] = next((i for i, (x, y) in enumerate(zip(ref, mine)) if x != y),
                                                None if len(ref) == len(mine) else min(len(ref), len(mine)))
        result[mode] = row
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", help="a transformers KimiLinear checkpoint directory (default: a random one "
                                         "at the shipped target's scale, built in a temporary directory)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {list(MODES)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch's intra-op threads (default: all "
                                                                         "cores, as XLA:CPU uses)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="bfloat16: transformers' weights and activations in bf16, jdspark's bf16 serving copy")
    ap.add_argument("--torch-compile", action="store_true", help="transformers' forward through torch.compile "
                                                                   "(dynamic shapes; compiled in the first calls)")
    ap.add_argument("--out", metavar="DIR", help="keep the built checkpoint: DIR/target, with the shipped "
                    "tokenizer (for `python -m jdspark.serve --checkpoint DIR` and `transformers serve DIR/target`)")
    ap.add_argument("--json", action="store_true", help="print one JSON object on one line")
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes: each of {list(MODES)}, got {a.modes!r}")
    for flag, v, low in (("--prompt-len", a.prompt_len, 1), ("--new-tokens", a.new_tokens, 2),
                         ("--rounds", a.rounds, 1), ("--threads", a.threads, 1)):
        if v < low:
            ap.error(f"{flag}: expected >= {low}, got {v}")
    if a.checkpoint and not os.path.isdir(a.checkpoint):
        ap.error(f"--checkpoint {a.checkpoint}: not a directory")
    if a.checkpoint and a.out:
        ap.error("--out: keeps the checkpoint built without --checkpoint; not with it")
    if a.out and os.path.exists(os.path.join(a.out, "target")):
        ap.error(f"--out {a.out}: {a.out}/target exists already (nothing is overwritten)")

    import parity
    import torch
    import transformers

    import kimi

    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = a.checkpoint or build_shipped_scale(os.path.join(a.out or tmp, "target"), seed=a.seed)
        hf, ours = parity.load_pair(ckpt)
        if a.dtype == "bfloat16":  # each as it serves in bf16 (see the module docstring)
            hf = hf.to(torch.bfloat16)
            ours = kimi.load_checkpoint(ckpt, dtype="float32", config_overrides={"serving_dtype": "bfloat16"})
    if a.torch_compile:
        hf.forward = torch.compile(hf.forward, dynamic=True)
    cfg = ours.config
    prompt = np.random.default_rng(a.seed).integers(0, cfg.vocab_size, size=(1, a.prompt_len)).astype(np.int32)
    result = {"checkpoint": a.checkpoint or "random KimiLinear at the shipped target's scale",
              "parameters": int(sum(p.numel() for p in hf.parameters())), "prompt_len": a.prompt_len,
              "new_tokens": a.new_tokens, "rounds": a.rounds, "torch_threads": torch.get_num_threads(),
              "torch_compile": a.torch_compile, "dtype": a.dtype,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}
    result.update(compare(hf, ours, prompt, a.new_tokens, a.rounds, modes, a.seed))
    if a.json:
        print(json.dumps(result, separators=(",", ":")))
    else:
        for k, v in result.items():
            print(f"{k:26s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
