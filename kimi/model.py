"""KimiForCausalLM: prefill, decode and verify over a KimiCache, returning logits, the new cache and hidden taps.

Depth mixing (K3, Block AttnRes; the official ``_apply_attn_res`` order):
  prefix = embed(tokens); blocks = []
  for layer i:
    h = AttnRes(prefix, blocks; w_attn_i) if blocks else prefix        <- tap i (the input of layer i)
    if i % block_size == 0: blocks.append(prefix); prefix = None       (seal a block)
    a = mixer_i(input_layernorm_i(h));      prefix = a if prefix is None else prefix + a
    f = ffn_i(post_attention_layernorm_i(AttnRes(prefix, blocks; w_mlp_i)));   prefix = prefix + f
  h = AttnRes(prefix, blocks; w_out)                                   <- tap L;  logits = lm_head(norm(h))
Kimi-Linear (attn_res_block_size None) keeps the plain residual: h = h + mixer(norm(h)); h = h + ffn(norm(h)).

The hot path is a jitted pure function of (graphdef, state, tokens, cache); the cache is donated.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi import mxfp4
from kimi.cache import KimiCache, select_verified
from kimi.config import KimiConfig
from kimi.layers import (
    DecoderLayer,
    Embed,
    Linear,
    RMSNorm,
    attn_res_pseudo_query,
    attn_res_site,
    fuse_projections,
    shape_only_init,
    weights_to_bf16,
)
from kimi.ops import linear as linear_ops
from kimi.ops.attn_res import attn_res
from kimi.partitioning import NO_PARTITION, Partitioner, set_partitioner
from kimi.vision import MoonViT, Projector, encode, merge_media, num_media_tokens

MODES = ("prefill", "decode", "verify")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelOut:
    logits: jax.Array  # [B, T, V] fp32 ([B, V] from decode)
    cache: KimiCache
    taps: Optional[jax.Array] = None  # [B, T, n_taps * D]: hidden states at the requested tap layers
    last_hidden: Optional[jax.Array] = None  # [B, T, D]: the final hidden state before the final norm
    # verify: what rolls KDA back (see cache.select_verified), per KDA layer stacked on a leading n_kda axis: the
    # state after every position [n_kda, B, T, H, K, V], or a KDABlockTrace (the closed-form block's); None
    # without KDA layers
    kda_rollback: object = None
    conv_states: Optional[jax.Array] = None  # verify: [n_kda, B, T, W, 3P]


def check_token_ids(tokens, vocab_size: int, name: str) -> np.ndarray:
    """``tokens`` as a host array; ValueError (naming ``name``) unless they are integer ids in [0, vocab_size)."""
    tok = np.asarray(tokens)
    if not np.issubdtype(tok.dtype, np.integer):
        raise ValueError(f"{name}: expected integer token ids, got dtype {tok.dtype}")
    if tok.size and (tok.min() < 0 or tok.max() >= vocab_size):
        bad = tok[(tok < 0) | (tok >= vocab_size)]
        raise ValueError(f"{name}: token ids {bad[:8].tolist()} outside the vocabulary [0, {vocab_size})")
    return tok


class KimiModel(nnx.Module):
    def __init__(self, cfg: KimiConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.attn_res_block_size is not None:
            self.output_attn_res_norm, self.output_attn_res_proj = attn_res_site(cfg, rngs=rngs)


class KimiForCausalLM(nnx.Module):
    def __init__(self, cfg: KimiConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.model = KimiModel(cfg, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=cfg.dtype, rngs=rngs)
        if cfg.vision is not None:  # the checkpoint's top-level vision_tower.* and mm_projector.*
            self.vision_tower = MoonViT(cfg.vision, dtype=cfg.dtype, rngs=rngs)
            self.mm_projector = Projector(cfg.vision, cfg.hidden_size, dtype=cfg.dtype, rngs=rngs)
        self.partition: Partitioner = NO_PARTITION

    def set_partitioner(self, partition: Partitioner):
        """Install a sharding plan (``sharding.shard_model`` does, after placing the parameters) on the model and
        on every layer that declares the hook (``partition``); ``NO_PARTITION`` removes it."""
        set_partitioner(self, partition)

    # -------------------------------------------------------------------------------------------- shared weights
    @property
    def embed_tokens(self) -> Embed:
        return self.model.embed_tokens

    def lm_head_DV(self):
        """The output projection [D, V] (the transposed embedding when tied)."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.embedding[...].T
        return self.lm_head.kernel[...]

    def logits_from_hidden(self, h_BTD):
        """lm_head(norm(h)) in fp32."""
        hn = self.model.norm(h_BTD)
        return linear_ops.matmul(hn.astype(jnp.float32), self.lm_head_DV())

    # -------------------------------------------------------------------------------------------- cache
    def init_cache(self, batch_size: int = 1, max_len: int = 4096) -> KimiCache:
        return KimiCache.init(self.config, batch_size, max_len)

    # -------------------------------------------------------------------------------------------- the forward
    def forward(self, tokens_BT, cache: KimiCache, *, mode: str, tap_layers: Sequence[int] = (),
                valid_len_B=None, media_MD=None) -> ModelOut:
        """Pure forward over ``tokens_BT`` appended at ``cache.length``; usable inside any jit.

        ``valid_len_B`` (prefill of right-padded prompts): only the first valid_len tokens of each row enter the
        cache; padded positions change no state, and their logits and taps are meaningless.
        ``media_MD`` (projected image features, ``kimi.vision.encode``): replace the embeddings of the placeholder
        tokens, in order, before the first layer (the count must match; ``prefill(images=...)`` checks it)."""
        cfg = self.config
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if valid_len_B is not None and mode != "prefill":
            raise ValueError("valid_len_B: only prefill takes padded rows")
        tap_layers = tuple(tap_layers)
        for t in tap_layers:
            if not 0 <= t <= cfg.num_hidden_layers:
                raise ValueError(f"tap_layers: {t} outside 0..{cfg.num_hidden_layers}")
        B, T = tokens_BT.shape
        x_BTD = self.model.embed_tokens(tokens_BT).astype(cfg.dtype)
        if media_MD is not None:
            x_BTD = merge_media(x_BTD, tokens_BT, media_MD, cfg.vision.media_placeholder_token_id)
        use_res = cfg.attn_res_block_size is not None
        taps = {}
        kda_state, conv_state = cache.kda_state, cache.conv_state
        ckv, kpe = cache.mla_ckv, cache.mla_kpe
        new_kda, new_conv, all_states, all_convs = [], [], [], []
        if use_res:
            blocks_BTND = jnp.zeros((B, T, cfg.num_attn_res_blocks, cfg.hidden_size), x_BTD.dtype)
            n_blocks = 0
            prefix = x_BTD
        i_kda = i_mla = 0
        for i, layer in enumerate(self.model.layers):
            if use_res:
                if n_blocks:
                    with jax.named_scope("attn_res"):
                        w = attn_res_pseudo_query(layer.self_attention_res_norm, layer.self_attention_res_proj)
                        h = attn_res(prefix, blocks_BTND, n_blocks, w, cfg.rms_norm_eps)
                else:
                    h = prefix
                if i % cfg.attn_res_block_size == 0:
                    blocks_BTND = blocks_BTND.at[:, :, n_blocks].set(prefix)
                    n_blocks += 1
                    prefix = None
            else:
                h = x_BTD
            if i in tap_layers:
                taps[i] = h
            hn = layer.input_layernorm(h)
            if layer.kind == "kda":
                with jax.named_scope("kda"):
                    out = layer.self_attn(hn, kda_state[i_kda], conv_state[i_kda], mode, valid_len_B)
                a = out.y_BTD
                new_kda.append(out.state_BHKV)
                new_conv.append(out.conv_BWC)
                if mode == "verify":
                    all_states.append(out.rollback)
                    all_convs.append(out.convs_BTWC)
                i_kda += 1
            else:
                with jax.named_scope("mla"):
                    a, ckv, kpe = layer.self_attn(hn, ckv, kpe, i_mla, cache.length, absorbed=mode != "prefill")
                i_mla += 1
            if use_res:
                prefix = a if prefix is None else prefix + a
                with jax.named_scope("attn_res"):
                    w = attn_res_pseudo_query(layer.mlp_res_norm, layer.mlp_res_proj)
                    h2 = attn_res(prefix, blocks_BTND, n_blocks, w, cfg.rms_norm_eps)
                with jax.named_scope(cfg.ffn_kinds[i]):
                    prefix = prefix + layer.ffn(layer.post_attention_layernorm(h2))
            else:
                x_BTD = x_BTD + a
                with jax.named_scope(cfg.ffn_kinds[i]):
                    x_BTD = x_BTD + layer.ffn(layer.post_attention_layernorm(x_BTD))
        if use_res:
            with jax.named_scope("attn_res"):
                w = attn_res_pseudo_query(self.model.output_attn_res_norm, self.model.output_attn_res_proj)
                h = attn_res(prefix, blocks_BTND, n_blocks, w, cfg.rms_norm_eps)
        else:
            h = x_BTD
        L = cfg.num_hidden_layers
        if L in tap_layers:
            taps[L] = h
        with jax.named_scope("lm_head"):
            logits = self.logits_from_hidden(h)

        def stack(xs, like):  # the cache keeps its own dtype (a bf16 model computes some states in fp32)
            return jnp.stack(xs).astype(like.dtype) if xs else like

        new_cache = KimiCache(
            kda_state=stack(new_kda, kda_state), conv_state=stack(new_conv, conv_state),
            mla_ckv=ckv, mla_kpe=kpe,
            length=cache.length + (T if valid_len_B is None else valid_len_B.astype(jnp.int32)))
        new_cache = self.partition.constrain_cache(new_cache)  # a sharded cache keeps its layout
        out = ModelOut(logits=logits, cache=new_cache, last_hidden=h,
                       taps=jnp.concatenate([taps[t] for t in tap_layers], -1) if tap_layers else None)
        if mode == "verify":
            W, C = conv_state.shape[2], conv_state.shape[3]
            out.kda_rollback = jax.tree.map(lambda *xs: jnp.stack(xs), *all_states) if all_states else None
            out.conv_states = stack(all_convs, jnp.zeros((cfg.num_kda_layers, B, T, W, C), conv_state.dtype))
        if mode == "decode":
            out.logits = logits[:, 0]
        return out

    # -------------------------------------------------------------------------------------------- public API
    def _check(self, tokens, cache: KimiCache, name: str):
        """Host-side validation before any compute (skipped for traced arguments)."""
        if isinstance(tokens, jax.core.Tracer) or isinstance(cache.length, jax.core.Tracer):
            return
        tok = check_token_ids(tokens, self.config.vocab_size, name)
        if tok.shape[0] != cache.batch_size:
            raise ValueError(f"{name}: batch {tok.shape[0]} does not match the cache's batch {cache.batch_size}")
        T = 1 if tok.ndim == 1 else tok.shape[1]
        need = int(np.max(np.asarray(cache.length))) + T
        if need > cache.max_len:
            raise ValueError(f"{name}: {need} positions needed but the cache holds max_len={cache.max_len}; "
                             f"allocate a larger cache with init_cache(max_len=...)")

    def _run(self, mode: str, tokens, cache: KimiCache, tap_layers, ndim: int, media_MD=None) -> ModelOut:
        if np.ndim(tokens) != ndim:
            want = "[B, T]" if ndim == 2 else "[B]"
            raise ValueError(f"{mode}: expected tokens {want}, got shape {np.shape(tokens)}")
        self._check(tokens, cache, mode)
        tokens, cache = self.partition.place(tokens, cache)
        tokens_BT = jnp.asarray(tokens, jnp.int32)
        return run_forward(self, tokens_BT if ndim == 2 else tokens_BT[:, None], cache, mode, tuple(tap_layers),
                           media_MD)

    def image_features(self, tokens, images):
        """[M, D] projected features of ``images`` for the prompt ``tokens``, after checking that the prompt holds
        exactly M placeholder tokens. ``images``: ``kimi.image.VisionInput`` (pixel_values + grid_thw, from
        ``kimi.image.preprocess``) or a list of images (HWC uint8 arrays or PIL images), preprocessed here."""
        from kimi import image as image_lib

        cfg = self.config
        if cfg.vision is None:
            raise ValueError("images: this checkpoint is text-only (no vision tower; config has no vision_config)")
        vin = images if isinstance(images, image_lib.VisionInput) else image_lib.preprocess(images, cfg.vision)
        want = sum(num_media_tokens(vin.grid_thw, cfg.vision))
        have = int(np.sum(np.asarray(tokens) == cfg.vision.media_placeholder_token_id))
        if have != want:
            raise ValueError(f"images: the prompt holds {have} placeholder tokens "
                             f"(id {cfg.vision.media_placeholder_token_id}) but the images give {want} features "
                             f"(grids {np.asarray(vin.grid_thw).tolist()}); expand each placeholder with "
                             "kimi.image.expand_placeholders")
        return encode(self.vision_tower, self.mm_projector, vin.pixel_values, vin.grid_thw)

    def prefill(self, tokens_BT, cache: KimiCache, tap_layers: Sequence[int] = (), images=None) -> ModelOut:
        """A sharded model (``sharding.shard_model``) places the tokens and the cache by its rules first.
        ``images`` (see ``image_features``): merged at the prompt's placeholder tokens before the first layer."""
        media = None if images is None else self.image_features(tokens_BT, images)
        return self._run("prefill", tokens_BT, cache, tap_layers, 2, media)

    def decode(self, token_B, cache: KimiCache, tap_layers: Sequence[int] = ()) -> ModelOut:
        return self._run("decode", token_B, cache, tap_layers, 1)

    def verify(self, tokens_BT, cache: KimiCache, tap_layers: Sequence[int] = ()) -> ModelOut:
        return self._run("verify", tokens_BT, cache, tap_layers, 2)

    @staticmethod
    def rollback(out: ModelOut, length_before_B, n_keep_B) -> KimiCache:
        """The cache after keeping only the first ``n_keep`` verified positions (see cache.select_verified)."""
        return select_verified(out.cache, out.kda_rollback, out.conv_states, jnp.asarray(length_before_B),
                               jnp.asarray(n_keep_B))


