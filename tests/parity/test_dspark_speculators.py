"""Acceptance: the JAX DSpark drafter reproduces speculators 0.9.0's PyTorch DSparkDraftModel (fp32, CPU).

A tiny gqa drafter is built with speculators offline (Qwen3 layer config, eager attention), its NaN sentinels
(embed_tokens / lm_head / verifier_lm_head / verifier_norm) are filled with random values, it is saved with
``save_pretrained`` and loaded here with ``jdspark.drafter.load_drafter``. Anchors are fixed by replacing
speculators' ``select_anchors``; torch intermediates are captured with forward hooks (hidden, base logits) and by
wrapping ``compute_metrics`` (Markov-corrected logits, confidence logits, targets, aligned mask).

Compared within 1e-5: base logits, Markov-corrected logits, confidence logits, the training loss and every metric,
for the three Markov head types (one with a sliding-window layer, one with a compound ce+tv loss), on two packed
documents; and the decode path (cache + draft_logits + sequential markov_bias / confidence_logit) on blocks of both
documents.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import speculators  # noqa: E402, F401  (a missing parity dependency fails the run: tests/conftest.py)
import torch  # noqa: E402
from flax import nnx
from speculators.config import SpeculatorsConfig, VerifierConfig  # noqa: E402
from speculators.losses import eager as eager_losses  # noqa: E402
from speculators.losses import resolve_loss_config  # noqa: E402
from speculators.models.dflash import core as dflash_core  # noqa: E402
from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig  # noqa: E402
from speculators.models.dspark import core as dspark_core  # noqa: E402
from speculators.proposals.greedy import GreedyTokenProposalConfig  # noqa: E402
from transformers import Qwen3Config  # noqa: E402

from jdspark.config import DSparkConfig  # noqa: E402
from jdspark.drafter import DSparkDrafter, load_drafter, save_drafter, state_dict, training_loss  # noqa: E402

V, H, NTAP, B, R = 128, 64, 3, 4, 16
T = 40
DOC_SPLIT = 24  # two packed documents: [0, 24) and [24, 40)
ANCHORS = [2, 9, 17, 22, 27, 33, 0]  # the last one is padding (anchor_valid False); 22 straddles the documents
VALID = [True] * 6 + [False]
TOL = 1e-5

CASES = {
    # markov_head_type, layer_types, sliding_window, loss spec
    "vanilla": ("vanilla", ["full_attention", "full_attention"], None, "kl_div"),
    "gated": ("gated", ["sliding_attention", "full_attention"], 5, "kl_div"),
    "rnn": ("rnn", ["full_attention", "full_attention"], None, '{"ce": 0.1, "tv": 0.9}'),
}


def _torch_model(markov_head_type, layer_types, sliding_window, seed=0):
    tl = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                     rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, tie_word_embeddings=False,
                     layer_types=layer_types, sliding_window=sliding_window,
                     use_sliding_window=sliding_window is not None)
    tl._attn_implementation = "eager"
    cfg = DSparkSpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=V, block_size=B, aux_hidden_state_layer_ids=[1, 3, 5],
        mask_token_id=V - 1, markov_rank=R, markov_head_type=markov_head_type,
        speculators_config=SpeculatorsConfig(
            algorithm="dspark", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=B)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"])))
    torch.manual_seed(seed)
    m = DSparkDraftModel(cfg).eval()
    with torch.no_grad():
        # fill the NaN sentinels; make every weight O(1)-effective so masks and heads matter numerically
        m.embed_tokens.weight.normal_()
        m.lm_head.weight.normal_(0.0, 0.3)
        m.verifier_lm_head.weight.copy_(m.lm_head.weight)
        m.verifier_norm.weight.uniform_(0.5, 1.5)
        for name, p in m.named_parameters():
            if name.startswith(("embed_tokens", "lm_head", "verifier_")):
                continue
            if p.ndim == 1:
                p.uniform_(0.5, 1.5) if "norm" in name else p.uniform_(-0.5, 0.5)
            elif name.startswith("markov_head.markov_w1"):
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 1.0 / np.sqrt(p.shape[1]))
    return m


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    taps = torch.randn(1, T, NTAP * H, generator=g)
    ids = torch.randint(0, V - 1, (1, T), generator=g)
    loss_mask = (torch.rand(1, T, generator=g) > 0.2).long()
    vlh = torch.randn(1, T, H, generator=g)
    doc = torch.tensor([[0] * DOC_SPLIT + [1] * (T - DOC_SPLIT)])
    pos = torch.tensor([list(range(DOC_SPLIT)) + list(range(T - DOC_SPLIT))])
    return taps, ids, loss_mask, vlh, doc, pos


def _run_torch(m, inputs, loss_spec, monkeypatch):
    taps, ids, loss_mask, vlh, doc, pos = inputs
    anchors = torch.tensor(ANCHORS, dtype=torch.long)
    valid = torch.tensor(VALID)
    monkeypatch.setattr(dflash_core, "select_anchors", lambda lm, n, bs: (anchors.clone(), valid.clone()))
    cap = {}
    orig = dspark_core.compute_metrics

    def spy(logits, targets, confidence_logits, loss_mask, *a, **kw):
        cap.update(logits=logits.detach(), targets=targets.detach(), conf=confidence_logits.detach(),
                   mask=loss_mask.detach())
        return orig(logits, targets, confidence_logits, loss_mask, *a, **kw)

    monkeypatch.setattr(dspark_core, "compute_metrics", spy)
    h1 = m.lm_head.register_forward_hook(lambda mod, i, o: cap.__setitem__("base", o.detach()))
    h2 = m.norm.register_forward_hook(lambda mod, i, o: cap.__setitem__("hidden", o.detach()))
    try:
        with torch.no_grad():
            _, loss, metrics = m(hidden_states=taps, input_ids=ids, loss_mask=loss_mask,
                                 verifier_last_hidden_states=vlh, document_ids=doc, position_ids=pos,
                                 loss_config=resolve_loss_config(loss_spec, "eager"),
                                 tv_loss_fn=eager_losses.tv_loss, max_anchors=len(ANCHORS))
    finally:
        h1.remove(), h2.remove()
    cap["loss"] = float(loss)
    cap["metrics"] = {k: float(v) for k, v in metrics.items()}
    return cap


def _np(x):
    return np.asarray(x, dtype=np.float64)


def _maxdiff(a, b):
    return float(np.max(np.abs(_np(a) - _np(b))))


@pytest.mark.parametrize("case", list(CASES))
def test_dspark_matches_speculators(case, tmp_path, monkeypatch):
    head, layer_types, window, loss_spec = CASES[case]
    m = _torch_model(head, layer_types, window)
    m.save_pretrained(str(tmp_path / "ckpt"))
    inputs = _inputs()
    ref = _run_torch(m, inputs, loss_spec, monkeypatch)

    d = load_drafter(tmp_path / "ckpt")
    assert d.config.markov_head_type == head and d.config.resolved_layer_types == tuple(layer_types)
    embed = jnp.asarray(m.embed_tokens.weight.detach().numpy())
    lm_head = jnp.asarray(m.lm_head.weight.detach().numpy().T)
    vnorm = jnp.asarray(m.verifier_norm.weight.detach().numpy())
    taps, ids, loss_mask, vlh, doc, pos = (jnp.asarray(x.numpy()) for x in inputs)
    graphdef, params = nnx.split(d)

    @jax.jit
    def fwd(params, anchors, valid):
        return training_loss(nnx.merge(graphdef, params), taps, ids, loss_mask, anchors, valid, vlh, vnorm, embed,
                             lm_head, document_ids_1T=doc, position_ids_1T=pos, loss=loss_spec,
                             return_outputs=True)

    loss, metrics, out = fwd(params, jnp.asarray(ANCHORS, jnp.int32), jnp.asarray(VALID))
    N = len(ANCHORS)
    diffs = {
        "hidden": _maxdiff(out["hidden"].reshape(N * B, H), ref["hidden"][0]),
        "base_logits": _maxdiff(out["base_logits"].reshape(N * B, V), ref["base"][0]),
        "markov_logits": _maxdiff(out["logits"].reshape(N * B, V), ref["logits"][0]),
        "confidence_logits": _maxdiff(out["confidence_logits"].reshape(-1), ref["conf"][0]),
        "targets": _maxdiff(out["targets"].reshape(N * B, V), ref["targets"][0]),
        "loss_mask": _maxdiff(out["loss_mask"].reshape(-1), ref["mask"][0]),
        "loss": abs(float(loss) - ref["loss"]),
    }
    assert set(metrics) == set(ref["metrics"]), sorted(set(metrics) ^ set(ref["metrics"]))
    diffs["metrics"] = max(abs(float(metrics[k]) - ref["metrics"][k]) for k in metrics)
    print(case, json.dumps(diffs))
    assert max(diffs.values()) <= TOL, diffs
    # the Markov bias is not negligible here (so the corrected-logit check means something)
    assert _maxdiff(ref["logits"], ref["base"]) > 0.1

    # ---- decode path: cache + draft_logits + sequential Markov / confidence, vs the torch training blocks
    base_t = ref["base"][0].numpy().reshape(N, B, V)
    corr_t = ref["logits"][0].numpy().reshape(N, B, V)
    conf_t = ref["conf"][0].numpy().reshape(N, B)

    @jax.jit
    def decode(params, ctx_taps, n_valid, start_pos, anchor_tok, anchor_pos, prev_tokens):
        dr = nnx.merge(graphdef, params)
        cache = dr.init_cache(1, 32)
        cache = dr.append_context(cache, ctx_taps, n_valid, start_pos)
        base, hid = dr.draft_logits(cache, anchor_tok, anchor_pos, embed, lm_head)
        state = dr.init_markov_state(1)
        corr, conf = [], []
        for k in range(B):
            bias, state = dr.markov_bias(prev_tokens[:, k], hid[:, k], state)
            corr.append(base[:, k] + bias)
            conf.append(dr.confidence_logit(hid[:, k], prev_tokens[:, k]))
        return base, jnp.stack(corr, 1), jnp.stack(conf, 1)

    for j in (2, 4):  # anchor 17 (document 0) and anchor 27 (document 1: positions restart at 24)
        a = ANCHORS[j]
        d0 = 0 if a < DOC_SPLIT else DOC_SPLIT
        ctx = np.zeros((1, 24, NTAP * H), np.float32)  # static N = 24 rows; rows >= n_valid are junk
        ctx[:, : a - d0] = np.asarray(taps[:, d0:a])
        ctx[:, a - d0:] = 7.0
        prev = ids[:, a:a + B]  # teacher-forced predecessors: slot 0's is the anchor itself
        base, corr, conf = decode(params, jnp.asarray(ctx), a - d0, 0, ids[:, a], a - d0, prev)
        dd = {"base": _maxdiff(base[0], base_t[j]), "markov": _maxdiff(corr[0], corr_t[j]),
              "confidence": _maxdiff(conf[0], conf_t[j])}
        print(case, "decode anchor", a, json.dumps(dd))
        assert max(dd.values()) <= TOL, (a, dd)


def test_jax_checkpoint_loads_in_speculators(tmp_path):
    """save_drafter output is a speculators checkpoint: from_pretrained reads the same config and tensors."""
    cfg = DSparkConfig.tiny(markov_head_type="gated", layer_types=("sliding_attention", "full_attention"),
                            sliding_window=5)
    d = DSparkDrafter(cfg, rngs=nnx.Rngs(3))
    save_drafter(d, tmp_path / "jx")
    m = DSparkDraftModel.from_pretrained(str(tmp_path / "jx"))
    c = m.config
    assert (c.block_size, c.markov_rank, c.markov_head_type, c.mask_token_id, c.sample_from_anchor) == \
        (cfg.block_size, cfg.markov_rank, cfg.markov_head_type, cfg.mask_token_id, cfg.sample_from_anchor)
    assert list(c.aux_hidden_state_layer_ids) == list(cfg.aux_hidden_state_layer_ids)
    assert list(c.transformer_layer_config.layer_types) == list(cfg.layer_types)
    assert c.transformer_layer_config.sliding_window == 5
    sd = m.state_dict()
    mine = state_dict(d)
    assert set(sd) - set(mine) == {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                                   "verifier_norm.weight"}
    assert set(mine) <= set(sd)
    for k, v in mine.items():
        np.testing.assert_array_equal(sd[k].detach().numpy(), np.asarray(v), err_msg=k)
