"""jdspark: the DSpark block-diffusion drafter and the fused, jitted draft-verify loop."""

from jdspark.config import DSparkConfig
from jdspark.drafter import DrafterCache, DSparkDrafter, load_drafter, save_drafter, select_anchors, training_loss
from jdspark.generation import GenerateOutput, GenStats, generate
from jdspark.sampling import SamplingParams

__all__ = ["DSparkConfig", "DSparkDrafter", "DrafterCache", "load_drafter", "save_drafter", "select_anchors",
           "training_loss", "SamplingParams", "GenerateOutput", "GenStats", "generate"]
