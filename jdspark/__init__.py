"""jdspark: the DSpark block-diffusion drafter and the fused, jitted draft-verify loop."""
