"""Fine-tune an exported target with sequence-level unlikelihood (``jdspark.unlikelihood``) plus likelihood on real
text, so that its greedy continuations stop looping.

  python scripts/train_unlikelihood.py --init checkpoints/default/target --out runs/ul --steps 300 \\
      --export runs/ul_target

Each step: a packed batch of the training split ([B, seq_len + 1]) gives the likelihood term (mean next-token NLL,
as ``train_target.py``) and 2B prefixes of ``--prefix-len`` tokens (each row's start and middle); the model being
trained continues each prefix greedily for ``--continuation`` tokens (one jitted batched decode), and the tokens
of its own repeated ``--ngram``-grams get the unlikelihood term, weighted ``--alpha``:

    loss = NLL(real text) + alpha * L_UL(own greedy continuations)

Orbax checkpoints every ``--ckpt-every`` steps (``--resume`` continues exactly: the data of step s is a function of
s and the weights). ``--export`` writes the HF-style checkpoint as shipped (routed experts MXFP4, the rest bf16
loaded fp32, shards of at most 12 MiB, the tokenizer beside it) and reports its held-out bits per byte.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from train_target import _restore, _save, copy_tokenizer, eval_loss, loss_fn, split_model, to_mxfp4

import kimi
from jdspark import data as jdata
from jdspark.evaluate import bits_per_byte
from jdspark.train import OptConfig, ckpt_manager, make_optimizer
from jdspark.unlikelihood import repeated_ngram_mask, unlikelihood_loss
from kimi.cache import KimiCache
from kimi.checkpoint_save import save_checkpoint

_DATA_ARGS = ("batch", "seq_len", "seed", "prefix_len", "continuation", "ngram")
SHARD_BYTES = 12 * 2 ** 20  # no committed file over 20 MB (checkpoints/default/README.md)


def load_trainable(init_dir: str):
    """The exported target as a trainable model: experts dequantised to dense fp32, fp32 weights, KDA's chunked
    prefill form (the trainer's: faster under grad on XLA:CPU, ``train_target.model_config``)."""
    return kimi.load_checkpoint(init_dir, config_overrides={"expert_format": "dense", "param_dtype": "float32",
                                                              "kda_prefill": "chunked"})


@functools.partial(jax.jit, static_argnames=("graphdef", "length"))
def greedy_continue(params, frozen, prefix_BP, *, graphdef, length: int):
    """[B, length] greedy continuations of the prefixes [B, P] by the model (prefill, then a scan of decodes)."""
    model = nnx.merge(graphdef, params, frozen)
    B, P = prefix_BP.shape
    pre = model.forward(prefix_BP, KimiCache.init(model.config, B, P), mode="prefill")
    first_B = jnp.argmax(pre.logits[:, -1], axis=-1).astype(jnp.int32)

    def body(carry, _):
        tok_B, cache = carry
        r = model.forward(tok_B[:, None], cache, mode="decode")
        return (jnp.argmax(r.logits.reshape(B, -1), axis=-1).astype(jnp.int32), r.cache), tok_B

    _, toks_LB = jax.lax.scan(body, (first_B, pre.cache.padded_to(P + length)), None, length=length)
    return toks_LB.T


def _ul_loss(params, frozen, seq_BT1, mask_BT, *, graphdef):
    """Unlikelihood of the marked tokens of sequences [B, T+1] (``mask_BT`` marks the targets seq[:, 1:])."""
    model = nnx.merge(graphdef, params, frozen)
    B, T1 = seq_BT1.shape
    out = model.forward(seq_BT1[:, :-1], KimiCache.init(model.config, B, T1 - 1), mode="prefill")
    return unlikelihood_loss(out.logits, seq_BT1[:, 1:], mask_BT)


@functools.partial(jax.jit, static_argnames=("graphdef", "opt", "alpha"), donate_argnames=("params", "opt_state"))
def ul_step(params, opt_state, frozen, tokens_BT1, doc_ids_BT1, seq_BT1, mask_BT, *, graphdef, opt: OptConfig,
            alpha: float):
    def total(p):
        nll, _ = loss_fn(p, frozen, tokens_BT1, doc_ids_BT1, graphdef=graphdef)
        ul = _ul_loss(p, frozen, seq_BT1, mask_BT, graphdef=graphdef)
        return nll + alpha * ul, (nll, ul)

    (loss, (nll, ul)), grads = jax.value_and_grad(total, has_aux=True)(params)
    updates, opt_state = make_optimizer(opt).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss, "nll": nll, "ul": ul,
                                                              "grad_norm": optax.tree.norm(grads)}


