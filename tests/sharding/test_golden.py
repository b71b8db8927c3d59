"""Golden snapshot of every PartitionSpec (target and drafter parameters, cache fields) per preset for the tiny
sharded config, so that sharding changes are deliberate.

Regenerate after an intended change to sharding/rules.py (or to the modules' parameters), then review the diff:

  .venv/bin/python tests/sharding/test_golden.py --update
"""
import json
import os
import re
import sys

if __name__ == "__main__":  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden_partition_specs.json")
REGEN = ".venv/bin/python tests/sharding/test_golden.py --update"
CACHE_BATCH, CACHE_LEN = 16, 32


def snapshot() -> dict:
    """Specs computed from abstract models against mesh shapes (no devices needed)."""
    import dataclasses

    import jax
    from flax import nnx

    from jdspark.drafter import DSparkDrafter
    from kimi.cache import KimiCache
    from kimi.info import abstract_model
    from sharding.mesh import mesh_dims
    from sharding.rules import cache_specs, param_specs, rules_for, spec_to_json
    from tests.sharding.common import PRESETS, sharded_tiny_config, sharded_tiny_drafter_config

    cfg = sharded_tiny_config()
    dcfg = sharded_tiny_drafter_config(cfg)
    target = abstract_model(cfg)
    drafter = nnx.eval_shape(lambda: DSparkDrafter(dcfg, rngs=nnx.Rngs(1)))
    cache = KimiCache.abstract(cfg, CACHE_BATCH, CACHE_LEN)
    dcache = jax.eval_shape(lambda: drafter.init_cache(CACHE_BATCH, CACHE_LEN))

    def fields(c):
        specs = cache_specs(c, mesh, rules)
        return {f.name: spec_to_json(getattr(specs, f.name)) for f in dataclasses.fields(c)}

    out = {"regenerate": REGEN, "cache_batch": CACHE_BATCH, "presets": {}}
    for preset in PRESETS:
        mesh = mesh_dims(preset)
        rules = rules_for(mesh)
        out["presets"][preset] = {
            "mesh": mesh, "rules": rules.name, "logical_to_mesh": rules.as_dict(),
            "target": {k: spec_to_json(v) for k, v in sorted(param_specs(target, mesh, rules).items())},
            "drafter": {k: spec_to_json(v) for k, v in sorted(param_specs(drafter, mesh, rules).items())},
            "cache": fields(cache), "drafter_cache": fields(dcache)}
    return json.loads(json.dumps(out))  # tuples -> lists, as read back from the file


def _diff(want, got, path=""):
    if isinstance(want, dict) and isinstance(got, dict):
        for k in sorted(set(want) | set(got)):
            if k not in got:
                yield f"{path}{k}: removed (was {want[k]})"
            elif k not in want:
                yield f"{path}{k}: new {got[k]}"
            else:
                yield from _diff(want[k], got[k], f"{path}{k}.")
    elif want != got:
        yield f"{path[:-1]}: {want} -> {got}"


def test_partition_specs_match_golden():
    with open(GOLDEN) as f:
        want = json.load(f)
    got = snapshot()
    diff = list(_diff(want, got))
    assert not diff, ("PartitionSpecs changed; if intended, regenerate with `" + REGEN + "` and review:\n"
                      + "\n".join(diff[:40]))


def test_golden_covers_every_parameter_and_splits_something():
    with open(GOLDEN) as f:
        presets = json.load(f)["presets"]
    tp, dp = presets["tp16"], presets["dp16-ep16"]
    assert set(tp["target"]) == set(dp["target"]) and len(tp["target"]) > 50
    assert tp["target"]["model.layers.1.block_sparse_moe.experts.w1_packed"] == [None, "tensor", None]
    assert dp["target"]["model.layers.1.block_sparse_moe.experts.w1_packed"] == ["data", None, None]
    assert tp["target"]["model.layers.0.self_attn.q_proj.kernel"] == [None, "tensor"]
    assert dp["target"]["model.layers.0.self_attn.q_proj.kernel"] == [None, None]
    assert dp["cache"]["kda_state"] == [None, "data", None, None, None]


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit(f"usage: {REGEN}")
    text = json.dumps(snapshot(), indent=1, sort_keys=True)
    text = re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)  # 1 spec/line
    with open(GOLDEN, "w") as f:
        f.write(text + "\n")
    print(f"wrote {GOLDEN}")
