#!/usr/bin/env python
"""``transformers serve`` on a CPU without ``accelerate``: the PyTorch reference server, to compare with this one.

    python scripts/bench_torch.py --out /tmp/kl --rounds 1 --json          # a KimiLinear checkpoint to serve
    python scripts/transformers_serve_cpu.py /tmp/kl/target --port 8200    # transformers' server (fp32, CPU)
    python scripts/bench_serve.py --url http://127.0.0.1:8200 --openai-compatible --model /tmp/kl/target --json
    python -m jdspark.serve --checkpoint /tmp/kl --port 8123 --serving-dtype float32   # this project's, the same
    python scripts/bench_serve.py --url http://127.0.0.1:8123 --openai-compatible --json    # checkpoint and load

transformers' server loads its model with ``device_map`` set, which needs the ``accelerate`` package; this project
does not install it (a CPU model needs no placement). Here ``from_pretrained`` drops a ``device_map`` of "cpu"
(the model loads on the CPU either way) and transformers' own CLI runs with the arguments given (``transformers
serve --help`` lists them; ``--device cpu --dtype float32`` are added unless given), offline (``HF_HUB_OFFLINE``,
no update check) unless the environment says otherwise. Nothing else is changed:
what is timed is transformers' server. Its ``--continuous-batching`` refuses KimiLinear's KDA layers
(transformers 5.19: "Invalid layer type: linear_attention"), so it serves one request at a time
(docs/performance.md, "The same checkpoint served").
"""

from __future__ import annotations

import os
import sys


def drop_cpu_device_map() -> None:
    """Make ``PreTrainedModel.from_pretrained`` ignore ``device_map="cpu"`` (what ``--device cpu`` passes)."""
    import transformers

    plain = transformers.PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        if kwargs.get("device_map") == "cpu":
            del kwargs["device_map"]
        return plain(cls, *args, **kwargs)

    transformers.PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def main(argv=None) -> int:
    # a local checkpoint needs no network: no hub lookups, no check for a newer transformers at start-up
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_UPDATE_CHECK", "1")
    args = list(sys.argv[1:] if argv is None else argv)
    for flag, value in (("--device", "cpu"), ("--dtype", "float32")):
        if not any(a == flag or a.startswith(flag + "=") for a in args):
            args += [flag, value]
    drop_cpu_device_map()
    from transformers.cli.transformers import main as transformers_cli

    sys.argv = ["transformers", "serve", *args]
    transformers_cli()
    return 0


if __name__ == "__main__":
    sys.exit(main())
