#!/usr/bin/env python
"""Train the small K3-shaped target (``KimiConfig.demo()``) on byte-level text; export it with MXFP4 experts.

    python scripts/train_target.py --out runs/target --steps 1700 --batch 4 --seq-len 512   # ~40 min, 2 cores
    python scripts/train_target.py --out runs/target --steps 1700 --resume                  # continue exactly
    python scripts/train_target.py --out runs/target --steps 1700 --resume --export checkpoints/default/target

What it does
  * the model: ``demo()`` (or ``--preset tiny``) with routed experts held DENSE in fp32 while training
    (``expert_format="dense"``); ``--export`` quantises them to MXFP4 (kimi.mxfp4.quantize) into an
    ``expert_format="mxfp4"`` copy and writes it with ``kimi.checkpoint_save.save_checkpoint``.
  * data: jdspark.data's packed iterator over the stdlib (or ``--corpus DIR``), a pure function of (seed, step);
    validation loss on the held-out files every ``--val-every`` steps and at the end.
  * loss: next-token cross-entropy over each packed row, every row run from a fresh KDA/MLA cache
    (``model.forward(tokens, KimiCache.init(cfg, B, T), mode="prefill")``); the EOS -> BOS transitions between
    packed documents are not scored.
  * optimiser: optax AdamW (decay on matrices only), linear warmup + cosine decay, global-norm clipping. The
    router's ``e_score_correction_bias`` is not a gradient parameter: it is split off and kept as it is.
  * one jitted step over (params, opt_state) split once from the module (nnx.split), params/opt state donated.
  * orbax checkpoints under ``OUT/ckpt`` (atomic, the last ``--keep``), holding params, optimizer state, step and
    data position; ``--resume`` restores the latest one and continues with the same batches and the same
    losses as an uninterrupted run.
  * progress lines (loss, lr, grad norm, tokens/s, ETA) on stderr and ``OUT/metrics.jsonl``; ``--json`` prints one
    summary object on stdout, last.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jdspark import data as jdata
from jdspark.evaluate import token_nll
from jdspark.train import OptConfig, make_optimizer, restore_state, save_state
from jdspark.train import ckpt_manager as _ckpt_manager
from kimi import mxfp4
from kimi.cache import KimiCache
from kimi.checkpoint_save import save_checkpoint
from kimi.config import KimiConfig
from kimi.model import KimiForCausalLM
from kimi.tokenizer import load_tokenizer

PRESETS = ("demo", "tiny")

__all__ = ["OptConfig", "model_config", "inference_config", "build_model",
           "split_model", "loss_fn", "make_optimizer", "train_step", "eval_loss", "to_mxfp4", "export_mxfp4", "train",
           "parse_args", "main"]


# ---------------------------------------------------------------------------------------------------------------
# model
_CONFIG_FIELDS = {f.name: f for f in dataclasses.fields(KimiConfig)}
_TRAINING_ONLY_FIELDS = ("kda_prefill",)  # runtime choices made for training, reset to the defaults on export


def model_config(preset: str = "demo", tokenizer=None, **overrides) -> KimiConfig:
    """The training config: the preset with dense fp32 experts and the tokenizer's special ids (the byte
    vocabulary's without one; a ``kimi.tokenizer.Tokenizer`` sets the vocabulary, rounded up to 128)."""
    if preset not in PRESETS:
        raise ValueError(f"preset: expected one of {PRESETS}, got {preset!r}")
    cfg = getattr(KimiConfig, preset)()
    kw = dict(expert_format="dense", param_dtype="float32", bos_token_id=jdata.BOS_ID, eos_token_id=jdata.EOS_ID,
              pad_token_id=jdata.PAD_ID)
    if tokenizer is not None:
        for role in ("bos", "eos", "pad"):
            if getattr(tokenizer, f"{role}_id") is None:
                raise ValueError(f"tokenizer: no {role} token; the trainer needs bos, eos and pad")
        kw.update(vocab_size=-(-tokenizer.vocab_size // 128) * 128, bos_token_id=tokenizer.bos_id,
                  eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    if "kda_prefill" in _CONFIG_FIELDS:
        # Under grad on XLA:CPU the chunked form is ~2.5x faster than the token scan
        # (measured, demo() at 4 x 512: 1.3 s vs 3.3 s a step); export resets it (inference_config).
        kw["kda_prefill"] = "chunked"
    kw.update(overrides)
    cfg = cfg.replace(**kw)
    need = jdata.VOCAB_SIZE if tokenizer is None else tokenizer.vocab_size
    if cfg.vocab_size < need:
        raise ValueError(f"vocab_size: {cfg.vocab_size} is smaller than the tokenizer's {need}")
    return cfg


def inference_config(cfg: KimiConfig, **overrides) -> KimiConfig:
    """``cfg`` with the training-only runtime choices reset to KimiConfig's defaults."""
    kw = {k: _CONFIG_FIELDS[k].default for k in _TRAINING_ONLY_FIELDS if k in _CONFIG_FIELDS}
    kw.update(overrides)
    return cfg.replace(**kw)


def build_model(cfg: KimiConfig, seed: int = 0) -> KimiForCausalLM:
    return KimiForCausalLM(cfg, rngs=nnx.Rngs(seed))


def _is_trainable(path, value) -> bool:
    """Every nnx.Param except the router's selection bias (not trained by gradient)."""
    return isinstance(value, nnx.Param) and path[-1] != "e_score_correction_bias"


def split_model(model: KimiForCausalLM):
    """(graphdef, trainable params, everything else) — split once, outside any loop."""
    return nnx.split(model, _is_trainable, ...)


def loss_fn(params, frozen, tokens_BT1, doc_ids_BT1, *, graphdef):
    """Mean next-token cross-entropy of a packed batch; returns (loss, (n_scored, n_correct))."""
    model = nnx.merge(graphdef, params, frozen)
    cfg = model.config
    B, T1 = tokens_BT1.shape
    T = T1 - 1
    cache = KimiCache.init(cfg, B, T)
    out = model.forward(tokens_BT1[:, :-1], cache, mode="prefill")
    nll_BT, mask_BT, correct_BT = token_nll(out.logits, tokens_BT1, doc_ids_BT1)  # no EOS -> next BOS
    n = jnp.maximum(mask_BT.sum(), 1.0)
    loss = (nll_BT * mask_BT).sum() / n
    correct = (correct_BT * mask_BT).sum()
    return loss, (mask_BT.sum(), correct)


# ---------------------------------------------------------------------------------------------------------------
# optimiser
# OptConfig and make_optimizer: jdspark.train (shared with the drafter trainer)


@functools.partial(jax.jit, static_argnames=("graphdef", "opt"), donate_argnames=("params", "opt_state"))
def train_step(params, opt_state, frozen, tokens_BT1, doc_ids_BT1, *, graphdef, opt: OptConfig):
    """One AdamW step; returns (params, opt_state, metrics). params and opt_state are donated."""
    (loss, (n, correct)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, frozen, tokens_BT1, doc_ids_BT1, graphdef=graphdef)
    tx = make_optimizer(opt)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "acc": correct / jnp.maximum(n, 1.0)}
    return params, opt_state, metrics


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _eval_step(params, frozen, tokens_BT1, doc_ids_BT1, *, graphdef):
    loss, (n, correct) = loss_fn(params, frozen, tokens_BT1, doc_ids_BT1, graphdef=graphdef)
    return loss * n, n, correct


def scored_bytes(b: jdata.Batch, lengths_V: np.ndarray) -> int:
    """Bytes of the targets ``loss_fn`` scores in ``b`` (``lengths_V``: jdata.byte_lengths)."""
    mask = b.doc_ids[:, 1:] == b.doc_ids[:, :-1]
    return int(lengths_V[b.tokens[:, 1:]][mask].sum())


def eval_loss(params, frozen, batches: Sequence[jdata.Batch], *, graphdef,
              lengths_V: Optional[np.ndarray] = None) -> tuple[float, float, float]:
    """Token-weighted (loss in nats per token, accuracy, bits per byte) over fixed batches; bits per byte is
    the summed loss over the scored targets' bytes (``lengths_V``; each token one byte when None)."""
    tot = n = corr = nbytes = 0.0
    for b in batches:
        s, k, c = _eval_step(params, frozen, jnp.asarray(b.tokens), jnp.asarray(b.doc_ids), graphdef=graphdef)
        tot, n, corr = tot + float(s), n + float(k), corr + float(c)
        nbytes += float(k) if lengths_V is None else scored_bytes(b, lengths_V)
    return tot / max(n, 1.0), corr / max(n, 1.0), tot / math.log(2) / max(nbytes, 1.0)


# ---------------------------------------------------------------------------------------------------------------
# export: MXFP4 experts
_EXPERT_WEIGHTS = ("w1", "w2", "w3")


def to_mxfp4(model: KimiForCausalLM, param_dtype: Optional[str] = None) -> KimiForCausalLM:
    """A copy of ``model`` with ``expert_format="mxfp4"``: every routed expert quantised with kimi.mxfp4.quantize
    (E2M1 codes + E8M0 block-32 scales); all other weights copied (cast to ``param_dtype`` if given)."""
    cfg = model.config
    cfg_q = inference_config(cfg, expert_format="mxfp4", **({"param_dtype": param_dtype} if param_dtype else {}))
    src = nnx.to_pure_dict(nnx.state(model))
    q_model = KimiForCausalLM(cfg_q, rngs=nnx.Rngs(0))
    dst_state = nnx.state(q_model)
    dst = nnx.to_pure_dict(dst_state)

    def walk(s, d, path):
        for k, v in s.items():
            if isinstance(v, dict):
                if k not in d:
                    raise ValueError(f"to_mxfp4: {'.'.join(map(str, path + (k,)))} missing in the MXFP4 model")
                walk(v, d[k], path + (k,))
            elif path and path[-1] == "experts" and k in _EXPERT_WEIGHTS:
                packed, scale = mxfp4.quantize(np.asarray(v, np.float32))
                for name, arr in ((f"{k}_packed", packed), (f"{k}_scale", scale)):
                    if tuple(d[name].shape) != tuple(arr.shape):
                        raise ValueError(f"to_mxfp4: {name} has shape {arr.shape}, expected {d[name].shape}")
                    d[name] = jnp.asarray(arr)
            else:
                if k not in d or tuple(d[k].shape) != tuple(np.shape(v)):
                    raise ValueError(f"to_mxfp4: {'.'.join(map(str, path + (k,)))} does not match the MXFP4 model")
                d[k] = jnp.asarray(v, dtype=d[k].dtype)

    walk(src, dst, ())
    nnx.replace_by_pure_dict(dst_state, dst)
    nnx.update(q_model, dst_state)
    return q_model


def export_mxfp4(model: KimiForCausalLM, out_dir, param_dtype: Optional[str] = None):
    """Write ``model`` as an HF-style checkpoint (config.json + safetensors) with MXFP4 experts, through
    kimi.checkpoint_save.save_checkpoint. Returns the quantised model."""
    q = to_mxfp4(model, param_dtype)
    save_checkpoint(q, os.fspath(out_dir))
    return q


# ---------------------------------------------------------------------------------------------------------------
# checkpoints (orbax): the (params, opt_state) leaves under stable names, plus a JSON record
def _save(mngr, step: int, params, opt_state, meta: dict):
    save_state(mngr, step, (params, opt_state), meta)


def _restore(mngr, step: int, params, opt_state):
    (params, opt_state), meta = restore_state(mngr, step, (params, opt_state))
    return params, opt_state, meta


# ---------------------------------------------------------------------------------------------------------------
# the loop
_DATA_KEYS = ("preset", "batch", "seq_len", "seed", "corpus", "config_overrides", "tokenizer")
_TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model", "tokenizer_config.json")


def _tokenizer_digest(path) -> Optional[str]:
    """SHA-256 over the tokenizer's files (a resumed run must tokenise the same way), or None for bytes."""
    if not path:
        return None
    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        f = Path(path) / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def copy_tokenizer(src, dst) -> None:
    """The tokenizer's files into an exported checkpoint directory (each via a temporary name)."""
    for name in _TOKENIZER_FILES:
        f = Path(src) / name
        if f.is_file():
            tmp = Path(dst) / f".{name}.tmp"
            shutil.copyfile(f, tmp)
            os.replace(tmp, Path(dst) / name)


def _log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def _fmt_time(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def train(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("batch", "seq_len", "keep", "log_every"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')}: expected a positive int, got {getattr(args, name)}")
    if args.steps < 0:
        raise ValueError(f"--steps: expected >= 0, got {args.steps}")
    overrides = json.loads(args.config_overrides) if args.config_overrides else {}
    if not isinstance(overrides, dict):
        raise ValueError(f"--config-overrides: expected a JSON object, got {args.config_overrides!r}")
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    cfg = model_config(args.preset, tokenizer, **overrides)
    opt = OptConfig(lr=args.lr, steps=args.steps, warmup=args.warmup if args.warmup is not None
                    else max(1, min(200, args.steps // 20)), min_lr_ratio=args.min_lr_ratio,
                    weight_decay=args.weight_decay, clip=args.clip)
    run_info = {"preset": args.preset, "batch": args.batch, "seq_len": args.seq_len, "seed": args.seed,
                "corpus": str(Path(args.corpus).resolve()) if args.corpus else None,
                "config_overrides": overrides, "opt": dataclasses.asdict(opt),
                "tokenizer": _tokenizer_digest(args.tokenizer)}

    model = build_model(cfg, args.seed)
    graphdef, params, frozen = split_model(model)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    opt_state = make_optimizer(opt).init(params)
    mngr = _ckpt_manager(out, args.keep)

    start = 0
    if args.resume:
        latest = mngr.latest_step()
        if latest is None:
            _log(f"[train] --resume: no checkpoint under {out / 'ckpt'}; starting from step 0")
        else:
            params, opt_state, meta = _restore(mngr, latest, params, opt_state)
            old = meta.get("run", {})
            for k in _DATA_KEYS:
                if old.get(k) != run_info[k]:
                    raise ValueError(f"--resume: {k} was {old.get(k)!r} in the checkpoint, now {run_info[k]!r}; "
                                     "the data stream would differ")
            if old.get("opt") != run_info["opt"]:
                _log(f"[train] warning: optimizer settings differ from the checkpoint's ({old.get('opt')}); "
                     "the continuation is not the uninterrupted run")
            start = int(meta["step"])
            _log(f"[train] resumed from step {start} ({out / 'ckpt'})")
    with open(out / "run.json", "w") as f:
        json.dump(dict(run_info, model=cfg.to_hf_config(), trainable_params=n_params, steps=args.steps), f, indent=1)

    ds = jdata.PackedDataset(jdata.read_documents(jdata.list_files(args.corpus, "train")), batch=args.batch,
                             seq_len=args.seq_len, seed=args.seed, tokenizer=tokenizer)
    val = jdata.validation_batches(batch=args.batch, seq_len=args.seq_len, num_batches=args.val_batches,
                                   corpus=args.corpus, tokenizer=tokenizer) if args.val_batches > 0 else []
    lengths_V = jdata.byte_lengths(tokenizer, cfg.vocab_size)
    tok_per_step = args.batch * args.seq_len
    _log(f"[train] {args.preset}: {n_params / 1e6:.2f}M trainable params, {cfg.num_hidden_layers} layers "
         f"({cfg.layer_kinds}), {cfg.num_experts} experts top-{cfg.num_experts_per_token}; data: "
         f"{ds.num_tokens / 1e6:.2f}M train tokens ({ds.steps_per_epoch:.0f} steps/epoch), {len(val)} val batches; "
         f"steps {start} -> {args.steps}, {tok_per_step} tokens/step")

    stop = args.steps if args.stop_at is None else min(args.steps, args.stop_at)
    metrics_f = open(out / "metrics.jsonl", "a")
    losses: list[float] = []
    val_hist: list[tuple[int, float]] = []
    last_val = (None, None, None)
    t_run = time.perf_counter()
    t_mark = None  # timing excludes the first (compiling) step
    train_time, train_tokens = 0.0, 0
    step = start
    win_loss: list[float] = []

    def meta_at(s):
        return {"step": s, "tokens_seen": s * tok_per_step, "run": run_info,
                "data": {"next_step": s, "seed": args.seed, "batch": args.batch, "seq_len": args.seq_len}}

    def validate(s):
        nonlocal last_val
        if not val:
            return
        vl, va, bpb = eval_loss(params, frozen, val, graphdef=graphdef, lengths_V=lengths_V)
        last_val = (vl, va, bpb)
        val_hist.append((s, vl))
        metrics_f.write(json.dumps({"step": s, "val_loss": vl, "val_acc": va, "val_bits_per_byte": bpb}) + "\n")
        metrics_f.flush()
        _log(f"[val] step {s}: loss {vl:.4f}  acc {va:.3f}  ({bpb:.3f} bits/byte)")

    while step < stop:
        b = ds.batch_at(step)
        t0 = time.perf_counter()
        params, opt_state, m = train_step(params, opt_state, frozen, jnp.asarray(b.tokens), jnp.asarray(b.doc_ids),
                                          graphdef=graphdef, opt=opt)
        loss = float(m["loss"])  # syncs
        t1 = time.perf_counter()
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}; lower --lr")
        step += 1
        losses.append(loss)
        win_loss.append(loss)
        if t_mark is None:
            t_mark = t1
            _log(f"[train] first step (compile included) {t1 - t0:.1f}s")
        else:
            train_time += t1 - t0
            train_tokens += tok_per_step
        rec = {"step": step, "loss": loss, "grad_norm": float(m["grad_norm"]), "acc": float(m["acc"]),
               "lr": float(opt.schedule()(step - 1))}
        metrics_f.write(json.dumps(rec) + "\n")
        if step % args.log_every == 0 or step == stop:
            tps = train_tokens / train_time if train_time > 0 else float("nan")
            eta = (stop - step) * tok_per_step / tps if train_time > 0 else float("nan")
            _log(f"[train] step {step}/{args.steps}  loss {np.mean(win_loss):.4f}  acc {rec['acc']:.3f}  "
                 f"lr {rec['lr']:.2e}  gnorm {rec['grad_norm']:.2f}  {tps:,.0f} tok/s  "
                 f"elapsed {_fmt_time(time.perf_counter() - t_run)}  eta {_fmt_time(eta) if eta == eta else '?'}")
            win_loss = []
            metrics_f.flush()
        if args.val_every and step % args.val_every == 0 and step != stop:
            validate(step)
        if args.ckpt_every and step % args.ckpt_every == 0 and step != stop:
            _save(mngr, step, params, opt_state, meta_at(step))
    metrics_f.flush()
    if step > start or mngr.latest_step() != step:
        _save(mngr, step, params, opt_state, meta_at(step))
    mngr.wait_until_finished()
    if step == args.steps or step > start:
        validate(step)
    metrics_f.close()

    exported = export_val = None
    if args.export and step >= args.steps:
        model = nnx.merge(graphdef, params, frozen)
        q = export_mxfp4(model, args.export, args.export_dtype)
        exported = str(Path(args.export).resolve())
        if args.tokenizer:
            copy_tokenizer(args.tokenizer, args.export)
        _log(f"[train] exported {exported} (experts MXFP4)")
        if val:  # the model as shipped: MXFP4 experts
            q_graphdef, q_params, q_frozen = split_model(q)
            export_val, export_acc, export_bpb = eval_loss(q_params, q_frozen, val, graphdef=q_graphdef,
                                                           lengths_V=lengths_V)
            _log(f"[val] exported (MXFP4 experts): loss {export_val:.4f}  acc {export_acc:.3f}  "
                 f"({export_bpb:.3f} bits/byte)")
    elif args.export:
        _log(f"[train] not exporting: stopped at step {step} before --steps {args.steps}")

    tps = train_tokens / train_time if train_time > 0 else None
    summary = {
        "preset": args.preset, "steps": step, "target_steps": args.steps, "start_step": start,
        "train_loss": float(np.mean(losses[-20:])) if losses else None,
        "final_train_loss": losses[-1] if losses else None,
        "val_loss": last_val[0], "val_acc": last_val[1], "val_bits_per_byte": last_val[2],
        "tokens_seen": step * tok_per_step, "tokens_per_s": tps, "wall_s": time.perf_counter() - t_run,
        "trainable_params": n_params, "out": str(out.resolve()), "exported": exported, "export_val_loss": export_val,
        "losses": losses, "val_history": val_hist,
    }
    summary["_params"] = params  # for in-process callers (tests); dropped from the JSON
    return summary


# ---------------------------------------------------------------------------------------------------------------
# CLI
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/target", help="run directory (checkpoints, metrics.jsonl, run.json)")
    p.add_argument("--preset", default="demo", choices=PRESETS)
    p.add_argument("--config-overrides", default=None, help="JSON dict of KimiConfig fields to override")
    p.add_argument("--steps", type=int, default=1700, help="total optimizer steps (the schedule's length)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: steps/20, at most 200)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr as a fraction of --lr")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="global-norm gradient clipping")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data order")
    p.add_argument("--corpus", default=None, help="directory of text files (default: the Python stdlib)")
    p.add_argument("--tokenizer", default=None,
                   help="directory with tokenizer.json / tiktoken.model (kimi.load_tokenizer; default: bytes); "
                        "copied into --export")
    p.add_argument("--val-every", type=int, default=200)
    p.add_argument("--val-batches", type=int, default=16)
    p.add_argument("--ckpt-every", type=int, default=200)
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--stop-at", type=int, default=None,
                   help="checkpoint and stop at this step (the schedule still spans --steps); resume later")
    p.add_argument("--export", default=None, help="after training, write an HF-style checkpoint, experts MXFP4")
    p.add_argument("--export-dtype", default=None, choices=("float32", "bfloat16"),
                   help="dtype of the exported non-expert weights (default: as trained, float32)")
    p.add_argument("--json", action="store_true", help="print a one-line JSON summary last on stdout")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    summary = train(args)
    if args.json:
        public = {k: v for k, v in summary.items() if not k.startswith("_") and k not in ("losses", "val_history")}
        print(json.dumps(public), flush=True)
    return summary


if __name__ == "__main__":
    try:
        main()
    except (ValueError, RuntimeError) as e:
        print(f"train_target.py: error: {e}", file=sys.stderr)
        sys.exit(2)
