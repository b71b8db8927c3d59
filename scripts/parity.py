#!/usr/bin/env python
"""JAX (kimi) vs PyTorch (transformers' native KimiLinear, FLA's naive KDA) on the same checkpoint, CPU fp32.

    python scripts/parity.py --self-test --json         # builds a tiny random transformers checkpoint first
    python scripts/parity.py --checkpoint DIR --prompt-ids 1,2,3,4 --decode-steps 4 --greedy-tokens 32

What it reports
  * per_layer_hidden_max_abs_diff: max |ours - transformers| of the hidden state entering each layer
    (index 0 = embeddings, like transformers' ``hidden_states``). transformers' last entry (index L) is the
    *final-normed* hidden state (its ``last_hidden_state``), so ours at L is compared after ``model.norm``.
  * logits_max_abs_diff: prefill logits over the prompt.
  * decode_logits_max_abs_diff: transformers with ``use_cache=True`` fed one token at a time vs ``model.decode``,
    over ``--decode-steps`` tokens after the prompt (the same tokens for both).
  * greedy_match: transformers ``generate(do_sample=False)`` vs our prefill + decode loop over ``--greedy-tokens``.
  * kda_vs_fla_max_abs_diff: FLA's ``naive_recurrent_kda`` vs ``kimi.ops.kda.kda_chunked`` with an initial state
    (outputs and final state).
  * mxfp4_max_abs_diff: ``kimi.mxfp4.dequantize_gpt_oss`` vs transformers' ``convert_moe_packed_tensors`` (fp32).
``--json`` prints one JSON object on one line, last.

transformers has no AttnRes, LatentMoE, SiTU, lower-bound gate, full-rank gate, MLA output gate or MXFP4 experts
for kimi_linear: ``--checkpoint`` refuses a K3-style checkpoint with a message naming the features.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
for _p in (_ROOT, _ROOT / "scripts"):  # the repository (kimi) and this folder (fla_ref), however it is loaded
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from fla_ref import load_fla_naive  # noqa: E402

import kimi  # noqa: E402
from kimi import mxfp4  # noqa: E402
from kimi.ops import kda  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------
# the tiny random transformers checkpoint


def tiny_hf_config(q_lora_rank=None, **kw):
    """A small KimiLinearConfig with every kimi_linear feature: KDA and MLA layers (the last layer is KDA, so the
    MLA layer sits in the middle), a dense first layer, MoE with a shared expert and top-2 of 8."""
    from transformers import KimiLinearConfig

    base = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=q_lora_rank, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_shared_experts=1, num_local_experts=8, num_experts_per_tok=2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, first_k_dense_replace=1, initializer_range=0.1,
        routed_scaling_factor=2.446,
        linear_attn_config={"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 4],
                            "full_attn_layers": [3]},
    )
    base.update(kw)
    return KimiLinearConfig(**base)


def build_tiny_hf_checkpoint(out_dir, seed: int = 0, q_lora_rank=None, **kw) -> str:
    """``KimiLinearForCausalLM(tiny_hf_config())`` with random weights (fp32), written with ``save_pretrained``.
    The router's ``e_score_correction_bias`` (zeros at init) is randomised so the bias path is exercised."""
    import torch
    from transformers import KimiLinearForCausalLM

    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(tiny_hf_config(q_lora_rank=q_lora_rank, **kw)).float().eval()
    with torch.no_grad():
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.normal_(0.0, 0.1)
    model.save_pretrained(out_dir)
    return os.fspath(out_dir)


# ---------------------------------------------------------------------------------------------------------------
# the two models


def _unsupported_by_transformers(cfg) -> list:
    feats = {
        "attn_res_block_size (AttnRes)": cfg.attn_res_block_size is not None,
        "routed_expert_hidden_size (LatentMoE)": cfg.routed_expert_hidden_size is not None,
        "mla_use_output_gate": cfg.mla_use_output_gate,
        "kda_use_full_rank_gate": cfg.kda_use_full_rank_gate,
        "kda_gate_lower_bound": cfg.kda_gate_lower_bound is not None,
        "hidden_act situ": cfg.hidden_act != "silu",
        "expert_format mxfp4": cfg.expert_format != "dense",
        "RoPE MLA (mla_use_nope false)": not cfg.mla_use_nope,
        "top-1 routing with renormalisation (transformers renormalises, the official code does not)":
            cfg.num_experts_per_token == 1 and cfg.moe_renormalize,
    }
    return [k for k, v in feats.items() if v]


