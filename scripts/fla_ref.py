"""Load FLA's pure-torch KDA references (fla-core 0.6.0) without triton.

``import fla.ops.kda`` fails on a CPU box: ``fla/ops/__init__.py`` imports every op, and those import triton. The
references we need do not:

* ``fla/ops/kda/naive.py`` imports only torch and einops, so it is loaded by file path as a standalone module
  (:func:`load_fla_naive`);
* ``fla/ops/kda/gate.py`` imports triton (and triton-backed fla modules) at the top, but its two torch reference
  functions ``naive_kda_gate`` / ``naive_kda_lowerbound_gate`` use only ``torch`` and ``F``. :func:`load_fla_gate`
  tries a normal by-path load first, and otherwise takes exactly those two function definitions from the file's
  source (``ast``) and executes them with ``torch`` and ``torch.nn.functional as F`` in scope. Nothing is stubbed
  in ``sys.modules``.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import types

_GATE_FUNCS = ("naive_kda_gate", "naive_kda_lowerbound_gate")


def fla_dir() -> str:
    """Directory of the installed ``fla`` package (fla-core); raises ImportError when it is not installed."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("fla (fla-core) is not installed")
    return list(spec.submodule_search_locations)[0]


def _load_by_path(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def load_fla_naive() -> types.ModuleType:
    """``fla/ops/kda/naive.py`` as a module: ``naive_recurrent_kda``, ``naive_chunk_kda``."""
    return _load_by_path("_fla_kda_naive", os.path.join(fla_dir(), "ops", "kda", "naive.py"))


@functools.lru_cache(maxsize=None)
def load_fla_gate() -> types.SimpleNamespace:
    """FLA's ``naive_kda_gate`` and ``naive_kda_lowerbound_gate`` from ``fla/ops/kda/gate.py``, without triton.

    Raises ImportError (with the reason) when neither a by-path load nor extracting the two functions works.
    """
    path = os.path.join(fla_dir(), "ops", "kda", "gate.py")
    try:
        module = _load_by_path("_fla_kda_gate", path)
        return types.SimpleNamespace(**{n: getattr(module, n) for n in _GATE_FUNCS}, how="by-path import")
    except ImportError as exc:  # triton (ModuleNotFoundError is an ImportError)
        first_error = f"{type(exc).__name__}: {exc}"
    with open(path) as f:
        tree = ast.parse(f.read(), filename=path)
    defs = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in _GATE_FUNCS]
    if sorted(d.name for d in defs) != sorted(_GATE_FUNCS):
        raise ImportError(f"{path}: by-path import failed ({first_error}) and {_GATE_FUNCS} were not all found")
    import torch
    import torch.nn.functional as F

    namespace = {"torch": torch, "F": F, "__name__": "_fla_kda_gate_naive"}
    code = compile(ast.Module(body=defs, type_ignores=[]), path, "exec")
    try:
        exec(code, namespace)  # noqa: S102 - FLA's own source, the two pure-torch reference functions only
    except Exception as exc:  # pragma: no cover - only if FLA changes these functions' dependencies
        raise ImportError(f"{path}: extracting {_GATE_FUNCS} failed: {exc!r} (by-path: {first_error})") from exc
    return types.SimpleNamespace(**{n: namespace[n] for n in _GATE_FUNCS},
                                 how=f"ast extraction (by-path import failed: {first_error})")
