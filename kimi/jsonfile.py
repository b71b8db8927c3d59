"""A checkpoint's JSON files (config.json, tokenizer.json, tokenizer_config.json, the drafter's config.json) read
in one place, so that a broken one is said naming the file, what is wrong and what was expected, instead of a bare
``JSONDecodeError`` or an ``AttributeError`` deep in whatever read it."""

from __future__ import annotations

import json
import os
from typing import Any


def read_json_object(path: os.PathLike | str) -> dict[str, Any]:
    """The JSON object in ``path``; ValueError naming the file when it is not UTF-8 JSON or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{os.fspath(path)}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                         "expected a JSON object") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{os.fspath(path)}: not UTF-8 text ({e.reason} at byte {e.start}); expected a JSON "
                         "object") from None
    if not isinstance(value, dict):
        found = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")
        raise ValueError(f"{os.fspath(path)}: expected a JSON object, found {found}")
    return value
