"""KimiConfig: one frozen dataclass for Kimi K3, Kimi-Linear and the small presets.

Field names follow the published HF ``config.json`` where one exists (``text_config`` of K3, Kimi-Linear's top
level, ``linear_attn_config``). Layer lists ``kda_layers`` / ``full_attn_layers`` are **1-based**, as published.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any, Literal, Optional

import jax.numpy as jnp

from kimi.jsonfile import read_json_object
from kimi.vision_config import VisionConfig

ActName = Literal["situ", "silu"]


class FrozenConfig:
    """What the frozen config dataclasses (``KimiConfig``, ``jdspark.DSparkConfig``) share: ``dtype`` from the
    ``param_dtype`` name, and ``replace`` (a validated copy with some fields changed)."""

    @property
    def dtype(self):
        return jnp.dtype(self.param_dtype)

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class KimiConfig(FrozenConfig):
    # vocabulary and width
    vocab_size: int = 512
    hidden_size: int = 64
    num_hidden_layers: int = 3
    # 1-based layer lists (the published convention); together they must cover 1..num_hidden_layers exactly once
    kda_layers: tuple[int, ...] = (1, 3)
    full_attn_layers: tuple[int, ...] = (2,)
    # MLA
    num_attention_heads: int = 4
    q_lora_rank: Optional[int] = 32
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    mla_lora_norm_eps: float = 1e-6  # official code builds q_a/kv_a layernorms with the default eps
    rope_theta: float = 10000.0
    # KDA
    kda_num_heads: int = 4
    kda_head_dim: int = 16
    short_conv_kernel_size: int = 4
    kda_use_full_rank_gate: bool = True  # output gate: full rank g_proj (K3) or g_a/g_b low rank (Kimi-Linear)
    kda_gate_lower_bound: Optional[float] = -5.0  # K3's sigmoid gate; None -> Kimi-Linear's softplus gate
    kda_chunk_size: int = 16
    # prefill form of KDA: "chunked" (WY form, the GPU/TPU path), "recurrent" (a scan over tokens), or "auto":
    # recurrent on CPU, where XLA runs the small per-token scan far faster than the chunk algebra
    kda_prefill: Literal["auto", "chunked", "recurrent"] = "auto"
    # MoE
    num_experts: int = 8
    num_experts_per_token: int = 2
    num_shared_experts: int = 1
    moe_intermediate_size: int = 32
    routed_expert_hidden_size: Optional[int] = 48  # LatentMoE latent width; None -> experts act on hidden_size
    latent_moe_use_norm: bool = True
    intermediate_size: int = 96  # dense MLP of the first_k_dense_replace layers
    first_k_dense_replace: int = 1
    num_expert_group: int = 1
    topk_group: int = 1
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    expert_format: Literal["dense", "mxfp4"] = "dense"  # routed experts held as float arrays or packed MXFP4
    # activation
    hidden_act: ActName = "situ"
    activation_situ_beta: Optional[float] = 4.0
    activation_situ_linear_beta: Optional[float] = 25.0
    # depth mixing: Block AttnRes with blocks of this many layers; None -> plain residual (Kimi-Linear)
    attn_res_block_size: Optional[int] = 2
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # special tokens
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0
    # runtime choices
    param_dtype: str = "float32"
    kernels: Literal["xla", "pallas"] = "xla"
    # the dtype of the serving copy's weights (kimi.model.with_serving_layout): bfloat16 = bf16 matmul inputs with
    # fp32 accumulation (kimi/ops/linear.py); norms, KDA state, attention, router and logits stay fp32
    serving_dtype: Literal["float32", "bfloat16"] = "float32"
    # the MoonViT vision tower and projector (kimi/vision.py); None for a text-only model
    vision: Optional[VisionConfig] = None

    # ------------------------------------------------------------------ validation
    def __post_init__(self):
        def bad(field: str, msg: str):
            raise ValueError(f"KimiConfig.{field}: {msg}")

        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                  "qk_nope_head_dim", "v_head_dim", "kda_num_heads", "kda_head_dim", "short_conv_kernel_size",
                  "intermediate_size", "kda_chunk_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                bad(f, f"expected a positive int, got {v!r}")
        if self.qk_rope_head_dim < 0:
            bad("qk_rope_head_dim", f"expected >= 0, got {self.qk_rope_head_dim}")
        L = self.num_hidden_layers
        object.__setattr__(self, "kda_layers", tuple(int(i) for i in self.kda_layers))
        object.__setattr__(self, "full_attn_layers", tuple(int(i) for i in self.full_attn_layers))
        for f in ("kda_layers", "full_attn_layers"):
            for i in getattr(self, f):
                if not 1 <= i <= L:
                    bad(f, f"layer {i} outside 1..{L} (lists are 1-based)")
        both = set(self.kda_layers) & set(self.full_attn_layers)
        if both:
            bad("kda_layers", f"layers {sorted(both)} are also in full_attn_layers")
        missing = set(range(1, L + 1)) - set(self.kda_layers) - set(self.full_attn_layers)
        if missing:
            bad("full_attn_layers", f"layers {sorted(missing)} are in neither kda_layers nor full_attn_layers")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            bad("q_lora_rank", f"expected None or a positive int, got {self.q_lora_rank}")
        if self.num_experts > 0:
            if not 1 <= self.num_experts_per_token <= self.num_experts:
                bad("num_experts_per_token", f"expected 1..num_experts={self.num_experts}, "
                    f"got {self.num_experts_per_token}")
            if self.num_experts % self.num_expert_group:
                bad("num_expert_group", f"{self.num_expert_group} does not divide num_experts={self.num_experts}")
            if not 1 <= self.topk_group <= self.num_expert_group:
                bad("topk_group", f"expected 1..num_expert_group={self.num_expert_group}, got {self.topk_group}")
            if self.moe_intermediate_size <= 0:
                bad("moe_intermediate_size", f"expected a positive int, got {self.moe_intermediate_size}")
        if not 0 <= self.first_k_dense_replace <= L:
            bad("first_k_dense_replace", f"expected 0..{L}, got {self.first_k_dense_replace}")
        if self.num_experts == 0 and self.first_k_dense_replace < L:
            bad("num_experts", "0 experts needs first_k_dense_replace == num_hidden_layers")
        if self.routed_expert_hidden_size is not None and self.routed_expert_hidden_size <= 0:
            bad("routed_expert_hidden_size", f"expected None or positive, got {self.routed_expert_hidden_size}")
        if self.hidden_act not in ("situ", "silu"):
            bad("hidden_act", f"expected 'situ' or 'silu', got {self.hidden_act!r}")
        if self.attn_res_block_size is not None and self.attn_res_block_size <= 0:
            bad("attn_res_block_size", f"expected None or positive, got {self.attn_res_block_size}")
        if self.kda_gate_lower_bound is not None and self.kda_gate_lower_bound >= 0:
            bad("kda_gate_lower_bound", f"expected a negative bound or None, got {self.kda_gate_lower_bound}")
        if self.expert_format not in ("dense", "mxfp4"):
            bad("expert_format", f"expected 'dense' or 'mxfp4', got {self.expert_format!r}")
        if self.expert_format == "mxfp4":
            for f in ("moe_intermediate_size",):
                if getattr(self, f) % 32:
                    bad(f, f"{getattr(self, f)} must be a multiple of 32 for MXFP4 experts")
            if self.expert_in_dim % 32:
                bad("routed_expert_hidden_size", f"expert input width {self.expert_in_dim} must be a multiple of 32"
                    " for MXFP4 experts")
        if self.kda_prefill not in ("auto", "chunked", "recurrent"):
            bad("kda_prefill", f"expected 'auto', 'chunked' or 'recurrent', got {self.kda_prefill!r}")
        if self.kernels not in ("xla", "pallas"):
            bad("kernels", f"expected 'xla' or 'pallas', got {self.kernels!r}")
        if self.serving_dtype not in ("float32", "bfloat16"):
            bad("serving_dtype", f"expected 'float32' or 'bfloat16', got {self.serving_dtype!r}")
        if self.param_dtype not in ("float32", "bfloat16"):
            bad("param_dtype", f"expected 'float32' or 'bfloat16', got {self.param_dtype!r}")
        for f in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, f)
            if v is not None and not 0 <= v < self.vocab_size:
                bad(f, f"{v} outside the vocabulary [0, {self.vocab_size})")
        if not self.mla_use_nope and self.qk_rope_head_dim % 2:
            bad("qk_rope_head_dim", "RoPE needs an even rope slice")
        if isinstance(self.vision, dict):
            object.__setattr__(self, "vision", VisionConfig.from_hf_config(self.vision))
        if self.vision is not None:
            if not isinstance(self.vision, VisionConfig):
                bad("vision", f"expected a VisionConfig or None, got {type(self.vision).__name__}")
            if not 0 <= self.vision.media_placeholder_token_id < self.vocab_size:
                bad("vision", f"media_placeholder_token_id {self.vision.media_placeholder_token_id} outside the "
                    f"vocabulary [0, {self.vocab_size})")

    # ------------------------------------------------------------------ derived
    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """'kda' or 'mla' per 0-based layer."""
        kda = set(self.kda_layers)
        return tuple("kda" if (i + 1) in kda else "mla" for i in range(self.num_hidden_layers))

    @property
    def ffn_kinds(self) -> tuple[str, ...]:
        """'dense' or 'moe' per 0-based layer."""
        return tuple("dense" if i < self.first_k_dense_replace else "moe" for i in range(self.num_hidden_layers))

    @property
    def num_kda_layers(self) -> int:
        return len(self.kda_layers)

    @property
    def num_mla_layers(self) -> int:
        return len(self.full_attn_layers)

    @property
    def kda_proj_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_dim(self) -> int:
        """Values cached per token per MLA layer: c_kv (kv_lora_rank) and k_pe (rope slice)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def expert_in_dim(self) -> int:
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def num_attn_res_blocks(self) -> int:
        """Sealed blocks the static buffer holds (the embedding counts as the first)."""
        if self.attn_res_block_size is None:
            return 0
        return -(-self.num_hidden_layers // self.attn_res_block_size)

    # ------------------------------------------------------------------ presets
    @classmethod
    def k3(cls, **kw) -> "KimiConfig":
        """The published Kimi K3 config (2.8T total, ~104B active), with its MoonViT3d vision tower."""
        L = 93
        mla = [i for i in range(4, 93, 4)] + [93]  # 1-based: 4, 8, ..., 88, 92, 93
        kda = [i for i in range(1, L + 1) if i not in mla]
        base = dict(
            vocab_size=163840, hidden_size=7168, num_hidden_layers=L, kda_layers=tuple(kda),
            full_attn_layers=tuple(mla), num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mla_use_nope=True, mla_use_output_gate=True,
            kda_num_heads=96, kda_head_dim=128, short_conv_kernel_size=4, kda_use_full_rank_gate=True,
            kda_gate_lower_bound=-5.0, kda_chunk_size=64, num_experts=896, num_experts_per_token=16,
            num_shared_experts=2, moe_intermediate_size=3072, routed_expert_hidden_size=3584,
            latent_moe_use_norm=True, intermediate_size=33792, first_k_dense_replace=1, num_expert_group=1,
            topk_group=1, moe_renormalize=True, routed_scaling_factor=1.0, expert_format="mxfp4", hidden_act="situ",
            activation_situ_beta=4.0, activation_situ_linear_beta=25.0, attn_res_block_size=12, rms_norm_eps=1e-5,
            bos_token_id=163584, eos_token_id=163586, pad_token_id=163839, param_dtype="bfloat16",
            vision=VisionConfig.k3(),
        )
        base.update(kw)
        return cls(**base)

    @classmethod
    def kimi_linear_48b(cls, **kw) -> "KimiConfig":
        """Kimi-Linear-48B-A3B: plain residual, SwiGLU, softplus decay gate, low-rank KDA output gate."""
        L = 27
        mla = [4, 8, 12, 16, 20, 24, 27]
        kda = [i for i in range(1, L + 1) if i not in mla]
        base = dict(
            vocab_size=163840, hidden_size=2304, num_hidden_layers=L, kda_layers=tuple(kda),
            full_attn_layers=tuple(mla), num_attention_heads=32, q_lora_rank=None, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mla_use_nope=True, mla_use_output_gate=False,
            kda_num_heads=32, kda_head_dim=128, short_conv_kernel_size=4, kda_use_full_rank_gate=False,
            kda_gate_lower_bound=None, kda_chunk_size=64, num_experts=256, num_experts_per_token=8,
            num_shared_experts=1, moe_intermediate_size=1024, routed_expert_hidden_size=None,
            latent_moe_use_norm=False, intermediate_size=9216, first_k_dense_replace=1, num_expert_group=1,
            topk_group=1, moe_renormalize=True, routed_scaling_factor=2.446, expert_format="dense", hidden_act="silu",
            activation_situ_beta=None, activation_situ_linear_beta=None, attn_res_block_size=None, rms_norm_eps=1e-5,
            bos_token_id=163584, eos_token_id=163585, pad_token_id=163839, param_dtype="bfloat16",
        )
        base.update(kw)
        return cls(**base)

    @classmethod
    def demo(cls, **kw) -> "KimiConfig":
        """Small K3-shaped model for the shipped default checkpoint (byte-level vocabulary, jdspark.data).

        Sized for scripts/train_target.py on a small CPU: 6 layers (KDA x4, MLA at 4 and 6, AttnRes blocks of 3),
        hidden 256, 8 experts top-2 + 1 shared (LatentMoE 128), ~5.2M parameters, ~11 MB exported with MXFP4
        experts (8 experts: a verify block touches every expert, and on CPU the MoE runs every row through every
        expert). KDA chunks of 16: on XLA:CPU the chunked form's triangular solve grows steeply with the chunk
        (docs/performance.md)."""
        base = dict(
            vocab_size=384, hidden_size=256, num_hidden_layers=6, kda_layers=(1, 2, 3, 5), full_attn_layers=(4, 6),
            num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
            v_head_dim=32, kda_num_heads=4, kda_head_dim=64, kda_chunk_size=16, num_experts=8,
            num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=128, routed_expert_hidden_size=128,
            intermediate_size=512, attn_res_block_size=3, expert_format="mxfp4", bos_token_id=256, eos_token_id=257,
            pad_token_id=259, param_dtype="float32",
        )
        base.update(kw)
        return cls(**base)

    @classmethod
    def tiny(cls, **kw) -> "KimiConfig":
        """Every feature on, seconds to compile: 3 layers (KDA, MLA, KDA: both orders of the two attentions),
        LatentMoE with shared experts after a dense first layer, AttnRes with an odd layer count (the last block is
        partial). Three, not five: XLA's compile time grows with the layers, and the test suite is mostly compiles
        (fortieth session: a cold 2-worker run 757 s -> ~700 s)."""
        return cls(**kw)

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf_config(cls, path_or_dict: Any, **overrides) -> "KimiConfig":
        """Read an HF ``config.json`` (a path to the file or its folder, or a dict): K3's nested ``text_config``,
        Kimi-Linear's top level, ``linear_attn_config``, and DeepSeek-V3 aliases."""
        if isinstance(path_or_dict, (str, os.PathLike)):
            p = os.fspath(path_or_dict)
            if os.path.isdir(p):
                p = os.path.join(p, "config.json")
            if not os.path.isfile(p):
                raise ValueError(f"config.json not found at {p}")
            raw = read_json_object(p)
        elif isinstance(path_or_dict, dict):
            raw = dict(path_or_dict)
        else:
            raise ValueError(f"from_hf_config: expected a path or a dict, got {type(path_or_dict).__name__}")
        top = raw
        if "text_config" in raw and isinstance(raw["text_config"], dict):
            raw = dict(raw["text_config"])
            for k in ("bos_token_id", "eos_token_id", "pad_token_id", "quantization_config"):
                if k not in raw and k in top:
                    raw[k] = top[k]
        fields = _hf_to_fields(raw)
        fields["vision"] = VisionConfig.from_hf_config(top.get("vision_config") or {}, top)
        return cls(**{**fields, **overrides})  # overrides win over config.json

    def to_hf_config(self) -> dict:
        """The HF ``config.json`` dict (Kimi-Linear layout; ``model_type`` kimi_linear), read back by
        ``from_hf_config``."""
        d = {
            "model_type": "kimi_linear",
            "architectures": ["KimiLinearForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": self.mla_use_nope,
            "mla_use_output_gate": self.mla_use_output_gate,
            "mla_lora_norm_eps": self.mla_lora_norm_eps,
            "rope_theta": self.rope_theta,
            "linear_attn_config": {
                "num_heads": self.kda_num_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.short_conv_kernel_size,
                "kda_layers": list(self.kda_layers),
                "full_attn_layers": list(self.full_attn_layers),
                "use_full_rank_gate": self.kda_use_full_rank_gate,
                "gate_lower_bound": self.kda_gate_lower_bound,
            },
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "routed_expert_hidden_size": self.routed_expert_hidden_size,
            "latent_moe_use_norm": self.latent_moe_use_norm,
            "intermediate_size": self.intermediate_size,
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": 1,
            "moe_router_activation_func": "sigmoid",
            "num_expert_group": self.num_expert_group,
            "topk_group": self.topk_group,
            "moe_renormalize": self.moe_renormalize,
            "routed_scaling_factor": self.routed_scaling_factor,
            "hidden_act": self.hidden_act,
            "activation_situ_beta": self.activation_situ_beta,
            "activation_situ_linear_beta": self.activation_situ_linear_beta,
            "attn_res_block_size": self.attn_res_block_size,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "kda_chunk_size": self.kda_chunk_size,
            "torch_dtype": self.param_dtype,
        }
        if self.expert_format == "mxfp4":
            d["quantization_config"] = {
                "quant_method": "compressed-tensors",
                "format": "mxfp4-pack-quantized",
                "config_groups": {"group_0": {"format": "mxfp4-pack-quantized",
                                              "weights": {"num_bits": 4, "group_size": 32, "type": "float"},
                                              "targets": ["Linear"]}},
                "ignore": ["re:.*shared_experts.*"],
            }
        if self.vision is not None:
            d["vision_config"] = self.vision.to_hf_config()
            d["media_placeholder_token_id"] = self.vision.media_placeholder_token_id
            d["projection_layer_norm_eps"] = self.vision.projector_eps
        return d


# HF / DeepSeek-V3 alias -> KimiConfig field
_ALIASES = {
    "n_routed_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "n_group": "num_expert_group",
    "norm_topk_prob": "moe_renormalize",
    "dense_ffn_hidden": "intermediate_size",
}
# keys in HF configs that carry no information for this implementation
_IGNORED = {
    "model_type", "architectures", "transformers_version", "auto_map", "num_key_value_heads", "torch_dtype", "dtype",
    "max_position_embeddings", "initializer_range", "use_cache", "num_nextn_predict_layers", "moe_layer_freq",
    "moe_router_activation_func", "use_grouped_topk", "quantization_config", "layer_types", "rope_scaling",
    "rope_parameters", "attention_bias", "attention_dropout", "hidden_dropout", "media_placeholder_token_id",
    "output_attentions", "output_hidden_states", "return_dict", "is_encoder_decoder", "head_dim",
    "linear_attn_config", "vision_config", "text_config", "tie_word_embeddings", "chunk_size_feed_forward",
    "name_or_path", "_name_or_path", "id2label", "label2id", "problem_type", "pretraining_tp", "topk_method",
    "scoring_func", "aux_loss_alpha", "seq_aux", "ep_size", "moe_intermediate_size_shared", "mlp_bias",
    "num_experts_per_token_shared", "use_sliding_window", "sliding_window", "max_window_layers",
    # transformers' KimiLinearConfig writes these derived / runtime keys next to the checkpoint ones
    "linear_conv_kernel_dim", "linear_head_dim", "linear_num_heads", "mlp_layer_types", "model_max_length",
    "output_router_logits", "qk_head_dim", "projection_layer_norm_eps", "projection_hidden_size", "image_token_id",
    "video_token_id", "vision_start_token_id", "vision_end_token_id",
}
# A published config.json that lacks one of these keys describes a model without that feature (Kimi-Linear, and
# transformers' KimiLinearConfig, which has none of K3's keys), so an absent key means this value, not the
# dataclass default (the defaults describe the tiny K3-shaped preset).
_HF_ABSENT = {
    "mla_lora_norm_eps": 1e-6,  # the official code and transformers build q_a/kv_a norms with the default eps
    "mla_use_output_gate": False,
    "routed_expert_hidden_size": None,
    "latent_moe_use_norm": False,
    "attn_res_block_size": None,
    "kda_use_full_rank_gate": False,
    "kda_gate_lower_bound": None,
    "activation_situ_beta": None,
    "activation_situ_linear_beta": None,
    "hidden_act": "silu",
}


def _hf_to_fields(raw: dict) -> dict:
    fields = {f.name for f in dataclasses.fields(KimiConfig)}
    out: dict[str, Any] = {}
    for k, v in raw.items():
        k2 = _ALIASES.get(k, k)
        if k2 in fields and k2 not in ("param_dtype", "kernels", "expert_format", "serving_dtype"):
            out[k2] = v
    if "torch_dtype" in raw or "dtype" in raw:
        dt = str(raw.get("torch_dtype") or raw.get("dtype")).replace("torch.", "")
        if dt in ("float32", "bfloat16"):
            out["param_dtype"] = dt
    lac = raw.get("linear_attn_config") or {}
    if lac:
        m = {"num_heads": "kda_num_heads", "head_dim": "kda_head_dim", "short_conv_kernel_size":
             "short_conv_kernel_size", "kda_layers": "kda_layers", "full_attn_layers": "full_attn_layers",
             "use_full_rank_gate": "kda_use_full_rank_gate", "gate_lower_bound": "kda_gate_lower_bound"}
        for k, f in m.items():
            if k in lac:
                out[f] = lac[k]
    else:  # transformers' converted form
        m = {"linear_num_heads": "kda_num_heads", "linear_head_dim": "kda_head_dim",
             "linear_conv_kernel_dim": "short_conv_kernel_size"}
        for k, f in m.items():
            if k in raw:
                out[f] = raw[k]
    if not lac and "layer_types" in raw:
        types = raw["layer_types"]
        out["kda_layers"] = tuple(i + 1 for i, t in enumerate(types) if t in ("linear_attention", "kda"))
        out["full_attn_layers"] = tuple(i + 1 for i, t in enumerate(types) if t not in ("linear_attention", "kda"))
    if "kda_layers" not in out and "full_attn_layers" not in out and "num_hidden_layers" in out:
        raise ValueError("config.json: no linear_attn_config (kda_layers / full_attn_layers) and no layer_types")
    if "tie_word_embeddings" in raw:
        out["tie_word_embeddings"] = bool(raw["tie_word_embeddings"])
    for f, v in _HF_ABSENT.items():
        out.setdefault(f, v)
    if raw.get("mlp_layer_types") is not None:  # transformers' converted form; transformers builds from it
        types = list(raw["mlp_layer_types"])
        k = next((i for i, t in enumerate(types) if t != "dense"), len(types))
        if any(t == "dense" for t in types[k:]):
            raise ValueError(f"config.json: mlp_layer_types {types}: dense layers must come first "
                             "(only first_k_dense_replace is supported)")
        if out.get("first_k_dense_replace", k) != k:
            raise ValueError(f"config.json: mlp_layer_types {types} has {k} leading dense layers but "
                             f"first_k_dense_replace is {out['first_k_dense_replace']}")
        out["first_k_dense_replace"] = k
    if "activation_situ_beta" in out and out["activation_situ_beta"] is None and out.get("hidden_act") == "situ":
        out["activation_situ_beta"] = 1.0  # official: beta = activation_situ_beta or 1.0
    qc = raw.get("quantization_config") or {}
    fmt = str(qc.get("format", "")) + json.dumps(qc.get("config_groups", {}))
    out["expert_format"] = "mxfp4" if "mxfp4" in fmt else "dense"
    if isinstance(out.get("eos_token_id"), list):
        out["eos_token_id"] = out["eos_token_id"][0]
    if raw.get("mla_use_nope") is False or ("mla_use_nope" not in raw and raw.get("model_type") == "deepseek_v3"):
        out["mla_use_nope"] = False
    # The dense intermediate for layer 0 under the HF name; Kimi-Linear calls it intermediate_size.
    if "num_experts" in out and out.get("num_experts") is None:
        out["num_experts"] = 0
    for k in ("kda_layers", "full_attn_layers"):
        if k in out:
            out[k] = tuple(out[k])
    unknown = sorted(set(raw) - set(_ALIASES) - fields - _IGNORED)
    if unknown:
        # Unknown keys are reported, never silently mis-read; most are harmless metadata.
        warnings.warn(f"config.json keys not used by KimiConfig: {unknown}", stacklevel=3)
    return out
