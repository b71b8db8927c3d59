"""What the target model declares about its own partitioning: the logical axes of every parameter and cache field,
and the one hook (``Partitioner``) through which its layers learn of a sharding plan.

The model names logical axes only (``"kda_heads"``, ``"vocab"``, ``"batch"`` ...), never mesh axes; the table that
maps logical axes to mesh axes, and the mapping logic, live in ``sharding/rules.py``. ``sharding.shard_model``
places the parameters and installs a plan with ``KimiForCausalLM.set_partitioner``; without one every hook below
is the identity and the model runs on one device.

Parameter keys (``PARAM_AXES``) are canonical: the parameter's path with the layer index replaced by the layer's
kind (``"kda."`` / ``"mla."`` for self_attn, ``"moe."`` for block_sparse_moe, ``"mlp."`` for the dense MLP,
``"layer."`` for a layer's norms and AttnRes sites). Norm gains and AttnRes pseudo-queries are replicated by one
pattern (``REPLICATED``); a parameter that matches nothing is an error, so a new parameter needs a deliberate entry
(and the golden snapshot in ``tests/sharding/`` shows the change).
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

import jax.numpy as jnp
from flax import nnx


class Partitioner:
    """No sharding plan: every hook is the identity. ``sharding.ShardingPlan`` subclasses it. Instances are
    static module attributes (part of the NNX graphdef), so they are hashable and compare by value."""

    sharded = False

    def constrain(self, x, logical_axes):
        """``x`` constrained (inside a jit) to the sharding of its logical axes."""
        return x

    def constrain_cache(self, cache):
        """The cache with every field constrained to its rule's sharding (inside a jit)."""
        return cache

    def routed_experts(self, experts, z_TD, w_TX, idx_TX):
        """The routed experts' output when the plan runs them (expert parallel), else None (run them locally)."""
        return None

    def place(self, tokens, cache):
        """Host tokens and a cache placed where the model's parameters are (before a jitted call)."""
        return tokens, cache

    def replicate(self, host):
        """A host array as a device array on every device of the plan."""
        return jnp.asarray(host)


NO_PARTITION = Partitioner()


def set_partitioner(root, partition: Partitioner):
    """Install ``partition`` on every module under ``root`` (itself included) that declares the hook (a
    ``partition`` attribute set in its constructor); ``NO_PARTITION`` removes a plan."""
    for _, module in nnx.iter_modules(root):
        if isinstance(getattr(module, "partition", None), Partitioner):
            module.partition = partition

_COL = (None, "kda_heads")
PARAM_AXES: dict[str, tuple] = {
    # embeddings and head
    "embed_tokens.embedding": ("vocab", None),
    "lm_head.kernel": (None, "vocab"),
    # Kimi Delta Attention
    "kda.q_proj.kernel": _COL, "kda.k_proj.kernel": _COL, "kda.v_proj.kernel": _COL, "kda.g_proj.kernel": _COL,
    # conv kernels [P, 4]: replicated, like the conv state (the q|k|v conv runs on the gathered projections)
    "kda.q_conv1d": (None, None), "kda.k_conv1d": (None, None), "kda.v_conv1d": (None, None),
    "kda.f_a_proj.kernel": (None, None), "kda.f_b_proj.kernel": _COL,
    "kda.g_a_proj.kernel": (None, None), "kda.g_b_proj.kernel": _COL,
    "kda.A_log": (None,),  # [H] (or 128 zero-padded in checkpoints): tiny, replicated
    "kda.dt_bias": ("kda_heads",),
    "kda.b_proj.kernel": (None, "kda_heads"),
    "kda.o_proj.kernel": ("kda_heads", None),
    # gated MLA
    "mla.q_proj.kernel": (None, "mla_heads"),
    "mla.q_a_proj.kernel": (None, None),
    "mla.q_b_proj.kernel": (None, "mla_heads"),
    "mla.kv_a_proj_with_mqa.kernel": (None, None),
    "mla.kv_b_proj.kernel": (None, "mla_heads"),
    "mla.o_proj.kernel": ("mla_heads", None),
    "mla.g_proj.kernel": (None, "mla_heads"),
    # dense MLP (first_k_dense_replace layers)
    "mlp.gate_proj.kernel": (None, "mlp_hidden"), "mlp.up_proj.kernel": (None, "mlp_hidden"),
    "mlp.down_proj.kernel": ("mlp_hidden", None),
    # LatentMoE
    "moe.gate.weight": ("router", None), "moe.gate.e_score_correction_bias": ("router",),
    "moe.routed_expert_down_proj.kernel": (None, "moe_latent"),
    "moe.routed_expert_up_proj.kernel": ("moe_latent", None),
    "moe.shared_experts.gate_proj.kernel": (None, "mlp_hidden"),
    "moe.shared_experts.up_proj.kernel": (None, "mlp_hidden"),
    "moe.shared_experts.down_proj.kernel": ("mlp_hidden", None),
}
# routed experts: [E, out, in], dense or MXFP4 (codes [E, out, in/2] + E8M0 scales [E, out, in/32])
for _w, _axes in (("w1", ("experts", "expert_hidden", None)), ("w3", ("experts", "expert_hidden", None)),
                  ("w2", ("experts", None, "expert_hidden"))):
    for _suffix in ("", "_packed", "_scale"):
        PARAM_AXES[f"moe.experts.{_w}{_suffix}"] = _axes
