"""The DSpark drafter's training objective: anchor selection, speculators' losses (losses/eager.py) and metrics
(dspark/metrics.py), the verifier's targets, and ``training_loss`` over a ``DSparkDrafter``'s training forward."""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from kimi.ops.norms import qwen3_rms_norm

f32 = jnp.float32
_LOSS_REDUCTION_EPS = 1e-5  # speculators losses/utils.py
_CONF_EPS = 1e-8  # speculators dspark/metrics.py
_NLA_EPS = 1e-5


# ====================================================================== anchors
def select_anchors(key, loss_mask_1T, num_anchors: int, block_size: int):
    """speculators' select_anchors with jax.random: up to num_anchors distinct positions with loss_mask set,
    excluding the last block_size positions, sorted; padding anchors are 0 with anchor_valid False."""
    m = jnp.asarray(loss_mask_1T)[0].astype(bool)
    T = m.shape[0]
    valid = m & (jnp.arange(T) < T - block_size)
    score = jnp.where(valid, jax.random.uniform(key, (T,)), 2.0)
    order = jnp.argsort(score)
    if num_anchors > T:
        order = jnp.concatenate([order, jnp.zeros((num_anchors - T,), order.dtype)])
    order = order[:num_anchors]
    k = jnp.minimum(num_anchors, valid.sum())
    anchor_valid = jnp.arange(num_anchors) < k
    anchors = jnp.sort(jnp.where(anchor_valid, order, T))
    return jnp.where(anchor_valid, anchors, 0).astype(jnp.int32), anchor_valid


# ====================================================================== losses (speculators losses/eager.py)
def _lsm(x):
    return jax.nn.log_softmax(x.astype(f32), axis=-1)


def kl_div_loss(logits, targets):
    lq, p = _lsm(logits), jax.nn.softmax(targets.astype(f32), axis=-1)
    return jnp.sum(jax.scipy.special.xlogy(p, p) - p * lq, axis=-1)


def reverse_kl_div_loss(logits, targets):
    lq, lp = _lsm(logits), _lsm(targets)
    return jnp.sum(jnp.exp(lq) * (lq - lp), axis=-1)


def js_div_loss(logits, targets):
    lq, lp = _lsm(logits), _lsm(targets)
    lm = jnp.logaddexp(lq, lp) - math.log(2.0)
    return 0.5 * (jnp.sum(jnp.exp(lp) * (lp - lm), -1) + jnp.sum(jnp.exp(lq) * (lq - lm), -1))


def ce_loss(logits, targets):
    tgt = jnp.argmax(targets, axis=-1)
    return -jnp.take_along_axis(_lsm(logits), tgt[..., None], axis=-1)[..., 0]


def _overlap(logits, targets):
    q = jax.nn.softmax(logits.astype(f32), axis=-1)
    p = jax.nn.softmax(targets.astype(f32), axis=-1)
    return jnp.sum(jnp.minimum(q, p), axis=-1)


def tv_loss(logits, targets):
    return 1.0 - _overlap(logits, targets)


def neg_log_acceptance_loss(logits, targets):
    return -jnp.log(jnp.maximum(_overlap(logits, targets), _NLA_EPS))


def lk_hybrid_loss(logits, targets, eta: float = 3.0):
    ov = _overlap(logits, targets)
    w = jnp.exp(-eta * jax.lax.stop_gradient(ov))
    return w * kl_div_loss(logits, targets) + (1.0 - w) * (1.0 - ov)


LOSS_FNS: dict[str, Callable] = {
    "kl_div": kl_div_loss, "rkl": reverse_kl_div_loss, "jsd": js_div_loss, "ce": ce_loss, "tv": tv_loss,
    "nla": neg_log_acceptance_loss, "lk_hybrid": lk_hybrid_loss,
}


def resolve_loss(spec) -> dict[str, tuple[Callable, float]]:
    """'kl_div', a JSON dict string '{"ce": 0.1, "tv": 0.9}', or a dict {name: weight} -> {name: (fn, weight)}."""
    if isinstance(spec, str):
        if spec in LOSS_FNS:
            return {spec: (LOSS_FNS[spec], 1.0)}
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError:
            raise ValueError(f"loss: unknown loss {spec!r}; use one of {sorted(LOSS_FNS)} or a JSON dict") from None
    if not isinstance(spec, dict) or not spec:
        raise ValueError(f"loss: expected a loss name or a non-empty {{name: weight}} dict, got {spec!r}")
    out = {}
    for name, w in spec.items():
        if name not in LOSS_FNS:
            raise ValueError(f"loss: unknown loss {name!r}; use one of {sorted(LOSS_FNS)}")
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            raise ValueError(f"loss: weight for {name!r} must be a number, got {w!r}")
        out[name] = (LOSS_FNS[name], float(w))
    return out


