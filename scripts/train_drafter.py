#!/usr/bin/env python
"""Train the DSpark drafter on hidden states from the shipped target's own serving forward.

    python scripts/train_drafter.py --target checkpoints/default/target --out runs/drafter --steps 1500
    python scripts/train_drafter.py ... --resume                 # continue exactly from the last checkpoint
    python scripts/train_drafter.py ... --export checkpoints/default/drafter   # speculators format
    python scripts/train_drafter.py ... --init checkpoints/default/drafter     # continue from a shipped drafter
    python scripts/train_drafter.py ... --init checkpoints/default/drafter --layers 2   # ... deepened to 2 layers
    python scripts/train_drafter.py ... --init checkpoints/default/drafter --taps 1,3,5,6   # ... + last layer's output
    python scripts/train_drafter.py ... --context-window 64      # trained and served from its last 64 positions

The target is loaded as shipped (experts MXFP4) and frozen; each step runs its jitted prefill over a packed batch
of the training corpus for the taps and final hidden states (online extraction), then one AdamW step of the
drafter on speculators' DSpark objective (jdspark.train). Reports the analytic accept_len and per-position
accuracy on held-out files; orbax checkpoints (atomic, last --keep) with --resume. At the end (and before the first
step with --init) it serves the drafter: tokens per target step of ``jdspark.generate`` on ``--served-prompts``
held-out prompts of the standard library (bench.py's code split; ``--served-corpus DIR`` for another), greedy and
sampled at T=1 top-p 0.95, the figure a drafter is for (``served`` in the result; 0 prompts skips it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import numpy as np
from flax import nnx

import jdspark
import kimi
from jdspark import data as jdata
from jdspark import train as jt
from jdspark.drafter import CHECKPOINT_WINDOW, apply_context_window, parse_context_window, with_layers, with_taps
from jdspark.evaluate import served_acceptance


def _parse_taps(text: str) -> tuple:
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise ValueError(f"--taps: expected comma-separated target layer ids such as 1,3,5, got {text!r}") from None


def build_drafter(target, a, tokenizer) -> jdspark.DSparkDrafter:
    """A fresh drafter for ``target``; its mask token is the tokenizer's (``<mask>``)."""
    cfg = target.config
    if tokenizer.mask_id is None:
        raise ValueError("the target's tokenizer has no mask token (<mask>) for the drafter's block slots")
    L = cfg.num_hidden_layers
    taps = _parse_taps(a.taps) if a.taps else tuple(sorted({1, L // 2, L - 1}))  # distinct on a shallow target
    dc = jdspark.DSparkConfig.for_target(cfg, block_size=a.block_size, num_hidden_layers=a.layers or 1,
                                         markov_rank=a.markov_rank, mask_token_id=tokenizer.mask_id,
                                         aux_hidden_state_layer_ids=taps, num_attention_heads=a.heads,
                                         intermediate_size=a.intermediate or 2 * cfg.hidden_size)
    return jdspark.DSparkDrafter(dc, target=target, rngs=nnx.Rngs(a.seed))


def train(a) -> dict:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    target = kimi.load_checkpoint(a.target)
    tokenizer = kimi.load_tokenizer(a.target, vocab_size=target.config.vocab_size)
    if a.init:  # a new run from a saved drafter's weights (its architecture; a fresh optimizer and schedule)
        drafter = jdspark.load_drafter(a.init, target=target)
        L = drafter.config.num_hidden_layers
        if a.layers is not None and a.layers != L:  # deepened, computing what it computed (drafter.with_layers)
            if a.layers < L:
                raise ValueError(f"--layers {a.layers}: the --init drafter has {L} layers; it can be deepened, "
                                 f"not cut")
            drafter = with_layers(drafter, a.layers)
        taps0 = drafter.config.aux_hidden_state_layer_ids
        taps = _parse_taps(a.taps) if a.taps else taps0
        if taps != taps0:  # taps added, computing what it computed (with_taps)
            drafter = with_taps(drafter, taps)
            jdspark.drafter.check_target(drafter.config, target)
        print(f"[train_drafter] initialised from {a.init} ({drafter.config.num_hidden_layers} layers"
              f"{f', grown from {L}' if drafter.config.num_hidden_layers != L else ''}; taps "
              f"{list(drafter.config.aux_hidden_state_layer_ids)}"
              f"{f', grown from {list(taps0)}' if drafter.config.aux_hidden_state_layer_ids != taps0 else ''})",
              file=sys.stderr)
    else:
        drafter = build_drafter(target, a, tokenizer)
    # trained as served: the objective masks context positions outside the window (DSparkDrafter's training
    # mask), and the export's config carries it
    drafter = apply_context_window(drafter, a.context_window)
    t_graph, t_state = nnx.split(target)
    d_graph, params, rest = jt.split_drafter(drafter)
    opt = jt.OptConfig(lr=a.lr, steps=a.steps, warmup=min(100, a.steps // 20 + 1), min_lr_ratio=0.1,
                       weight_decay=0.0, clip=1.0)
    opt_state = jt.make_optimizer(opt).init(params)
    mngr = jt.ckpt_manager(out, a.keep)
    start = 0
    if a.resume and mngr.latest_step() is not None:
        (params, opt_state), meta = jt.restore_state(mngr, mngr.latest_step(), (params, opt_state))
        start = int(meta["step"])
        print(f"[train_drafter] resumed at step {start}", file=sys.stderr)
    ds = jdata.PackedDataset(jdata.read_documents(jdata.list_files(a.corpus, "train")), batch=a.batch,
                             seq_len=a.seq_len, seed=a.seed, tokenizer=tokenizer)
    val = jdata.validation_batches(batch=a.batch, seq_len=a.seq_len, num_batches=a.val_batches, corpus=a.corpus,
                                   tokenizer=tokenizer)
    kw = dict(d_graph=d_graph, t_graph=t_graph, num_anchors=a.anchors, loss=a.loss)

    served_prompts = []
    if a.served_prompts:
        served_prompts = jdata.prompts_from_documents(
            jdata.read_documents(jdata.list_files(a.served_corpus, "val")), a.served_prompts, 128, seed=a.seed,
            tokenizer=tokenizer)

    def served(params):
        if not served_prompts:
            return None
        res = served_acceptance(target, nnx.merge(d_graph, params, rest), served_prompts, a.served_tokens,
                                seed=a.seed)
        print("[train_drafter] served: " + ", ".join(f"{t} accept_len {r['accept_len']:.2f}" for t, r in res.items()),
              file=sys.stderr, flush=True)
        return res

    def validate(params, step: int) -> dict:
        """Teacher-forced figures on the held-out batches, printed and kept in ``history``."""
        ms = [jt.drafter_eval_step(params, rest, t_state, b.tokens[:, :-1], b.doc_ids[:, :-1],
                                   jax.random.key(10_000 + i), **kw) for i, b in enumerate(val)]
        v = dict(jt.summarize(jax.device_get(ms), drafter.config.block_size), step=step)
        history.append(v)
        print(f"[train_drafter] val step {step}: loss {v['loss']:.4f} accept_len {v['accept_len']:.2f} "
              f"greedy {v['greedy_accept_len']:.2f} per-position {np.round(v['per_position_acc'], 2).tolist()}",
              file=sys.stderr, flush=True)
        return v

    t0, toks, history, initial = time.time(), 0, [], None
    if a.init and start == 0:  # the starting point on this run's own held-out split: what training adds to it
        initial = validate(params, 0)
        initial["served"] = served(params)
    for step in range(start, a.steps):
        b = ds.batch_at(step)
        key = jax.random.fold_in(jax.random.key(a.seed), step)
        params, opt_state, m = jt.drafter_train_step(params, opt_state, rest, t_state, b.tokens[:, :-1],
                                                     b.doc_ids[:, :-1], key, opt=opt, **kw)
        toks += b.tokens[:, :-1].size
        if (step + 1) % a.log_every == 0 or step + 1 == a.steps:
            s = jt.summarize([jax.device_get(m)], drafter.config.block_size)
            rate = toks / (time.time() - t0)
            print(f"[train_drafter] step {step + 1}/{a.steps} loss {s['loss']:.4f} accept_len {s['accept_len']:.2f} "
                  f"{rate:.0f} tok/s", file=sys.stderr, flush=True)
        if (step + 1) % a.val_every == 0 or step + 1 == a.steps:
            validate(params, step + 1)
        if (step + 1) % a.ckpt_every == 0 or step + 1 == a.steps:
            jt.save_state(mngr, step + 1, (params, opt_state), {"step": step + 1})
        if a.stop_at is not None and step + 1 >= a.stop_at:
            break
    mngr.wait_until_finished()
    if history and history[-1]["step"] == a.steps:  # a run that reached its last step (not --stop-at)
        history[-1]["served"] = served(params)
    drafter = nnx.merge(d_graph, params, rest)
    if a.export:
        jdspark.save_drafter(drafter, a.export)
    return {"steps": a.steps, "initial": initial, "final": history[-1] if history else None,
            "tokens_per_s": toks / (time.time() - t0), "export": a.export, "_drafter": drafter}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="the target checkpoint folder (HF-style, as shipped)")
    p.add_argument("--out", default="runs/drafter")
    p.add_argument("--corpus", default=None)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--anchors", type=int, default=256, help="blocks per packed batch")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--loss", default="kl_div")
    p.add_argument("--block-size", type=int, default=7)
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default 1); with --init, more than its drafter's deepens it: the new layers "
                        "start as copies of its last whose residual outputs are zero (it computes what it did)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--markov-rank", type=int, default=64)
    p.add_argument("--taps", default=None,
                   help="comma-separated target layer ids (inputs of those layers; the target's layer count for its "
                        "last layer's output); with --init, ids beyond its drafter's are added, their rows of fc "
                        "starting at zero (it computes what it did)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-every", type=int, default=250)
    p.add_argument("--val-batches", type=int, default=4)
    p.add_argument("--ckpt-every", type=int, default=250)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--init", default=None,
                   help="start from this drafter (speculators format, e.g. checkpoints/default/drafter): its weights "
                        "and architecture (the architecture flags but --layers and --taps are not used), a fresh "
                        "optimizer and schedule; with --resume a checkpoint in --out still wins")
    p.add_argument("--context-window", type=parse_context_window, default=CHECKPOINT_WINDOW, metavar="N|none",
                   help="the drafter attends to the last N context positions, in training as in serving (none: all); "
                        "default: the --init drafter's, or none for a fresh one")
    p.add_argument("--stop-at", type=int, default=None, help="checkpoint and stop at this step")
    p.add_argument("--served-prompts", type=int, default=8,
                   help="held-out prompts the trained drafter is served on at the end (0: skip)")
    p.add_argument("--served-tokens", type=int, default=128, help="new tokens per served prompt")
    p.add_argument("--served-corpus", default=None,
                   help="cut the served prompts from this directory's held-out split (default: the stdlib's)")
    p.add_argument("--export", default=None, help="write the trained drafter here (speculators format)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    for k in ("steps", "batch", "seq_len", "anchors", "block_size", "layers", "served_tokens"):
        if getattr(a, k) is not None and getattr(a, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    if a.served_prompts < 0:
        p.error(f"--served-prompts: expected >= 0 (0 skips serving the drafter), got {a.served_prompts}")
    if not os.path.isfile(os.path.join(a.target, "config.json")):
        p.error(f"--target {a.target}: expected a target checkpoint folder (config.json + *.safetensors)")
    for flag, d in (("--corpus", a.corpus), ("--served-corpus", a.served_corpus)):
        if d is not None and not os.path.isdir(os.path.expanduser(d)):  # said before the target loads
            p.error(f"{flag} {d}: expected a directory of text files")
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    res = train(a)
    if a.json:
        print(json.dumps({k: v for k, v in res.items() if not k.startswith("_")}, separators=(",", ":")))
    return res


if __name__ == "__main__":
    main()
