"""kimi: the Kimi K3 / Kimi-Linear target model in JAX and Flax NNX.

Shape-suffix glossary (array names end in the letters of their axes):
  B batch            T tokens (new)         S cached positions      D model width (hidden_size)
  H heads            K key / head dim       V value dim (or vocabulary, in logits_BTV)
  E experts          F expert hidden        L latent (MLA kv_lora_rank, or the LatentMoE width)
  R rank             C channels (conv)      W conv window (kernel - 1)   N depth sources (AttnRes)
  G groups           P projected width (heads * head dim)      X top-k slots
"""

from kimi.config import KimiConfig

__all__ = ["KimiConfig"]
from kimi.cache import KimiCache  # noqa: E402
from kimi.model import KimiForCausalLM, ModelOut  # noqa: E402

__all__ += ["KimiCache", "KimiForCausalLM", "ModelOut"]
from kimi.checkpoint import load_checkpoint  # noqa: E402
from kimi.checkpoint_save import save_checkpoint  # noqa: E402

__all__ += ["load_checkpoint", "save_checkpoint"]
from kimi.tokenizer import Tokenizer, load_tokenizer  # noqa: E402

__all__ += ["Tokenizer", "load_tokenizer"]
