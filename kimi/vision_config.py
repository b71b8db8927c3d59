"""VisionConfig: the MoonViT encoder and its projector, one frozen dataclass for both published variants.

  K2.5 (transformers' ``Kimi_K25VisionConfig`` + ``Kimi_K25MultimodalProjection``): LayerNorm, hidden 1152,
      16 heads, MLP 4304, Conv2d patch embedding with a bias, bicubic interpolation of the 64 x 64 position
      table, projector ``patchmerger`` = LayerNorm(1152) per merged patch -> Linear(4608, 4608) -> GELU ->
      Linear(4608, text hidden).
  K3 (MoonViT3d, "MoonViT-V2"): RMSNorm, hidden 1024, 12 heads of 128 (qkv width 1536), MLP 4096, no patch
      embedding bias, bilinear interpolation, projector ``patchmerger_v2`` = Linear(4096, 4096, no bias) -> GELU
      -> Linear(4096, text hidden, no bias) -> RMSNorm(text hidden).

The parameters take the text model's dtype (``KimiConfig.param_dtype``). Field names follow the HF
``vision_config`` keys where one exists (``patch_size``, ``pos_emb_height``,
``merge_kernel_size``, ...); the K3 keys (``vt_hidden_size``, ``qkv_hidden_size``, ``init_pos_emb_time``) are read
as aliases by :meth:`VisionConfig.from_hf_config`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

NormKind = Literal["layernorm", "rmsnorm"]
ProjectorKind = Literal["patchmerger", "patchmerger_v2"]
InterpKind = Literal["bicubic", "bilinear"]


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    patch_size: int = 14
    in_channels: int = 3
    hidden_size: int = 1152
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    qkv_hidden_size: Optional[int] = None  # q/k/v width (heads x head dim); None -> hidden_size
    intermediate_size: int = 4304
    norm: NormKind = "layernorm"
    norm_eps: float = 1e-5
    patch_embed_bias: bool = True
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    pos_emb_time: int = 4  # frames the fixed sin-cos time table covers
    pos_emb_interpolation: InterpKind = "bicubic"
    rope_theta: float = 10000.0
    merge_kernel_size: tuple[int, int] = (2, 2)
    projector: ProjectorKind = "patchmerger"
    projector_eps: float = 1e-5
    media_placeholder_token_id: int = 163605  # one per merged patch after expansion

    def __post_init__(self):
        def bad(field: str, msg: str):
            raise ValueError(f"VisionConfig.{field}: {msg}")

        object.__setattr__(self, "merge_kernel_size", tuple(int(k) for k in self.merge_kernel_size))
        for f in ("patch_size", "in_channels", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "intermediate_size", "pos_emb_height", "pos_emb_width", "pos_emb_time"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                bad(f, f"expected a positive int, got {v!r}")
        if len(self.merge_kernel_size) != 2 or min(self.merge_kernel_size) <= 0:
            bad("merge_kernel_size", f"expected two positive ints, got {self.merge_kernel_size}")
        if self.qkv_dim % self.num_attention_heads:
            bad("num_attention_heads", f"{self.num_attention_heads} does not divide the qkv width {self.qkv_dim}")
        if self.head_dim % 4:
            bad("num_attention_heads", f"head dim {self.head_dim} must be a multiple of 4 (2D RoPE: x and y "
                "frequency pairs)")
        if self.norm not in ("layernorm", "rmsnorm"):
            bad("norm", f"expected 'layernorm' or 'rmsnorm', got {self.norm!r}")
        if self.projector not in ("patchmerger", "patchmerger_v2"):
            bad("projector", f"expected 'patchmerger' or 'patchmerger_v2', got {self.projector!r}")
        if self.pos_emb_interpolation not in ("bicubic", "bilinear"):
            bad("pos_emb_interpolation", f"expected 'bicubic' or 'bilinear', got {self.pos_emb_interpolation!r}")

    # ------------------------------------------------------------------ derived
    def replace(self, **kw) -> "VisionConfig":
        return dataclasses.replace(self, **kw)

    @property
    def qkv_dim(self) -> int:
        return self.qkv_hidden_size or self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.qkv_dim // self.num_attention_heads

    @property
    def merge_area(self) -> int:
        """Patches per merged token (2 x 2)."""
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @property
    def merged_dim(self) -> int:
        """Width of one merged token before the projector: merge_area x hidden_size."""
        return self.merge_area * self.hidden_size

    @property
    def patch_dim(self) -> int:
        """Values per patch: channels x patch x patch."""
        return self.in_channels * self.patch_size * self.patch_size

    # ------------------------------------------------------------------ presets
    @classmethod
    def k25(cls, **kw) -> "VisionConfig":
        """Kimi K2.5's MoonViT (transformers' ``Kimi_K25VisionConfig`` defaults)."""
        return cls(**kw)

    @classmethod
    def k3(cls, **kw) -> "VisionConfig":
        """K3's MoonViT3d ("MoonViT-V2") as published: RMSNorm, 1024 wide, 12 heads x 128, PatchMergerMLPV2."""
        base = dict(hidden_size=1024, num_hidden_layers=27, num_attention_heads=12, qkv_hidden_size=1536,
                    intermediate_size=4096, norm="rmsnorm", patch_embed_bias=False, pos_emb_interpolation="bilinear",
                    projector="patchmerger_v2")
        base.update(kw)
        return cls(**base)

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf_config(cls, raw: dict, top: Optional[dict] = None) -> Optional["VisionConfig"]:
        """A ``vision_config`` dict (K2.5 / transformers keys, or K3's ``vt_*`` keys); None when empty. ``top``
        (the enclosing config) supplies the placeholder id and the projector's eps."""
        if not raw:
            return None
        top = top or {}
        fields = {f.name for f in dataclasses.fields(cls)}
        aliases = {"vt_hidden_size": "hidden_size", "vt_num_hidden_layers": "num_hidden_layers",
                   "vt_num_attention_heads": "num_attention_heads", "vt_intermediate_size": "intermediate_size",
                   "init_pos_emb_height": "pos_emb_height", "init_pos_emb_width": "pos_emb_width",
                   "init_pos_emb_time": "pos_emb_time", "num_channels": "in_channels"}
        out = {}
        for k, v in raw.items():
            k2 = aliases.get(k, k)
            if k2 in fields and k2 != "media_placeholder_token_id":
                out[k2] = v
        rope = raw.get("rope_parameters") or {}
        if "rope_theta" in rope:
            out["rope_theta"] = float(rope["rope_theta"])
        for k in ("media_placeholder_token_id", "image_token_id"):
            if k in top:
                out["media_placeholder_token_id"] = int(top[k])
                break
        if "projection_layer_norm_eps" in top:
            out["projector_eps"] = float(top["projection_layer_norm_eps"])
        return cls(**out)

    def to_hf_config(self) -> dict:
        """The ``vision_config`` dict, read back by ``from_hf_config`` (all fields, transformers' key names where
        they exist)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("media_placeholder_token_id", "rope_theta")}
        d["merge_kernel_size"] = list(self.merge_kernel_size)
        d["rope_parameters"] = {"rope_type": "axial", "rope_theta": self.rope_theta}
        return d