def abstract_model(cfg: KimiConfig) -> KimiForCausalLM:
    """The model's structure, shapes and dtypes only (``nnx.eval_shape``, no random draws): nothing allocated."""
    with shape_only_init():
        return nnx.eval_shape(lambda: KimiForCausalLM(cfg, rngs=nnx.Rngs(0)))


def with_dense_experts(model: KimiForCausalLM) -> KimiForCausalLM:
    """The same model with its MXFP4 routed experts dequantised (``expert_format="dense"``), every other weight
    shared. Traceable: ``generate`` uses it inside its program to unpack small models' experts once per generation
    instead of once per step."""
    cfg = model.config
    if cfg.expert_format != "mxfp4":
        return model
    graphdef, state = nnx.split(abstract_model(cfg.replace(expert_format="dense")))

    def walk(node):
        if not isinstance(node, dict):
            return node
        if "w1_packed" in node:  # RoutedExperts
            return {n: mxfp4.dequantize(node[f"{n}_packed"], node[f"{n}_scale"], dtype=cfg.dtype)
                    for n in ("w1", "w2", "w3")}
        return {k: walk(v) for k, v in node.items()}

    nnx.replace_by_pure_dict(state, walk(nnx.to_pure_dict(nnx.state(model))))
    return nnx.merge(graphdef, state)


