"""The tiny random pair and text the benchmark scripts' tests run on (one place, not one copy a test file)."""

import os

from flax import nnx

import jdspark
import kimi

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def random_pair(block_size: int = 3) -> tuple:
    """(target, drafter): ``KimiConfig.tiny()``'s target and a drafter of ``block_size`` for it, random weights
    (seeds 0 and 1)."""
    cfg = kimi.KimiConfig.tiny()
    target = kimi.KimiForCausalLM(cfg, rngs=nnx.Rngs(0))
    drafter = jdspark.DSparkDrafter(jdspark.DSparkConfig.for_target(cfg, block_size=block_size), target=target,
                                    rngs=nnx.Rngs(1))
    return target, drafter


def source_docs() -> list:
    """Three of this project's source files as bytes: text for the benchmarks' prompts."""
    return [open(os.path.join(ROOT, "jdspark", f), "rb").read() for f in ("prefix.py", "engine.py", "slots.py")]