def dflash_loss_decay(pos, gamma: float, sample_from_anchor: bool):
    pos = pos.astype(f32)
    if sample_from_anchor:
        return jnp.exp(-pos / gamma)
    return jnp.exp(-jnp.maximum(pos - 1.0, 0.0) / gamma) * (pos != 0)


def dpace_loss_decay(masked_elementwise, mask, block_size: int, alpha: float):
    q = jnp.exp(-jax.lax.stop_gradient(masked_elementwise)).astype(f32).reshape(-1, block_size)
    m = mask.reshape(-1, block_size).astype(f32)
    smooth = jnp.where(m > 0, (1.0 - alpha) * q + alpha, 1.0)
    prefix = jnp.cumprod(smooth, axis=-1)
    w = jnp.flip(jnp.cumsum(jnp.flip(prefix * m, -1), -1), -1) * m
    return jax.lax.stop_gradient(w.reshape(-1))


def dspark_loss(logits_MV, targets_MV, confidence_M, mask_M, block_size: int, *, loss="kl_div", gamma: float = 4.0,
                confidence_head_alpha: float = 1.0, per_position_loss_weight: str = "fixed-exp-decay",
                dpace_alpha: float = 0.5, sample_from_anchor: bool = True):
    """speculators dspark/metrics.py::compute_metrics on flattened blocks (M = N * block_size rows).
    Returns (loss, metrics) with speculators' ``*_sum`` / ``*_total`` metric pairs."""
    if per_position_loss_weight not in ("fixed-exp-decay", "dpace"):
        raise ValueError(f"per_position_loss_weight: expected 'fixed-exp-decay' or 'dpace', "
                         f"got {per_position_loss_weight!r}")
    terms = resolve_loss(loss)
    M = logits_MV.shape[0]
    G = block_size
    nb = M // G
    pos = jnp.arange(M) % G
    start = 0 if sample_from_anchor else 1
    mask = mask_M.astype(f32)
    denom = mask.sum() + _LOSS_REDUCTION_EPS
    fixed = dflash_loss_decay(pos, gamma, sample_from_anchor)

    total = jnp.zeros((), f32)
    metrics: dict[str, Any] = {}
    for name, (fn, w) in terms.items():
        el = fn(logits_MV, targets_MV) * mask
        decay = dpace_loss_decay(el, mask, G, dpace_alpha) if per_position_loss_weight == "dpace" else fixed
        term = jnp.sum(el * decay) / denom
        if len(terms) > 1:
            metrics[f"{name}_loss_sum"] = jax.lax.stop_gradient(term)
            metrics[f"{name}_loss_total"] = jnp.ones((), f32)
        total = total + w * term

    sg = jax.lax.stop_gradient
    accept = sg(1.0 - tv_loss(logits_MV, targets_MV))
    acc_blk = accept.reshape(nb, G)
    draft_mask = mask.reshape(nb, G)[:, start:]
    accept_prefix = jnp.cumprod(acc_blk[:, start:] * draft_mask, axis=-1)
    mask_total = jnp.maximum(mask.sum(), 1.0)
    if confidence_M is not None:
        c = confidence_M.astype(f32)
        bce = (1.0 - accept) * c - jax.nn.log_sigmoid(c)
        conf_loss = jnp.sum(bce * mask * fixed) / (mask.sum() + _CONF_EPS)
        total = total + confidence_head_alpha * conf_loss
        prob = sg(jax.nn.sigmoid(c))
        conf_prefix = jnp.cumprod(prob.reshape(nb, G)[:, start:] * draft_mask, axis=-1)
        metrics.update({
            "confidence_loss_sum": sg(conf_loss), "confidence_loss_total": jnp.ones((), f32),
            "confidence_abs_error_sum": jnp.sum(jnp.abs(prob - accept) * mask),
            "confidence_abs_error_total": mask_total,
            "confidence_pred_mean_sum": jnp.sum(prob * mask), "confidence_pred_mean_total": mask_total,
            "confidence_cumprod_bias_sum": jnp.sum((conf_prefix - accept_prefix) * draft_mask),
            "confidence_cumprod_bias_total": jnp.maximum(draft_mask.sum(), 1.0),
        })
    metrics["loss_sum"] = sg(total)
    metrics["loss_total"] = jnp.ones((), f32)
    metrics["accept_rate_sum"] = jnp.sum(accept * mask)
    metrics["accept_rate_total"] = mask_total
    block_valid = (draft_mask.sum(-1) > 0).astype(f32)
    metrics["accept_len_sum"] = jnp.sum((accept_prefix.sum(-1) + 1.0) * block_valid)
    metrics["accept_len_total"] = jnp.maximum(block_valid.sum(), 1.0)

    correct = jnp.argmax(logits_MV, -1) == jnp.argmax(targets_MV, -1)
    on = mask_M != 0
    corr_pos = jnp.sum((correct & on).reshape(nb, G), axis=0).astype(f32)
    tot_pos = jnp.sum(on.reshape(nb, G), axis=0).astype(f32)
    metrics["full_acc_sum"] = corr_pos[start:].sum()
    metrics["full_acc_total"] = tot_pos[start:].sum()
    for k in range(start, G):
        metrics[f"position_{k}_acc_sum"] = corr_pos[k]
        metrics[f"position_{k}_acc_total"] = tot_pos[k]
    ok = (correct.reshape(nb, G)[:, start:] & (draft_mask != 0)).astype(f32)
    bv = jnp.any(draft_mask != 0, axis=-1).astype(f32)
    metrics["eal_sum"] = jnp.sum((jnp.cumprod(ok, -1).sum(-1) + 1.0) * bv)
    metrics["eal_total"] = bv.sum()
    return total, metrics


