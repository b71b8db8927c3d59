"""sharding: meshes, logical-axis rules, expert-parallel MoE, multi-host helpers."""
