"""sharding: meshes, logical-axis rules, expert-parallel MoE, multi-host helpers.

  mesh = sharding.make_mesh("tp16")            # or "dp16-ep16", or {"data": 2, "tensor": 8}
  sharding.shard_model(model, mesh)            # parameters placed by sharding/rules.py; the plan installed
  sharding.shard_model(drafter, mesh)
  cache = sharding.shard_cache(model.init_cache(1, 4096), mesh)   # optional: prefill places it too
"""

from sharding.mesh import AXES, make_mesh, mesh_dims, mesh_name
from sharding.moe_ep import ExpertParallel, moe_ep
from sharding.rules import (
    LOGICAL_AXES,
    RULES,
    ShardingRules,
    cache_specs,
    checkpoint_shardings,
    logical_to_spec,
    param_specs,
    rules_for,
)
from sharding.shard import ShardingPlan, put, replicate, shard_cache, shard_model, unshard_model

__all__ = ["AXES", "make_mesh", "mesh_dims", "mesh_name", "ExpertParallel", "moe_ep", "LOGICAL_AXES", "RULES",
           "ShardingRules", "cache_specs", "checkpoint_shardings", "logical_to_spec", "param_specs", "rules_for",
           "ShardingPlan", "put", "replicate", "shard_cache", "shard_model", "unshard_model"]