def export_as_shipped(model, out_dir: str, tokenizer_dir: str) -> None:
    """``out_dir``: routed experts MXFP4, the rest bf16 with ``torch_dtype`` float32 (loaded fp32), shards of at most
    ``SHARD_BYTES``, the tokenizer files copied; written to a temporary directory, then renamed."""
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    tmp = tempfile.mkdtemp(prefix=".ul-export-", dir=parent)
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would become the checkpoint's own mode
    save_checkpoint(to_mxfp4(model, "bfloat16"), tmp, max_shard_bytes=SHARD_BYTES)
    cfg_path = os.path.join(tmp, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = "float32"  # fp32 compute with the bf16 serving copy's matmuls (the model card says why)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    copy_tokenizer(tokenizer_dir, tmp)
    if os.path.exists(out_dir):
        old = out_dir.rstrip("/") + ".old"
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out_dir)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def train(a) -> dict:
    model = load_trainable(a.init)
    tok = kimi.load_tokenizer(a.init, vocab_size=model.config.vocab_size)
    graphdef, params, frozen = split_model(model)
    opt = OptConfig(lr=a.lr, steps=a.steps, warmup=a.warmup, min_lr_ratio=a.min_lr_ratio,
                    weight_decay=a.weight_decay, clip=a.clip)
    opt_state = make_optimizer(opt).init(params)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    mngr = ckpt_manager(out, 2)
    data = {k: getattr(a, k) for k in _DATA_ARGS}  # what step s's batch and prefixes depend on, besides s
    data["init"] = str(Path(a.init).resolve())
    start = 0
    if a.resume and mngr.latest_step() is not None:
        params, opt_state, meta = _restore(mngr, mngr.latest_step(), params, opt_state)
        for k, v in data.items():  # lr and alpha may change on resume (the model card's run did); the data not
            if meta.get("data", {}).get(k) != v:
                raise ValueError(f"--resume: {k} was {meta.get('data', {}).get(k)!r} in the checkpoint, now {v!r}; "
                                 "the data stream would differ")
        start = int(meta["step"])
        _log(f"[ul] resumed from step {start}")
    ds = jdata.PackedDataset(jdata.read_documents(jdata.list_files(None, "train")), batch=a.batch,
                             seq_len=a.seq_len, seed=a.seed, tokenizer=tok)
    val = jdata.validation_batches(batch=4, seq_len=512, num_batches=a.val_batches, tokenizer=tok)
    lengths_V = jdata.byte_lengths(tok, model.config.vocab_size)
    P, L, half = a.prefix_len, a.continuation, a.seq_len // 2
    if half < P:
        raise ValueError(f"--prefix-len {P} must fit half of --seq-len ({a.seq_len})")

    def validate(s):
        vl, va, bpb = eval_loss(params, frozen, val, graphdef=graphdef, lengths_V=lengths_V)
        _log(f"[ul][val] step {s}: loss {vl:.4f}  ({bpb:.3f} bits/byte)")
        return bpb

    metrics = open(out / "metrics.jsonl", "a")
    if start == 0 and a.val_batches:
        metrics.write(json.dumps({"step": 0, "val_bits_per_byte": validate(0)}) + "\n")
    t0 = time.perf_counter()
    stop = a.steps if a.stop_at is None else min(a.steps, a.stop_at)
    for step in range(start, stop):
        b = ds.batch_at(step)
        tokens = jnp.asarray(b.tokens)
        prefix = np.concatenate([b.tokens[:, :P], b.tokens[:, half:half + P]], axis=0).astype(np.int32)
        cont = np.asarray(greedy_continue(params, frozen, jnp.asarray(prefix), graphdef=graphdef, length=L))
        seq = np.concatenate([prefix, cont], axis=1)  # [2B, P + L]
        mask = repeated_ngram_mask(seq, P, a.ngram)[:, 1:]  # targets seq[:, 1:]
        params, opt_state, m = ul_step(params, opt_state, frozen, tokens, jnp.asarray(b.doc_ids), jnp.asarray(seq),
                                       jnp.asarray(mask), graphdef=graphdef, opt=opt, alpha=a.alpha)
        rec = {k: float(v) for k, v in m.items()}
        rec.update(step=step + 1, repeated_share=float(mask[:, P - 1:].mean()))
        if not math.isfinite(rec["loss"]):
            raise FloatingPointError(f"loss is {rec['loss']} at step {step}; lower --lr")
        metrics.write(json.dumps(rec) + "\n")
        metrics.flush()
        if (step + 1) % a.log_every == 0:
            _log(f"[ul] step {step + 1}/{a.steps} nll {rec['nll']:.3f} ul {rec['ul']:.3f} repeated "
                 f"{rec['repeated_share']:.2f} ({time.perf_counter() - t0:.0f}s)")
        if (step + 1) % a.ckpt_every == 0 or step + 1 == stop:
            _save(mngr, step + 1, params, opt_state, {"step": step + 1, "data": data})
        if a.val_every and (step + 1) % a.val_every == 0 and a.val_batches:
            metrics.write(json.dumps({"step": step + 1, "val_bits_per_byte": validate(step + 1)}) + "\n")
    mngr.wait_until_finished()
    summary = {"steps": a.steps, "out": str(out)}
    if a.export and stop < a.steps:
        _log(f"[ul] not exporting: stopped at step {stop} before --steps {a.steps}")
    elif a.export:
        model = nnx.merge(graphdef, params, frozen)
        export_as_shipped(model, a.export, a.init)
        summary["export"] = a.export
        if a.val_batches:  # the model as shipped: MXFP4 experts, bf16 weights loaded fp32
            summary["export_bits_per_byte"] = bits_per_byte(kimi.load_checkpoint(a.export), val, lengths_V)
            _log(f"[ul] exported {a.export}: {summary['export_bits_per_byte']:.3f} bits/byte")
    return summary


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--init", required=True, help="the exported target to fine-tune (HF-style directory)")
    p.add_argument("--out", required=True, help="run directory (orbax checkpoints, metrics.jsonl)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=4, help="rows of real text per step (2x as many prefixes)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--prefix-len", type=int, default=64)
    p.add_argument("--continuation", type=int, default=128)
    p.add_argument("--ngram", type=int, default=4)
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=7, help="data order (a different one from the target's training)")
    p.add_argument("--val-batches", type=int, default=16)
    p.add_argument("--val-every", type=int, default=100)
    p.add_argument("--ckpt-every", type=int, default=25)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--stop-at", type=int, default=None, help="checkpoint and stop at this step (then --resume)")
    p.add_argument("--export", default=None)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    for k in ("steps", "batch", "seq_len", "prefix_len", "continuation", "ngram", "ckpt_every", "log_every"):
        if getattr(a, k) < 1:
            p.error(f"--{k.replace('_', '-')}: expected a positive int, got {getattr(a, k)}")
    if a.alpha < 0:
        p.error(f"--alpha: expected >= 0, got {a.alpha}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    s = train(a)
    if a.json:
        print(json.dumps(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