def load_pair(ckpt_dir):
    """(transformers model fp32 eager, our model fp32) from one checkpoint directory."""
    import torch
    from transformers import KimiLinearForCausalLM


    ours = kimi.load_checkpoint(ckpt_dir, dtype="float32")
    bad = _unsupported_by_transformers(ours.config)
    if bad:
        raise SystemExit(f"parity.py: {ckpt_dir} uses features transformers' KimiLinear lacks: {', '.join(bad)}")
    hf, info = KimiLinearForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32, attn_implementation="eager",
                                                     output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise SystemExit(f"parity.py: transformers could not load {ckpt_dir} cleanly: {problems}")
    return hf.eval(), ours


def _maxdiff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def our_greedy(model, prompt_1T, n: int) -> list:
    """Greedy tokens from our prefill + decode loop (batch 1)."""
    cache = model.init_cache(1, prompt_1T.shape[1] + n + 1)
    out = model.prefill(np.asarray(prompt_1T, np.int32), cache)
    tok = int(np.argmax(np.asarray(out.logits)[0, -1]))
    toks = [tok]
    cache = out.cache
    for _ in range(n - 1):
        out = model.decode(np.asarray([tok], np.int32), cache)
        cache = out.cache
        tok = int(np.argmax(np.asarray(out.logits)[0]))
        toks.append(tok)
    return toks


def hf_generate(hf, prompt_1T, n: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                stop_at_eos: bool = False) -> list:
    """transformers' ``generate`` of ``n`` new tokens: greedy at temperature 0, else sampled (top-k off); all n
    (EOS not ending it) unless ``stop_at_eos`` (the checkpoint's generation_config's EOS ends it)."""
    import torch
    from transformers import GenerationConfig

    sample = temperature > 0
    gen = GenerationConfig(do_sample=sample, temperature=temperature if sample else None,
                           top_p=top_p if sample else None, top_k=0 if sample else None, max_new_tokens=n,
                           min_new_tokens=0 if stop_at_eos else n, eos_token_id=None,
                           pad_token_id=hf.config.pad_token_id, use_cache=True)
    ids = torch.as_tensor(np.asarray(prompt_1T), dtype=torch.long)
    torch.manual_seed(seed)
    with torch.no_grad():  # an explicit mask: otherwise generate() masks prompt tokens equal to pad_token_id
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    return out[0, prompt_1T.shape[1]:].tolist()


def hf_greedy(hf, prompt_1T, n: int) -> list:
    """transformers' greedy tokens, ended by the checkpoint's EOS as its generate ends them by default."""
    return hf_generate(hf, prompt_1T, n, stop_at_eos=True)


def compare_models(hf, ours, prompt_1T, decode_steps: int = 4, greedy_tokens: int = 32, seed: int = 0) -> dict:
    import torch

    cfg = ours.config
    L, T = cfg.num_hidden_layers, prompt_1T.shape[1]
    ids = torch.as_tensor(np.asarray(prompt_1T), dtype=torch.long)
    cont = np.random.default_rng(seed + 1).integers(0, cfg.vocab_size, size=(decode_steps,))

    # prefill: logits and the hidden state entering every layer
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True, use_cache=True)
    ref_hidden = [h.float().numpy() for h in ref.hidden_states]
    cache = ours.init_cache(1, T + decode_steps + 1)
    out = ours.prefill(np.asarray(prompt_1T, np.int32), cache, tap_layers=tuple(range(L + 1)))
    taps = np.asarray(out.taps).reshape(1, T, L + 1, cfg.hidden_size)
    per_layer = []
    for l in range(L + 1):
        mine = taps[:, :, l]
        if l == L:  # transformers' last hidden_states entry is after the final norm
            mine = np.asarray(ours.model.norm(jnp.asarray(mine)))
        per_layer.append(_maxdiff(mine, ref_hidden[l]))
    logits_diff = _maxdiff(out.logits, ref.logits.float().numpy())

    # step decode, teacher-forced with the same tokens
    dec = []
    past, c = ref.past_key_values, out.cache
    for j in range(decode_steps):
        with torch.no_grad():
            r = hf(torch.as_tensor([[int(cont[j])]]), past_key_values=past, use_cache=True)
        past = r.past_key_values
        o = ours.decode(np.asarray([cont[j]], np.int32), c)
        c = o.cache
        dec.append(_maxdiff(o.logits, r.logits[:, -1].float().numpy()))

    # greedy generation
    g_hf = hf_greedy(hf, prompt_1T, greedy_tokens)
    g_ours = our_greedy(ours, prompt_1T, greedy_tokens)
    first_diff = next((i for i, (a, b) in enumerate(zip(g_hf, g_ours)) if a != b), None)
    return {
        "logits_max_abs_diff": logits_diff,
        "decode_logits_max_abs_diff": max(dec) if dec else 0.0,
        "greedy_match": g_hf == g_ours,
        "greedy_tokens": greedy_tokens,
        "greedy_first_mismatch": first_diff,
        "per_layer_hidden_max_abs_diff": per_layer,
        "prompt_len": T,
        "decode_steps": decode_steps,
    }