def verifier_targets(verifier_last_hidden_1TD, verifier_norm_D, lm_head_DV, rows, eps: float):
    """Target logits = lm_head(RMSNorm_verifier(last hidden[rows])) (fp32, no gradient)."""
    h = jnp.asarray(verifier_last_hidden_1TD)[0][rows]
    t = jnp.matmul(qwen3_rms_norm(h, jnp.asarray(verifier_norm_D), eps).astype(lm_head_DV.dtype), lm_head_DV,
                   preferred_element_type=f32)
    return jax.lax.stop_gradient(t)


def training_loss(drafter, taps_1TX, input_ids_1T, loss_mask_1T, anchors_N, anchor_valid_N,
                  verifier_last_hidden_1TD, verifier_norm_D, embed_VD, lm_head_DV, document_ids_1T=None,
                  position_ids_1T=None, loss="kl_div", gamma: float = 4.0, confidence_head_alpha: float = 1.0,
                  per_position_loss_weight: str = "fixed-exp-decay", dpace_alpha: float = 0.5,
                  verifier_lm_head_DV=None, verifier_norm_eps: Optional[float] = None, return_outputs: bool = False):
    """speculators' ``DSparkDraftModel.forward`` loss for explicit anchors (0.9.0 defaults: kl_div, exp(-k/gamma)
    weights with gamma 4, confidence BCE against 1 - TV with alpha 1). Differentiable w.r.t. the drafter
    (``nnx.value_and_grad(training_loss, has_aux=True)``; no keyword-only parameters, so nnx transforms can bind
    them). Returns (loss, metrics) [, outputs]."""
    cfg = drafter.config
    out = drafter.training_outputs(taps_1TX, input_ids_1T, anchors_N, embed_VD, lm_head_DV,
                                   document_ids_1T=document_ids_1T, position_ids_1T=position_ids_1T)
    idx = out["block_indices"]
    T = taps_1TX.shape[1]
    tgt_rows = idx if cfg.sample_from_anchor else (idx - 1) % T
    vlm = lm_head_DV if verifier_lm_head_DV is None else verifier_lm_head_DV
    eps = cfg.rms_norm_eps if verifier_norm_eps is None else verifier_norm_eps
    targets = verifier_targets(verifier_last_hidden_1TD, verifier_norm_D, vlm, tgt_rows, eps)
    m = jnp.asarray(loss_mask_1T)[0][idx].astype(f32) * jnp.asarray(anchor_valid_N).astype(f32)[:, None]
    if not cfg.sample_from_anchor:
        m = m.at[:, 0].set(0.0)
    N, G = idx.shape
    conf = out["confidence_logits"]
    loss_val, metrics = dspark_loss(
        out["logits"].reshape(N * G, -1), targets.reshape(N * G, -1), None if conf is None else conf.reshape(-1),
        m.reshape(-1), G, loss=loss, gamma=gamma, confidence_head_alpha=confidence_head_alpha,
        per_position_loss_weight=per_position_loss_weight, dpace_alpha=dpace_alpha,
        sample_from_anchor=cfg.sample_from_anchor)
    if return_outputs:
        out = dict(out, targets=targets, loss_mask=m)
        return loss_val, metrics, out
    return loss_val, metrics

