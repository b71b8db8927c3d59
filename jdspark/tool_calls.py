"""Tool calls in chat completions (OpenAI's ``tools``): the checkpoint's chat template renders the tools and the
conversation's earlier calls and results; the model writes a call in its own format, which this module finds in
the generated text and turns into the API's ``tool_calls`` (vLLM's ``--tool-call-parser``).

Kimi K2's format (``kimi_k2``, the only one built; K2 / K3 checkpoints ship its markers as special tokens):

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON arguments}<|tool_call_end|>
    ...                                                                 (one per call)
    <|tool_calls_section_end|>

The text before the section is the message's content (None when blank). A call's ``id`` is its function id
(``functions.NAME:IDX``), the form Kimi's template writes back into the conversation's later turns (and what
vLLM's kimi_k2 parser returns); ``name`` drops the ``functions.`` prefix and the ``:IDX`` suffix; ``arguments`` is
the model's text as written (a JSON string in the API; not validated, as vLLM does not). A section without one
well-formed call is left as text. Special tokens are normally dropped from the text: a request with tools decodes
the markers (``marker_ids``, ``Request.keep_special``) and nothing else special.

Streaming (``Splitter``): content goes out as it comes until the text may be starting a section (a tail that is a
prefix of the section marker is held back); from the marker on nothing more is content, and the calls are sent
whole, one delta each, when the choice ends (the API lets a call's arguments come in pieces; here they come at
once, which clients accumulate the same way).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

__all__ = ["PARSERS", "SECTION_BEGIN", "SECTION_END", "CALL_BEGIN", "ARGUMENT_BEGIN", "CALL_END", "ToolCall",
           "parse", "special_ids", "marker_ids", "held", "Splitter"]

PARSERS = ("kimi_k2",)  # ``--tool-call-parser`` choices (and "none")

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)

_CALL = re.compile(re.escape(CALL_BEGIN) + r"\s*(?P<id>[^\s<]+?)\s*" + re.escape(ARGUMENT_BEGIN)
                   + r"(?P<args>.*?)" + re.escape(CALL_END), re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str  # the function id as the model wrote it: functions.NAME:IDX
    name: str
    arguments: str  # as the model wrote them (JSON text)

    def as_api(self, index: Optional[int] = None) -> dict:
        """The API's form (with ``index`` in a streamed delta)."""
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _name(function_id: str) -> str:
    name = function_id.rsplit(":", 1)[0] if ":" in function_id else function_id
    return name[len("functions."):] if name.startswith("functions.") else name


def parse(text: str) -> tuple:
    """(content or None, [ToolCall]) of a whole generated text (module doc); no section, or none well formed: the
    text itself and no calls."""
    i = text.find(SECTION_BEGIN)
    if i < 0:
        return text, []
    section = text[i + len(SECTION_BEGIN):]
    j = section.find(SECTION_END)
    calls = [ToolCall(m["id"], _name(m["id"]), m["args"].strip())
             for m in _CALL.finditer(section if j < 0 else section[:j])]
    if not calls:
        return text, []
    content = text[:i]
    return (content if content.strip() else None), calls


def special_ids(tokenizer, names) -> frozenset:
    """The ids of ``names`` among ``tokenizer``'s special tokens (a name it spells in ordinary tokens decodes
    anyway, so it needs none)."""
    return frozenset(tokenizer.special_tokens[m] for m in names if m in tokenizer.special_tokens)


def marker_ids(tokenizer) -> frozenset:
    """The ids of the format's markers among ``tokenizer``'s special tokens (``special_ids``)."""
    return special_ids(tokenizer, MARKERS)


def held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the beginning of ``marker`` (a stream holds them back
    until the next delta says)."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:k])), 0)


class Splitter:
    """A streamed choice's text split into content to send now and the calls at its end (module doc)."""

    def __init__(self):
        self.text, self.sent, self.in_section = "", 0, False

    def feed(self, delta: str) -> str:
        """Take a text delta; return the content that may be sent now."""
        self.text += delta
        if self.in_section:
            return ""
        i = self.text.find(SECTION_BEGIN, max(0, self.sent - len(SECTION_BEGIN)))
        if i >= 0:
            self.in_section = True
            upto = i
        else:  # hold back a tail that may be the marker's beginning
            hold = held(self.text, SECTION_BEGIN)
            upto = len(self.text) - hold
        out, self.sent = self.text[self.sent:max(upto, self.sent)], max(upto, self.sent)
        return out

    def finish(self) -> tuple:
        """At the choice's end: (the content not yet sent, [ToolCall]); without calls the held-back text is
        content after all."""
        content, calls = parse(self.text)
        if not calls:
            rest, self.sent = self.text[self.sent:], len(self.text)
            return rest, []
        rest = (content or "")[self.sent:]
        self.sent = len(self.text)
        return rest, calls