# ---------------------------------------------------------------------------------------------------------------
# op-level references


def kda_vs_fla(seed: int = 0) -> float:
    """FLA ``naive_recurrent_kda`` vs ``kimi.ops.kda.kda_chunked`` (chunk 16, T = 37 so the last chunk is
    partial, K=16 != V=8, a non-zero initial state): max abs diff over outputs and final states."""
    import torch


    B, T, H, K, V = 2, 37, 3, 16, 8
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    q = kda.l2norm(jax.random.normal(ks[0], (B, T, H, K)))
    k = kda.l2norm(jax.random.normal(ks[1], (B, T, H, K)))
    v = jax.random.normal(ks[2], (B, T, H, V))
    g = kda.kda_gate_lower_bound(jax.random.normal(ks[3], (B, T, H, K)), 0.5 * jax.random.normal(ks[4], (H,)),
                                 0.5 * jax.random.normal(ks[5], (H, K)), -5.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[6], (B, T, H)))
    S0 = 0.5 * jax.random.normal(ks[7], (B, H, K, V))
    o, S = jax.jit(kda.kda_chunked, static_argnames=("chunk_size",))(q, k, v, g, beta, S0, chunk_size=16)

    def t(x):
        return torch.from_numpy(np.array(x, dtype=np.float32))

    o_ref, S_ref = load_fla_naive().naive_recurrent_kda(*map(t, (q, k, v, g, beta)), initial_state=t(S0),
                                                        output_final_state=True)
    return max(_maxdiff(o, o_ref.numpy()), _maxdiff(S, S_ref.numpy()))


def mxfp4_vs_transformers(seed: int = 0) -> float:
    """``kimi.mxfp4.dequantize_gpt_oss`` vs transformers' ``convert_moe_packed_tensors`` (fp32, every code and
    scales 100..150, where fp32 is exact): max abs diff (0 means bit-exact values)."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors


    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(3, 8, 4, 16), dtype=np.uint8)
    scales = rng.integers(100, 151, size=(3, 8, 4), dtype=np.uint8)
    ref_EIO = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                         dtype=torch.float32).numpy()
    ours_EOI = np.asarray(mxfp4.dequantize_gpt_oss(blocks, scales))
    if ours_EOI.swapaxes(-1, -2).shape != ref_EIO.shape:
        return float("inf")
    return _maxdiff(ours_EOI.swapaxes(-1, -2), ref_EIO)


# ---------------------------------------------------------------------------------------------------------------


def _prompt(args, vocab: int) -> np.ndarray:
    if args.prompt_ids:
        ids = [int(x) for x in args.prompt_ids.replace(" ", "").split(",") if x]
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad or not ids:
            raise SystemExit(f"parity.py: --prompt-ids {bad or 'empty'} outside the vocabulary [0, {vocab})")
        return np.asarray([ids], np.int32)
    return np.random.default_rng(args.seed).integers(0, vocab, size=(1, args.prompt_len)).astype(np.int32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="an HF-format Kimi-Linear checkpoint directory")
    src.add_argument("--self-test", action="store_true", help="build a tiny random transformers checkpoint first")
    ap.add_argument("--prompt-ids", default="", help="comma-separated token ids (default: random, --seed)")
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decode-steps", type=int, default=4)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--json", action="store_true", help="print one JSON object on one line")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)  # the reference runs hundreds of tiny ops; one thread next to XLA's is faster
    t0 = time.time()
    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint
        if args.self_test:
            ckpt = build_tiny_hf_checkpoint(os.path.join(tmp, "tiny_kimi_linear"), seed=args.seed)
        if not os.path.isdir(ckpt):
            raise SystemExit(f"parity.py: --checkpoint {ckpt} is not a directory")
        hf, ours = load_pair(ckpt)
        result["checkpoint"] = "self-test (tiny random transformers KimiLinear)" if args.self_test else ckpt
        result.update(compare_models(hf, ours, _prompt(args, ours.config.vocab_size), args.decode_steps,
                                     args.greedy_tokens, args.seed))
    result["kda_vs_fla_max_abs_diff"] = kda_vs_fla(args.seed)
    result["mxfp4_max_abs_diff"] = mxfp4_vs_transformers(args.seed)
    result["seconds"] = round(time.time() - t0, 2)

    if args.json:
        print(json.dumps(result, separators=(",", ":")))
    else:
        for k, v in result.items():
            if k == "per_layer_hidden_max_abs_diff":
                print(f"{k}:")
                for i, d in enumerate(v):
                    print(f"  layer {i:3d} input{' (final norm)' if i == len(v) - 1 else ''}: {d:.3e}")
            else:
                print(f"{k:32s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
