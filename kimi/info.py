"""Parameter counts of a preset from ``jax.eval_shape`` of the real modules (nothing is allocated).

  python -m kimi.info --preset k3 --json

Packed MXFP4 experts count two parameters per code byte; their E8M0 scales are storage, not parameters.
Active parameters per token = everything except the routed experts, plus top_k / num_experts of them.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from flax import nnx

from kimi.config import KimiConfig
from kimi.model import abstract_model

PRESETS = ("k3", "kimi_linear_48b", "demo", "tiny")


def _part(path: tuple) -> str:
    p = [str(x) for x in path]
    if p[0] in ("vision_tower", "mm_projector"):
        return "vision"
    if p[0] == "lm_head":
        return "lm_head"
    if "embed_tokens" in p:
        return "embedding"
    if "experts" in p and "shared_experts" not in p:
        return "routed_experts"
    if "shared_experts" in p:
        return "shared_experts"
    if "block_sparse_moe" in p:
        return "moe_other"  # router, latent down/up projections and norm
    if "mlp" in p:
        return "dense_mlp"
    if "self_attn" in p:
        return "kda" if _is_kda(p) else "mla"
    return "norms_and_attn_res"


_KDA_LAYERS: set = set()


def _is_kda(p) -> bool:
    return int(p[p.index("layers") + 1]) in _KDA_LAYERS


def param_counts(cfg: KimiConfig) -> dict:
    """{'total_params', 'active_params_per_token', 'vision_params', 'by_part': {...}, 'bytes': ...} from abstract
    shapes. total_params counts the vision tower and projector too; active_params_per_token is per text token
    (the vision tower runs once per image, not per token)."""
    global _KDA_LAYERS
    _KDA_LAYERS = {i for i, k in enumerate(cfg.layer_kinds) if k == "kda"}
    state = nnx.state(abstract_model(cfg))
    by_part: dict[str, int] = {}
    total_bytes = 0
    for path, leaf in nnx.to_flat_state(state):
        name = str(path[-1])
        n = int(np.prod(leaf.shape)) if leaf.shape else 1
        total_bytes += n * np.dtype(leaf.dtype).itemsize
        if name.endswith("_scale"):
            continue
        if name.endswith("_packed"):
            n *= 2
        part = _part(path)
        by_part[part] = by_part.get(part, 0) + n
    total = sum(by_part.values())
    routed = by_part.get("routed_experts", 0)
    frac = cfg.num_experts_per_token / cfg.num_experts if cfg.num_experts else 0.0
    vision = by_part.get("vision", 0)
    active = total - vision - routed + int(round(routed * frac))
    return {"total_params": total, "active_params_per_token": active, "vision_params": vision,
            "text_params": total - vision, "by_part": dict(sorted(by_part.items())), "param_bytes": total_bytes}


def info(cfg: KimiConfig, preset: str = "") -> dict:
    counts = param_counts(cfg)
    return {
        "preset": preset,
        **{k: counts[k] for k in ("total_params", "active_params_per_token", "text_params", "vision_params")},
        "num_layers": cfg.num_hidden_layers,
        "kda_layers": cfg.num_kda_layers,
        "mla_layers": cfg.num_mla_layers,
        "moe_layers": sum(k == "moe" for k in cfg.ffn_kinds),
        "attn_res_blocks": cfg.num_attn_res_blocks,
        "expert_format": cfg.expert_format,
        "param_bytes": counts["param_bytes"],
        "mla_cache_values_per_token_per_layer": cfg.mla_cache_dim,
        "by_part": counts["by_part"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kimi.info", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=PRESETS, default="k3")
    ap.add_argument("--json", action="store_true", help="print one JSON object on one line")
    a = ap.parse_args(argv)
    cfg = getattr(KimiConfig, a.preset)()
    out = info(cfg, a.preset)
    if a.json:
        print(json.dumps(out, separators=(",", ":")))
    else:
        for k, v in out.items():
            if k != "by_part":
                print(f"{k:40s} {v:,}" if isinstance(v, int) else f"{k:40s} {v}")
        for k, v in out["by_part"].items():
            print(f"  {k:38s} {v:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
