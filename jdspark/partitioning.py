"""The logical axes of the drafter's own parameters and cache (speculators' names); ``sharding/rules.py`` maps them
to mesh axes. Keys are parameter paths without the layer index (every draft layer is laid out alike)."""

from __future__ import annotations

from kimi.partitioning import path_parts

PARAM_AXES: dict[str, tuple] = {
    "fc.kernel": ("draft_taps", None),
    "layers.self_attn.q_proj.kernel": (None, "draft_heads"),
    "layers.self_attn.q_proj.bias": ("draft_heads",),
    "layers.self_attn.k_proj.kernel": (None, "draft_kv_heads"),
    "layers.self_attn.k_proj.bias": ("draft_kv_heads",),
    "layers.self_attn.v_proj.kernel": (None, "draft_kv_heads"),
    "layers.self_attn.v_proj.bias": ("draft_kv_heads",),
    "layers.self_attn.o_proj.kernel": ("draft_heads", None),
    "layers.self_attn.o_proj.bias": (None,),
    "layers.mlp.gate_proj.kernel": (None, "draft_mlp"),
    "layers.mlp.up_proj.kernel": (None, "draft_mlp"),
    "layers.mlp.down_proj.kernel": ("draft_mlp", None),
    "markov_head.markov_w1.embedding": ("vocab", None),
    "markov_head.markov_w2.kernel": (None, "vocab"),
    "markov_head.markov_w2.bias": ("vocab",),
    "markov_head.gate_proj.kernel": (None, None), "markov_head.gate_proj.bias": (None,),
    "markov_head.joint_proj.kernel": (None, None), "markov_head.joint_proj.bias": (None,),
    "confidence_head.proj.kernel": (None, None), "confidence_head.proj.bias": (None,),
}

# DrafterCache fields -> logical axes per dimension
CACHE_AXES: dict[str, tuple] = {
    "k": (None, "batch", "draft_kv_heads", None, "cache_seq"),  # [L, B, KVh, hd, S]
    "v": (None, "batch", "draft_kv_heads", "cache_seq", None),  # [L, B, KVh, S, hd]
    "length": (),
}


def canonical_key(path) -> str:
    """The ``PARAM_AXES`` key of a drafter parameter path: the path without the layer index."""
    parts = path_parts(path)
    return ".".join(p for i, p in enumerate(parts) if not (i > 0 and parts[i - 1] == "layers" and p.isdigit()))
