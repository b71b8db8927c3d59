"""Training pieces shared by the target and drafter trainers, and the DSpark drafter's training step.

Drafter training follows speculators' DSpark recipe on hidden states taken from *our own serving forward*: each
step runs the target's jitted prefill (the function ``generate`` serves with, experts as shipped, MXFP4) over a
packed batch to get the taps and the final hidden state, then trains the drafter on anchors sampled where the loss
mask allows (``training_loss``: KL to the target's next-token distribution with weights exp(-k/gamma), confidence
BCE toward 1 - TV). ``--cache-dir`` stores those hidden states once (memory-mapped .npy) instead of recomputing.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from jdspark.drafter import DSparkDrafter, select_anchors, training_loss
from kimi.cache import KimiCache

CKPT_FORMAT = 1


# ---------------------------------------------------------------------------------------------------------------
# optimiser
@dataclasses.dataclass(frozen=True)
class OptConfig:
    lr: float = 3e-3
    steps: int = 1000
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip: float = 1.0

    def schedule(self):
        """Linear warmup to lr, then cosine decay to lr * min_lr_ratio at ``steps``."""
        warm = max(int(self.warmup), 1)
        decay = max(int(self.steps), warm + 1)
        return optax.warmup_cosine_decay_schedule(self.lr / warm, self.lr, warm, decay,
                                                  end_value=self.lr * self.min_lr_ratio)


def make_optimizer(opt: OptConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with weight decay on matrices only (not norms, gates or biases)."""
    decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(opt.clip),
        optax.adamw(opt.schedule(), b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay, mask=decay_mask))


# ---------------------------------------------------------------------------------------------------------------
# checkpoints (orbax: atomic, keep the last N)
def ckpt_manager(out: Path, keep: int):
    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=True)
    return ocp.CheckpointManager((Path(out) / "ckpt").resolve(), options=opts)


def _leaf_names(tree) -> list[str]:
    return [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def save_state(mngr, step: int, tree, meta: dict):
    """Save a pytree of arrays (host copies: device buffers may be donated next step) plus JSON metadata."""
    leaves = jax.device_get(jax.tree.leaves(tree))
    arrays = {f"leaf_{i:05d}": np.asarray(x) for i, x in enumerate(leaves)}
    meta = dict(meta, leaf_names=_leaf_names(tree), format=CKPT_FORMAT)
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)))


def restore_state(mngr, step: int, like):
    """Restore the pytree saved at ``step`` into the structure of ``like``; error if the structures differ."""
    meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    names = _leaf_names(like)
    if meta.get("leaf_names") != names:
        diff = sorted(set(names) ^ set(meta.get("leaf_names") or []))[:5]
        raise ValueError(f"checkpoint at step {step} does not match this model/optimizer (differing tensors, "
                         f"first few: {diff}); the same configuration is needed to resume")
    leaves, treedef = jax.tree.flatten(like)
    target = {f"leaf_{i:05d}": np.zeros(np.shape(x), np.asarray(x).dtype) for i, x in enumerate(leaves)}
    got = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
    new = [jnp.asarray(np.asarray(got[f"leaf_{i:05d}"]), dtype=np.asarray(x).dtype) for i, x in enumerate(leaves)]
    return jax.tree.unflatten(treedef, new), meta


# ---------------------------------------------------------------------------------------------------------------
# drafter training
def target_hidden(target, tokens_BT, tap_layers: tuple):
    """The serving forward's taps [B, T, X] and final pre-norm hidden [B, T, D] (fresh cache per row)."""
    B, T = tokens_BT.shape
    out = target.forward(tokens_BT, KimiCache.init(target.config, B, T), mode="prefill", tap_layers=tap_layers)
    return jax.lax.stop_gradient(out.taps), jax.lax.stop_gradient(out.last_hidden)