def with_serving_layout(model: KimiForCausalLM) -> KimiForCausalLM:
    """The model as a generation serves a small model, made once per set of weights (the generation keeps it; not
    once per step or per call): MXFP4 experts dequantised; every expert also in the fused layout of the verify path
    ('all', see ``RoutedExperts.all_layout``) and per expert (the 'used' loop); the projections that read the same
    input side by side (``project_many``); with ``serving_dtype`` bfloat16, every matmul weight in bf16
    (``kimi.layers.weights_to_bf16``). About three times the experts' bytes. Same weights, same results up to float
    summation order (and bf16 rounding of the matmul inputs)."""
    model = with_dense_experts(model) if model.config.expert_format == "mxfp4" else nnx.merge(*nnx.split(model))
    for layer in model.model.layers:
        moe = model.config.ffn_kinds[layer.layer_idx] == "moe"
        ffn = layer.block_sparse_moe if moe else layer.mlp
        for module in (layer.self_attn, ffn):
            fuse_projections(module, module.input_projections())
        if moe:
            ffn.experts.make_all_layout()
    if model.config.serving_dtype == "bfloat16":
        weights_to_bf16(model)
    return model


def _forward_pure(graphdef, state, tokens_BT, cache, mode, tap_layers, media_MD=None):
    model = nnx.merge(graphdef, state)
    return model.forward(tokens_BT, cache, mode=mode, tap_layers=tap_layers, media_MD=media_MD)


forward_jit = jax.jit(_forward_pure, static_argnums=(0, 4, 5), donate_argnums=(3,))


def run_forward(model: KimiForCausalLM, tokens_BT, cache, mode: str, tap_layers: tuple, media_MD=None) -> ModelOut:
    graphdef, state = nnx.split(model)
    return forward_jit(graphdef, state, tokens_BT, cache, mode, tap_layers, media_MD)
