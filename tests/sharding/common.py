"""Shared tiny configs for the sharding tests: every sharded dim divisible by 16 (heads, projected widths,
experts, expert hidden with 32-wide MXFP4 blocks per device, vocabulary, drafter heads), and a fast host-side
initialiser (NumPy draws instead of one XLA compile per parameter shape)."""
import jax
import numpy as np
from flax import nnx

import jdspark
import kimi
from kimi import mxfp4

PRESETS = ("tp16", "dp16-ep16")


def sharded_tiny_config(**kw) -> kimi.KimiConfig:
    """2 layers, every feature once: KDA + dense FFN, then gated MLA + LatentMoE (packed MXFP4, shared expert);
    AttnRes blocks of 1 so the depth softmax mixes real sources."""
    base = dict(num_hidden_layers=2, kda_layers=(1,), full_attn_layers=(2,), attn_res_block_size=1,
                kda_num_heads=16, kda_head_dim=8,
                num_attention_heads=16, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=8, num_experts=16, num_experts_per_token=2, moe_intermediate_size=512,
                routed_expert_hidden_size=64, intermediate_size=96, expert_format="mxfp4", kda_chunk_size=4)
    base.update(kw)
    return kimi.KimiConfig.tiny(**base)


def sharded_tiny_drafter_config(target_cfg: kimi.KimiConfig, **kw) -> jdspark.DSparkConfig:
    base = dict(num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=16, head_dim=4,
                intermediate_size=128, aux_hidden_state_layer_ids=(1, 2))
    base.update(kw)
    return jdspark.DSparkConfig.for_target(target_cfg, **base)


def random_model(cfg: kimi.KimiConfig, seed: int = 0) -> kimi.KimiForCausalLM:
    """A KimiForCausalLM with random parameters drawn on the host (same distributions as the module init, up to
    the draws; AttnRes pseudo-queries non-zero so the depth softmax is exercised)."""
    from kimi.info import abstract_model

    rng = np.random.default_rng(seed)
    model = abstract_model(cfg)
    flat, packed = [], {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        name, shape, dt = str(path[-1]), tuple(var.shape), np.dtype(var.dtype)
        parent = str(path[-2])
        if name.endswith(("_packed", "_scale")):  # MXFP4 experts: quantise one float draw per weight
            key = tuple(str(p) for p in path[:-1]) + (name.split("_")[0],)
            if key not in packed:
                n_in = shape[-1] * (2 if name.endswith("_packed") else mxfp4.BLOCK_SIZE)
                packed[key] = mxfp4.quantize(0.05 * rng.standard_normal(shape[:-1] + (n_in,), np.float32))
            value = packed[key][0 if name.endswith("_packed") else 1]
        elif name == "A_log":
            value = np.log(rng.uniform(1.0, 16.0, shape))
        elif name == "weight" and "norm" in parent:
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "e_score_correction_bias":
            value = 0.01 * rng.standard_normal(shape)
        elif "conv1d" in name:
            value = 0.25 * rng.standard_normal(shape)
        else:
            value = (0.1 if name == "dt_bias" else 0.05) * rng.standard_normal(shape)
        flat.append((path, var.replace(jax.device_put(np.asarray(value).astype(dt)))))
    nnx.update(model, nnx.from_flat_state(flat))
    return model
