"""Placing models and caches on a mesh by the rules, and the plan the model's own jitted code reads.

  mesh = sharding.make_mesh("tp16")
  sharding.shard_model(model, mesh)                  # params -> NamedSharding by sharding/rules.py (in place);
  sharding.shard_model(drafter, mesh)                # installs the plan below; returns the model
  out = model.prefill(tokens, model.init_cache(1, 4096))   # the same jitted kimi.model.forward_jit, on 16 devices
  out = jdspark.generate(model, drafter, prompt)     # the same program, on the mesh

The plan (``ShardingPlan``, a ``kimi.partitioning.Partitioner``) is installed through the hook each model
declares (``KimiForCausalLM.set_partitioner``, ``DSparkDrafter.set_partitioner``): a static attribute, so it is
part of the NNX graphdef (a sharded model traces and caches its own programs; an unsharded one is untouched):
  * ``place``: the model's prefill / decode / verify place their tokens (replicated) and cache by the rules;
  * ``constrain_cache``: ``forward`` constrains the cache it returns to the cache rules, so a donated cache keeps
    its layout step after step (also inside ``generate``'s while loop);
  * ``routed_experts``: the routed experts run under ``jax.shard_map`` (``sharding.moe_ep``: sort by local
    expert, grouped matmul on the packed MXFP4 experts, psum);
  * ``constrain``: two activation constraints by logical axes in the layers (the q|k|v projections gathered
    before KDA's short conv; whole latent rows into LatentMoE's latent norm), which keep the compiled decode step
    at 2 collectives per KDA layer and 3 per MoE layer under tp16.

Arrays are placed with ``jax.make_array_from_callback`` from host copies, which works for meshes spanning several
processes (each process supplies its own shards of the same values).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kimi.partitioning import NO_PARTITION, Partitioner
from sharding.moe_ep import ExpertParallel
from sharding.rules import ShardingRules, cache_specs, logical_to_spec, param_specs, path_parts, rules_for


@dataclasses.dataclass(frozen=True)
class ShardingPlan(Partitioner):
    """A mesh and its rules: hashable, so it can sit in a graphdef."""

    mesh: jax.sharding.Mesh
    rules: ShardingRules
    sharded = True

    def cache_shardings(self, cache):
        specs = cache_specs(cache, self.mesh, self.rules)
        return {f.name: NamedSharding(self.mesh, getattr(specs, f.name)) for f in dataclasses.fields(cache)}

    def constrain(self, x, logical_axes):
        spec = logical_to_spec(logical_axes, x.shape, self.mesh, self.rules, where="activation")
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def constrain_cache(self, cache):
        sh = self.cache_shardings(cache)
        return dataclasses.replace(cache, **{k: jax.lax.with_sharding_constraint(getattr(cache, k), s)
                                             for k, s in sh.items()})

    def routed_experts(self, experts, z_TD, w_TX, idx_TX):
        return ExpertParallel(self.mesh, self.rules)(experts, z_TD, w_TX, idx_TX)

    def place(self, tokens, cache):
        return self.replicate(np.asarray(tokens, np.int32)), shard_cache(cache, self.mesh, self.rules)

    def replicate(self, host):
        return replicate(host, self.mesh)


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


def shard_model(model, mesh, rules=None):
    """Place every parameter of a ``KimiForCausalLM`` or ``DSparkDrafter`` on ``mesh`` by the rules (default: the
    mesh's preset, ``rules_for(mesh)``) and install the plan. In place; returns the model. Idempotent."""
    rules = rules_for(mesh) if rules is None else rules_for(rules)
    plan = ShardingPlan(mesh, rules)
    if model.partition == plan:
        return model
    specs = param_specs(model, mesh, rules)
    flat = []
    for path, var in nnx.to_flat_state(nnx.state(model)):
        sh = NamedSharding(mesh, specs[".".join(path_parts(path))])
        flat.append((path, var.replace(put(var.get_value(), sh))))
    nnx.update(model, nnx.from_flat_state(flat))
    model.set_partitioner(plan)
    return model


def unshard_model(model):
    """Remove the plan and gather every parameter onto one device (the inverse of ``shard_model``)."""
    flat = [(p, v.replace(jax.device_put(np.asarray(jax.device_get(v.get_value())))))
            for p, v in nnx.to_flat_state(nnx.state(model))]
    nnx.update(model, nnx.from_flat_state(flat))
    model.set_partitioner(NO_PARTITION)
    return model


def shard_cache(cache, mesh, rules=None):
    """A ``KimiCache`` or ``DrafterCache`` placed on ``mesh`` by the cache rules."""
    rules = rules_for(mesh) if rules is None else rules_for(rules)
    sh = ShardingPlan(mesh, rules).cache_shardings(cache)
    return dataclasses.replace(cache, **{k: put(getattr(cache, k), s) for k, s in sh.items()})