def pack_rows(tokens_BT, doc_ids_BT, taps_BTX, hidden_BTD):
    """B rows -> one packed row (speculators trains batch 1, packed): document ids distinct per row and document,
    positions restarting at each document."""
    B, T = tokens_BT.shape
    docs = doc_ids_BT + (jnp.arange(B, dtype=jnp.int32) * (T + 1))[:, None]
    flat_docs = docs.reshape(1, B * T)
    starts = jnp.concatenate([jnp.ones((1, 1), bool), flat_docs[:, 1:] != flat_docs[:, :-1]], axis=1)
    idx = jnp.arange(B * T)[None]
    last_start = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    pos = (idx - last_start).astype(jnp.int32)
    return (tokens_BT.reshape(1, B * T), flat_docs, pos, taps_BTX.reshape(1, B * T, -1),
            hidden_BTD.reshape(1, B * T, -1))


def drafter_loss(params, rest, t_state, tokens_BT, doc_ids_BT, key, *, d_graph, t_graph, num_anchors: int,
                 loss: str):
    target = nnx.merge(t_graph, t_state)
    drafter = nnx.merge(d_graph, params, rest)
    cfg = drafter.config
    taps, hidden = target_hidden(target, tokens_BT, tuple(cfg.aux_hidden_state_layer_ids))
    ids, docs, pos, taps, hidden = pack_rows(tokens_BT, doc_ids_BT, taps, hidden)
    mask = jnp.ones_like(ids, jnp.float32)
    anchors, valid = select_anchors(key, mask, num_anchors, cfg.block_size)
    embed = jax.lax.stop_gradient(target.embed_tokens.embedding[...])
    lm_head = jax.lax.stop_gradient(target.lm_head_DV())
    norm_w = jax.lax.stop_gradient(target.model.norm.weight[...])
    return training_loss(drafter, taps, ids, mask, anchors, valid, hidden, norm_w, embed, lm_head, docs, pos, loss,
                         4.0, 1.0, "fixed-exp-decay", 0.5, None, target.config.rms_norm_eps)


@functools.partial(jax.jit, static_argnames=("d_graph", "t_graph", "opt", "num_anchors", "loss"),
                   donate_argnames=("params", "opt_state"))
def drafter_train_step(params, opt_state, rest, t_state, tokens_BT, doc_ids_BT, key, *, d_graph, t_graph,
                       opt: OptConfig, num_anchors: int, loss: str = "kl_div"):
    """One AdamW step of the drafter on a packed batch; the target is frozen. Returns (params, opt_state, metrics)."""
    (val, metrics), grads = jax.value_and_grad(drafter_loss, has_aux=True)(
        params, rest, t_state, tokens_BT, doc_ids_BT, key, d_graph=d_graph, t_graph=t_graph,
        num_anchors=num_anchors, loss=loss)
    updates, opt_state = make_optimizer(opt).update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, dict(metrics, loss=val, grad_norm=optax.tree.norm(grads))


@functools.partial(jax.jit, static_argnames=("d_graph", "t_graph", "num_anchors", "loss"))
def drafter_eval_step(params, rest, t_state, tokens_BT, doc_ids_BT, key, *, d_graph, t_graph, num_anchors: int,
                      loss: str = "kl_div"):
    val, metrics = drafter_loss(params, rest, t_state, tokens_BT, doc_ids_BT, key, d_graph=d_graph,
                                t_graph=t_graph, num_anchors=num_anchors, loss=loss)
    return dict(metrics, loss=val)


def summarize(metrics_list: list, block_size: int) -> dict:
    """Analytic accept_len (speculators' accept_len: 1 + sum of cumulative prod of 1 - TV) and per-position
    greedy accuracy, pooled over a list of metric dicts (their *_sum / *_total pairs)."""
    tot = {}
    for m in metrics_list:
        for k, v in m.items():
            tot[k] = tot.get(k, 0.0) + float(v)

    def ratio(name):
        return tot.get(f"{name}_sum", 0.0) / max(tot.get(f"{name}_total", 0.0), 1e-9)

    return {"loss": tot["loss"] / len(metrics_list), "accept_len": ratio("accept_len"),
            "greedy_accept_len": ratio("eal"), "accept_rate": ratio("accept_rate"),
            "per_position_acc": [ratio(f"position_{k}_acc") for k in range(block_size)
                                 if f"position_{k}_acc_sum" in tot]}


def split_drafter(drafter: DSparkDrafter):
    """(graphdef, trainable params, the rest)."""
    return nnx.split(drafter, nnx.Param, ...)
