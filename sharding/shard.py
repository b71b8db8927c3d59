"""Placing models and caches on a mesh by the rules, and the static hooks the model's own jitted code reads.

  mesh = sharding.make_mesh("tp16")
  sharding.shard_model(model, mesh)                  # params -> NamedSharding by sharding/rules.py (in place);
                                                     # installs the hooks below; returns the model
  cache = sharding.shard_cache(model.init_cache(1, 4096), mesh)
  out = model.prefill(tokens, cache)                 # the same jitted kimi.model.forward_jit, now on 16 devices
  # or, equivalently, model.prefill(tokens, cache, mesh=mesh) / decode / verify, and
  # jdspark.generate(model, drafter, prompt, mesh=mesh)

Hooks (plain attributes, so they are part of the NNX graphdef: a sharded model traces and caches its own
programs, and an unsharded one is untouched):
  * ``KimiForCausalLM.sharding_plan``: a ``ShardingPlan``; ``forward`` constrains the cache it returns to the
    cache rules, so a donated cache keeps its layout step after step (also inside ``generate``'s while loop).
  * ``RoutedExperts.expert_parallel``: a ``sharding.moe_ep.ExpertParallel``; the routed experts run under
    ``jax.shard_map`` (sort by local expert, grouped matmul on the packed MXFP4 experts, psum).
  * ``KimiDeltaAttention.sharding_plan`` / ``LatentMoE.sharding_plan``: two activation constraints by logical
    axes (the q|k|v projections gathered before the short conv; whole latent rows into the latent norm), which
    keep the compiled decode step at 2 collectives per KDA layer and 3 per MoE layer under tp16.
  * ``DSparkDrafter.sharding_plan``: the drafter's plan (its parameters are placed; GSPMD does the rest).

Arrays are placed with ``jax.make_array_from_callback`` from host copies, which works for meshes spanning several
processes (each process supplies its own shards of the same values).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sharding.moe_ep import ExpertParallel
from sharding.rules import ShardingRules, _parts, cache_specs, logical_to_spec, param_specs, rules_for


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """A mesh and its rules: hashable, so it can sit in a graphdef."""

    mesh: jax.sharding.Mesh
    rules: ShardingRules

    def cache_shardings(self, cache):
        specs = cache_specs(cache, self.mesh, self.rules)
        return {f.name: NamedSharding(self.mesh, getattr(specs, f.name)) for f in dataclasses.fields(cache)}

    def constrain(self, x, logical_axes):
        """``x`` constrained (inside a jit) to the sharding of its logical axes under the rules."""
        spec = logical_to_spec(logical_axes, x.shape, self.mesh, self.rules, where="activation")
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def constrain_cache(self, cache):
        """The cache with every field constrained to its rule's sharding (inside a jit)."""
        sh = self.cache_shardings(cache)
        return dataclasses.replace(cache, **{k: jax.lax.with_sharding_constraint(getattr(cache, k), s)
                                             for k, s in sh.items()})


def put(x, sharding: NamedSharding) -> jax.Array:
    """``x`` (host or device data, the same value in every process) as a global array with ``sharding``; a no-op
    when it already has an equivalent sharding."""
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        if x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        if not x.is_fully_addressable:
            return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def replicate(x, mesh) -> jax.Array:
    """Host data as an array replicated over every device of ``mesh`` (tokens, prompts)."""
    return put(x, NamedSharding(mesh, P()))


def _is_target(model) -> bool:
    from kimi.model import KimiForCausalLM

    return isinstance(model, KimiForCausalLM)


def shard_model(model, mesh, rules=None):
    """Place every parameter of a ``KimiForCausalLM`` or ``DSparkDrafter`` on ``mesh`` by the rules (default: the
    mesh's preset, ``rules_for(mesh)``) and install the hooks. In place; returns the model. Idempotent."""
    rules = rules_for(mesh) if rules is None else rules_for(rules)
    plan = ShardingPlan(mesh, rules)
    if getattr(model, "sharding_plan", None) == plan:
        return model
    specs = param_specs(model, mesh, rules)
    flat = []
    for path, var in nnx.to_flat_state(nnx.state(model)):
        sh = NamedSharding(mesh, specs[".".join(_parts(path))])
        flat.append((path, var.replace(put(var.get_value(), sh))))
    nnx.update(model, nnx.from_flat_state(flat))
    model.sharding_plan = plan
    if _is_target(model):
        install_hooks(model.model.layers, plan)
    return model


def install_hooks(layers, plan: ShardingPlan):
    """Attach the static hooks to decoder layers (or single mixer / MoE modules): the plan on every KDA mixer and
    LatentMoE (activation constraints), ``ExpertParallel`` on every RoutedExperts."""
    from kimi.layers import KimiDeltaAttention, LatentMoE

    hook = ExpertParallel(plan.mesh, plan.rules)
    for mod in layers:
        for m in (mod, getattr(mod, "self_attn", None), getattr(mod, "block_sparse_moe", None)):
            if isinstance(m, KimiDeltaAttention):
                m.sharding_plan = plan
            elif isinstance(m, LatentMoE):
                m.sharding_plan = plan
                m.experts.expert_parallel = hook


def unshard_model(model):
    """Remove the hooks and gather every parameter onto one device (the inverse of ``shard_model``)."""
    flat = [(p, v.replace(jax.device_put(np.asarray(jax.device_get(v.get_value())))))
            for p, v in nnx.to_flat_state(nnx.state(model))]
    nnx.update(model, nnx.from_flat_state(flat))
    if hasattr(model, "sharding_plan"):
        del model.sharding_plan
    if _is_target(model):
        for layer in model.model.layers:
            moe = getattr(layer, "block_sparse_moe", None)
            for m, name in ((layer.self_attn, "sharding_plan"), (moe, "sharding_plan"),
                            (getattr(moe, "experts", None), "expert_parallel")):
                if m is not None and hasattr(m, name):
                    delattr(m, name)
    return model


def shard_cache(cache, mesh, rules=None):
    """A ``KimiCache`` or ``DrafterCache`` placed on ``mesh`` by the cache rules."""
    rules = rules_for(mesh) if rules is None else rules_for(rules)
    sh = ShardingPlan(mesh, rules).cache_shardings(cache)
    return dataclasses.replace(cache, **{k: put(getattr(cache, k), s) for k, s in sh.items()})


def on_mesh(model, mesh, tokens, cache, rules: Optional[ShardingRules] = None):
    """What ``prefill / decode / verify(..., mesh=)`` do: shard the model (once), place the cache by the rules and
    the tokens replicated. Returns (tokens, cache)."""
    shard_model(model, mesh, rules)
    rules = model.sharding_plan.rules
    return replicate(np.asarray(tokens), mesh), shard_cache(cache, mesh, rules)