# the vision tower and projector (KimiConfig.vision): replicated. Keys drop the block index ("vision.blocks.wqkv
# .kernel"). ~0.4B parameters in K3 (0.015% of the model); its fused q|k|v would not split by heads contiguously.
for _p in ("patch_embed.proj.kernel", "patch_embed.proj.bias", "patch_embed.pos_emb.weight", "blocks.wqkv.kernel",
           "blocks.wqkv.bias", "blocks.wo.kernel", "blocks.wo.bias", "blocks.mlp.fc0.kernel", "blocks.mlp.fc0.bias",
           "blocks.mlp.fc1.kernel", "blocks.mlp.fc1.bias", "blocks.norm0.weight", "blocks.norm0.bias",
           "blocks.norm1.weight", "blocks.norm1.bias", "final_layernorm.bias", "projector.pre_norm.bias",
           "projector.proj0.kernel", "projector.proj0.bias",
           "projector.proj2.kernel", "projector.proj2.bias"):
    PARAM_AXES[f"vision.{_p}"] = (None,) * (3 if _p.endswith("pos_emb.weight") else 2 if _p.endswith("kernel") else 1)
# norm gains and AttnRes pseudo-queries: [dim] or [D, 1], replicated
REPLICATED = re.compile(r"(^|\.)(\w*norm\.(weight|scale)|\w*_res_proj\.kernel)$")

# KimiCache fields -> logical axes per dimension
CACHE_AXES: dict[str, tuple] = {
    "kda_state": (None, "batch", "kda_heads", None, None),  # [n_kda, B, H, K, V] fp32
    # [n_kda, B, W, 3P]: q|k|v side by side, so a contiguous split of 3P would not match the heads
    "conv_state": (None, "batch", None, None),
    "mla_ckv": (None, "batch", "cache_seq", "mla_latent"),  # [n_mla, B, S, L]
    "mla_kpe": (None, "batch", "cache_seq", None),  # [n_mla, B, S, R]
    "length": ("batch",),
}


def path_parts(path) -> list[str]:
    """A parameter path (an NNX path tuple or a dotted string) as a list of strings."""
    if isinstance(path, str):
        return path.split(".")
    return [str(getattr(p, "key", p)) for p in path]


def canonical_key(path, layer_kinds: Optional[Sequence[str]] = None) -> str:
    """The ``PARAM_AXES`` key of a target parameter path (tuple or dotted string)."""
    parts = path_parts(path)
    if parts[0] in ("vision_tower", "mm_projector"):
        rest = parts[1:]
        if rest[:2] == ["encoder", "blocks"]:
            rest = ["blocks"] + rest[3:]
        elif rest[:1] == ["encoder"]:
            rest = rest[1:]
        return "vision." + ".".join(rest if parts[0] == "vision_tower" else ["projector"] + rest)
    if parts[0] == "model":
        parts = parts[1:]
    if len(parts) >= 3 and parts[0] == "layers" and parts[1].isdigit():
        i, sub = int(parts[1]), parts[2:]
        if sub[0] == "self_attn":
            if layer_kinds is None:
                raise ValueError(f"{'.'.join(path_parts(path))}: the layer kinds (config) are needed to tell KDA "
                                 "from MLA")
            return f"{layer_kinds[i]}." + ".".join(sub[1:])
        if sub[0] == "block_sparse_moe":
            return "moe." + ".".join(sub[1:])
        if sub[0] == "mlp":
            return "mlp." + ".".join(sub[1:])
        return "layer." + ".".join(sub)
    return ".".join(parts)
