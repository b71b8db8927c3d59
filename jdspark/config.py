"""DSparkConfig: the DSpark drafter's configuration, with the field names of speculators' DSpark config.

speculators (vLLM's drafter library, 0.9.0) serialises a drafter as ``config.json`` with DSpark fields at the top
level and the draft decoder's shape nested in ``transformer_layer_config`` (a Qwen3 config); this dataclass keeps
both levels flat. ``from_speculators_config`` / ``to_speculators_config`` convert between the two.

Conventions (from speculators 0.9.0):
  * ``aux_hidden_state_layer_ids``: tap ``i`` is the *input* of target layer ``i`` (HF ``output_hidden_states[i]``).
  * ``sample_from_anchor=True`` (DSpark): block slot ``k`` (RoPE position ``anchor_pos + k``) predicts the token at
    ``anchor_pos + k + 1``; a block drafts ``block_size`` tokens. ``False`` is the DFlash convention (slot ``k``
    predicts the token at its own position, slot 0 is not trained).
  * ``markov_rank=0`` turns the Markov head off; ``confidence_head_with_markov`` then must be False.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from kimi.config import FrozenConfig
from kimi.jsonfile import read_json_object

_ATTENTION = ("gqa", "mla")
_MARKOV = ("vanilla", "gated", "rnn")
_LAYER_TYPES = ("full_attention", "sliding_attention")
_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class DSparkConfig(FrozenConfig):
    # DSpark (speculators top-level fields)
    block_size: int = 4
    aux_hidden_state_layer_ids: tuple[int, ...] = (1, 3, 5)
    mask_token_id: int = 127
    markov_rank: int = 16
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    sample_from_anchor: bool = True
    sliding_window_non_causal: bool = False
    # draft decoder layer shape (speculators' transformer_layer_config)
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    vocab_size: int = 128
    draft_vocab_size: int = 128
    attention_bias: bool = False
    layer_types: Optional[tuple[str, ...]] = None  # None -> every layer "full_attention"
    sliding_window: Optional[int] = None  # None: "sliding_attention" layers behave as full attention
    attention: str = "gqa"  # "gqa": speculators' Qwen3 layer; "mla": K3-native MLA layer (shape only: check_buildable)
    # every layer reads only the last context_window context positions, from a ring buffer of that many slots
    # (None: all of them, a cache as long as the stream). speculators' equivalent: every layer "sliding_attention"
    # with sliding_window = context_window and sliding_window_non_causal = True; config.json carries it as the
    # top-level key "context_window" (written only when set).
    context_window: Optional[int] = None
    # MLA shape (attention == "mla" only; names as in kimi.KimiConfig)
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # bookkeeping carried through config.json
    verifier_name_or_path: Optional[str] = None
    verifier_architectures: tuple[str, ...] = ("KimiK3ForCausalLM",)
    param_dtype: str = "float32"

    # ------------------------------------------------------------------ validation
    def __post_init__(self):
        def bad(field: str, msg: str):
            raise ValueError(f"DSparkConfig.{field}: {msg}")

        object.__setattr__(self, "aux_hidden_state_layer_ids", tuple(int(i) for i in self.aux_hidden_state_layer_ids))
        object.__setattr__(self, "verifier_architectures", tuple(self.verifier_architectures))
        if self.layer_types is not None:  # canonical form: None when every layer is full attention
            lt = tuple(self.layer_types)
            full = len(lt) == self.num_hidden_layers and all(t == "full_attention" for t in lt)
            object.__setattr__(self, "layer_types", None if full else lt)

        for f in ("block_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "vocab_size", "draft_vocab_size"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                bad(f, f"expected a positive int, got {v!r}")
        if self.draft_vocab_size != self.vocab_size:
            bad("draft_vocab_size", f"a reduced draft vocabulary ({self.draft_vocab_size} != vocab_size "
                f"{self.vocab_size}, t2d/d2t mapping) is not supported")
        if not self.aux_hidden_state_layer_ids:
            bad("aux_hidden_state_layer_ids", "expected at least one target layer id")
        ids = self.aux_hidden_state_layer_ids
        if min(ids) < 0 or len(set(ids)) != len(ids):
            bad("aux_hidden_state_layer_ids", f"expected distinct ids >= 0, got {list(ids)}")
        if isinstance(self.mask_token_id, bool) or not isinstance(self.mask_token_id, int) \
                or not 0 <= self.mask_token_id < self.vocab_size:
            bad("mask_token_id", f"expected an id in [0, vocab_size={self.vocab_size}), got {self.mask_token_id!r}")
        if isinstance(self.markov_rank, bool) or not isinstance(self.markov_rank, int) or self.markov_rank < 0:
            bad("markov_rank", f"expected an int >= 0 (0 disables the Markov head), got {self.markov_rank!r}")
        if self.markov_head_type not in _MARKOV:
            bad("markov_head_type", f"expected one of {_MARKOV}, got {self.markov_head_type!r}")
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            bad("confidence_head_with_markov", "needs markov_rank > 0 (set it False or give a rank)")
        if not self.rms_norm_eps > 0:
            bad("rms_norm_eps", f"expected > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            bad("rope_theta", f"expected > 0, got {self.rope_theta!r}")
        if self.attention not in _ATTENTION:
            bad("attention", f"expected one of {_ATTENTION}, got {self.attention!r}")
        if self.param_dtype not in _DTYPES:
            bad("param_dtype", f"expected one of {_DTYPES}, got {self.param_dtype!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                bad("layer_types", f"expected {self.num_hidden_layers} entries (num_hidden_layers), "
                    f"got {len(self.layer_types)}")
            for t in self.layer_types:
                if t not in _LAYER_TYPES:
                    bad("layer_types", f"expected entries in {_LAYER_TYPES}, got {t!r}")
        if self.sliding_window is not None:  # None: sliding_attention layers act as full attention (speculators)
            if isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) \
                    or self.sliding_window <= 0:
                bad("sliding_window", f"expected None or a positive int, got {self.sliding_window!r}")
        if self.context_window is not None:
            if isinstance(self.context_window, bool) or not isinstance(self.context_window, int) \
                    or self.context_window <= 0:
                bad("context_window", f"expected None or a positive int, got {self.context_window!r}")
        if self.attention == "gqa":
            for f in ("num_key_value_heads", "head_dim"):
                v = getattr(self, f)
                if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                    bad(f, f"expected a positive int, got {v!r}")
            if self.num_attention_heads % self.num_key_value_heads:
                bad("num_key_value_heads", f"{self.num_key_value_heads} does not divide num_attention_heads="
                    f"{self.num_attention_heads}")
            if self.head_dim % 2:
                bad("head_dim", f"RoPE needs an even head_dim, got {self.head_dim}")
        else:
            for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                v = getattr(self, f)
                if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                    bad(f, f"attention='mla' needs a positive int, got {v!r}")
            if self.q_lora_rank is not None and self.q_lora_rank <= 0:
                bad("q_lora_rank", f"expected None or a positive int, got {self.q_lora_rank!r}")
            if self.qk_rope_head_dim % 2:
                bad("qk_rope_head_dim", f"RoPE needs an even rope slice, got {self.qk_rope_head_dim}")

    def check_buildable(self) -> None:
        """NotImplementedError unless jdspark builds this drafter: attention='mla' (the K3-native MLA draft layer of
        the published K3 drafter, ``k3()``) is a validated shape for parameter counts and memory plans only."""
        if self.attention == "mla":
            raise NotImplementedError(
                "DSparkConfig.attention='mla' (the K3-native MLA draft layer) is not implemented yet; "
                "use attention='gqa' (speculators' Qwen3 layer)")

    # ------------------------------------------------------------------ derived
    @property
    def num_taps(self) -> int:
        return len(self.aux_hidden_state_layer_ids)

    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens per block: block_size with sample_from_anchor (DSpark), block_size - 1 otherwise."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @property
    def resolved_layer_types(self) -> tuple[str, ...]:
        return self.layer_types or ("full_attention",) * self.num_hidden_layers

    # ------------------------------------------------------------------ presets
    @classmethod
    def k3(cls, **kw) -> "DSparkConfig":
        """The Kimi-K3 DSpark drafter shape: 5 dense MLA layers, block 7, Markov rank 256, taps (2, 23, 47, 71, 89).

        64 heads, q_lora 1536, kv_lora 512, no output gate and a 14336-wide MLP reproduce the published parameter
        count exactly (2,387,907,841 trained + the 163840 x 7168 shared embedding)."""
        base = dict(
            block_size=7, aux_hidden_state_layer_ids=(2, 23, 47, 71, 89), mask_token_id=163839, markov_rank=256,
            markov_head_type="vanilla", enable_confidence_head=True, confidence_head_with_markov=True,
            sample_from_anchor=True, hidden_size=7168, intermediate_size=14336, num_hidden_layers=5,
            num_attention_heads=64, num_key_value_heads=64, head_dim=192, rms_norm_eps=1e-5, rope_theta=10000.0,
            vocab_size=163840, draft_vocab_size=163840, attention="mla", q_lora_rank=1536, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, param_dtype="bfloat16",
        )
        base.update(kw)
        return cls(**base)

    @classmethod
    def tiny(cls, **kw) -> "DSparkConfig":
        """A seconds-to-compile gqa drafter: hidden 64, 2 layers, 4 heads / 2 kv heads of 16, block 4, rank 16,
        vocab 128, taps (1, 3, 5)."""
        base = dict(
            block_size=4, aux_hidden_state_layer_ids=(1, 3, 5), mask_token_id=127, markov_rank=16,
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=128, draft_vocab_size=128, attention="gqa",
        )
        base.update(kw)
        if "vocab_size" in kw and "draft_vocab_size" not in kw:
            base["draft_vocab_size"] = base["vocab_size"]
        if "vocab_size" in kw and "mask_token_id" not in kw:
            base["mask_token_id"] = base["vocab_size"] - 1
        return cls(**base)

    @classmethod
    def for_target(cls, target_config: Any, **kw) -> "DSparkConfig":
        """A tiny-shaped gqa drafter sized for a target config (anything with vocab_size, hidden_size,
        num_hidden_layers, rms_norm_eps): shares the target's width and vocabulary; taps spread over its depth."""
        n = int(target_config.num_hidden_layers)
        taps = sorted({min(n, max(0, round(1 + i * (n - 2) / 2))) for i in range(3)})
        heads = kw.pop("num_attention_heads", 4)
        base = dict(
            hidden_size=int(target_config.hidden_size), vocab_size=int(target_config.vocab_size),
            draft_vocab_size=int(target_config.vocab_size), mask_token_id=int(target_config.vocab_size) - 1,
            rms_norm_eps=float(getattr(target_config, "rms_norm_eps", 1e-6)),
            rope_theta=float(getattr(target_config, "rope_theta", 10000.0)),
            aux_hidden_state_layer_ids=tuple(taps), num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2), head_dim=max(2, 2 * (int(target_config.hidden_size) // heads // 2)),
            intermediate_size=2 * int(target_config.hidden_size),
        )
        base.update(kw)
        return cls.tiny(**base)

    # ------------------------------------------------------------------ speculators config.json
    @classmethod
    def from_speculators_config(cls, path_or_dict: Any, **overrides) -> "DSparkConfig":
        """Read speculators' DSpark ``config.json`` (a path to the file or its directory, or the parsed dict)."""
        if isinstance(path_or_dict, dict):
            raw = path_or_dict
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            raw = read_json_object(path)
        if raw.get("speculators_model_type", "dspark") != "dspark":
            raise ValueError(f"speculators_model_type: expected 'dspark', got {raw.get('speculators_model_type')!r}")
        tl = raw.get("transformer_layer_config")
        if not isinstance(tl, dict):
            raise ValueError("transformer_layer_config: missing or not an object in the DSpark config")

        def need(d: dict, key: str, where: str):
            if d.get(key) is None:
                raise ValueError(f"{where}{key}: required but missing")
            return d[key]

        hidden = int(need(tl, "hidden_size", "transformer_layer_config."))
        heads = int(need(tl, "num_attention_heads", "transformer_layer_config."))
        act = tl.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"transformer_layer_config.hidden_act: only 'silu' is supported, got {act!r}")
        rope = tl.get("rope_parameters") or {}
        if "sliding_attention" in rope:  # per-layer-type rope: speculators flattens to the sliding entry
            rope = rope["sliding_attention"]
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"transformer_layer_config.rope_parameters.rope_type: only 'default' is supported, "
                             f"got {rope_type!r}")
        rope_theta = rope.get("rope_theta", tl.get("rope_theta", 10000.0))
        layer_types = tl.get("layer_types")
        mla = tl.get("kv_lora_rank") is not None and tl.get("model_type") != "qwen3"
        spec = raw.get("speculators_config") or {}
        verifier = spec.get("verifier") or {}
        fields = dict(
            block_size=int(raw.get("block_size", 8)),
            aux_hidden_state_layer_ids=tuple(need(raw, "aux_hidden_state_layer_ids", "")),
            mask_token_id=need(raw, "mask_token_id", ""),
            markov_rank=int(raw.get("markov_rank", 256)),
            markov_head_type=raw.get("markov_head_type", "vanilla"),
            enable_confidence_head=bool(raw.get("enable_confidence_head", True)),
            confidence_head_with_markov=bool(raw.get("confidence_head_with_markov", True)),
            sample_from_anchor=bool(raw.get("sample_from_anchor", True)),
            sliding_window_non_causal=bool(raw.get("sliding_window_non_causal", False)),
            hidden_size=hidden,
            intermediate_size=int(need(tl, "intermediate_size", "transformer_layer_config.")),
            num_hidden_layers=int(need(tl, "num_hidden_layers", "transformer_layer_config.")),
            num_attention_heads=heads,
            num_key_value_heads=int(tl.get("num_key_value_heads") or heads),
            head_dim=int(tl.get("head_dim") or hidden // heads),
            rms_norm_eps=float(tl.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            vocab_size=int(need(tl, "vocab_size", "transformer_layer_config.")),
            draft_vocab_size=int(raw.get("draft_vocab_size", 32000)),
            attention_bias=bool(tl.get("attention_bias", False)),
            layer_types=tuple(layer_types) if layer_types else None,
            sliding_window=tl.get("sliding_window"),
            context_window=raw.get("context_window"),
            attention="mla" if mla else "gqa",
            verifier_name_or_path=verifier.get("name_or_path"),
            verifier_architectures=tuple(verifier.get("architectures") or ()),
            param_dtype=_norm_dtype(raw.get("dtype", raw.get("torch_dtype", tl.get("dtype", "float32")))),
        )
        if mla:
            fields.update(q_lora_rank=tl.get("q_lora_rank"), kv_lora_rank=int(tl["kv_lora_rank"]),
                          qk_nope_head_dim=int(tl.get("qk_nope_head_dim", 0)),
                          qk_rope_head_dim=int(tl.get("qk_rope_head_dim", 0)),
                          v_head_dim=int(tl.get("v_head_dim", 0)))
        fields.update(overrides)
        return cls(**fields)

    def to_speculators_config(self) -> dict:
        """The ``config.json`` dict speculators 0.9.0 writes for this drafter (loadable by
        ``DSparkDraftModel.from_pretrained``)."""
        layer_types = list(self.resolved_layer_types)
        tl: dict[str, Any] = {
            "model_type": "qwen3" if self.attention == "gqa" else "kimi_dspark_mla",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "layer_types": layer_types,
            "sliding_window": self.sliding_window,
            "use_sliding_window": "sliding_attention" in layer_types,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "pad_token_id": None,
            "dtype": self.param_dtype,
        }
        if self.attention == "mla":
            tl.update(q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                      qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                      v_head_dim=self.v_head_dim)
        extra = {} if self.context_window is None else {"context_window": self.context_window}
        return {
            **extra,
            "architectures": ["DSparkDraftModel"],
            "auto_map": {"": "config.DSparkSpeculatorConfig"},
            "aux_hidden_state_layer_ids": list(self.aux_hidden_state_layer_ids),
            "block_size": self.block_size,
            "confidence_head_with_markov": self.confidence_head_with_markov,
            "draft_vocab_size": self.draft_vocab_size,
            "dtype": self.param_dtype,
            "enable_confidence_head": self.enable_confidence_head,
            "markov_head_type": self.markov_head_type,
            "markov_rank": self.markov_rank,
            "mask_token_id": self.mask_token_id,
            "sample_from_anchor": self.sample_from_anchor,
            "sliding_window_non_causal": self.sliding_window_non_causal,
            "speculators_config": {
                "algorithm": "dspark",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": self.num_speculative_tokens,
                                      "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                "verifier": {"architectures": list(self.verifier_architectures),
                             "name_or_path": self.verifier_name_or_path},
            },
            "speculators_model_type": "dspark",
            "speculators_version": "0.9.0",
            "target_hidden_size": None,
            "tie_word_embeddings": False,
            "transformer_layer_config": tl,
        }


def _norm_dtype(d: Any) -> str:
    d = str(d or "float32").replace("torch.", "")
    if d in ("float32", "bfloat16"):
        return d
    return "float32"  # anything else (float16, ...) loads losslessly as float32
