"""Pure jnp math of the Kimi target, no parameters: each function documents its equation and shapes."""
