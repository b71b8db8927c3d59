"""The DSpark drafter: its layers (``layers``), the model and its decode cache (``model``), the training objective
(``losses``) and checkpoint I/O in speculators' format (``io``)."""

from jdspark.config import DSparkConfig
from jdspark.drafter.io import (
                                CHECKPOINT_WINDOW,
                                apply_context_window,
                                load_drafter,
                                parse_context_window,
                                save_drafter,
                                state_dict,
)
from jdspark.drafter.layers import rope
from jdspark.drafter.losses import dspark_loss, resolve_loss, select_anchors, training_loss, verifier_targets
from jdspark.drafter.model import (
                                  DrafterCache,
                                  DSparkDrafter,
                                  check_target,
                                  ring_from_linear,
                                  with_context_window,
                                  with_layers,
                                  with_serving_layout,
                                  with_taps,
)
from kimi.ops.norms import qwen3_rms_norm as rms_norm

__all__ = [
    "DSparkDrafter", "DrafterCache", "DSparkConfig", "load_drafter", "save_drafter", "state_dict", "training_loss",
    "dspark_loss", "select_anchors", "resolve_loss", "rms_norm", "rope", "check_target", "verifier_targets",
    "with_serving_layout", "with_context_window", "with_layers", "with_taps", "ring_from_linear",
    "parse_context_window", "CHECKPOINT_WINDOW", "apply_context_window",
]
