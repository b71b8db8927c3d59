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
prefix of the section marker is held back); from the marker on nothing more is content. Each call streams as
OpenAI's and vLLM's do: a first delta with its ``index``, ``id``, ``type`` and ``name`` once its id is complete,
then its arguments in pieces as they are generated (a tail that may begin the end marker, and trailing blanks, held
back until the next piece says; the pieces of a call join to ``parse``'s arguments), so a client shows a long call
(a file an agent writes) as it comes. A call cut off before its end marker (max_tokens) has streamed its pieces;
``parse`` of the whole text leaves it as text (as vLLM's parser does both ways).
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
    """A streamed choice's text split into content to send now and its calls' deltas (module doc)."""

    def __init__(self):
        self.text, self.sent, self.in_section = "", 0, False
        self.pos = 0  # in the section: where the text not yet read as calls begins
        self.state = "between"  # "between" calls | "header" (id being written) | "args" | "skip" | "done"
        self.args_at, self.args_sent = 0, ""  # the open call: where its arguments begin, what was sent of them
        self.calls = 0  # calls begun (a call's deltas carry its index, calls - 1 while it is open)
        self.complete = 0  # calls whose end marker came

    def feed(self, delta: str) -> tuple:
        """Take a text delta; return (the content that may be sent now, [tool-call deltas in the API's form])."""
        self.text += delta
        if not self.in_section:
            i = self.text.find(SECTION_BEGIN, max(0, self.sent - len(SECTION_BEGIN)))
            if i >= 0:
                self.in_section, self.pos = True, i + len(SECTION_BEGIN)
                upto = i
            else:  # hold back a tail that may be the marker's beginning
                upto = len(self.text) - held(self.text, SECTION_BEGIN)
            out, self.sent = self.text[self.sent:max(upto, self.sent)], max(upto, self.sent)
            return out, (self._calls(final=False) if self.in_section else [])
        return "", self._calls(final=False)

    def _calls(self, final: bool) -> list:
        """The call deltas the text read so far allows (``final``: the text is whole: nothing is held back)."""
        out = []
        while True:
            if self.state == "between":
                begin, end = self.text.find(CALL_BEGIN, self.pos), self.text.find(SECTION_END, self.pos)
                if end >= 0 and (begin < 0 or end < begin):
                    self.state = "done"
                if begin < 0 or self.state == "done":
                    return out
                self.pos, self.state = begin + len(CALL_BEGIN), "header"
            elif self.state == "header":
                j = self.text.find(ARGUMENT_BEGIN, self.pos)
                if j < 0:
                    return out
                fid = self.text[self.pos:j].strip()
                self.args_at, self.args_sent = j + len(ARGUMENT_BEGIN), ""
                if fid and "<" not in fid and not any(c.isspace() for c in fid):
                    out.append({"index": self.calls, "id": fid, "type": "function",
                                "function": {"name": _name(fid), "arguments": ""}})
                    self.calls, self.state = self.calls + 1, "args"
                else:  # not a call ``parse`` reads: passed over to its end marker
                    self.state = "skip"
            else:  # "args" / "skip": up to the call's end marker
                e = self.text.find(CALL_END, self.args_at)
                whole = self.text[self.args_at:] if e < 0 else self.text[self.args_at:e]
                if e < 0 and not final:
                    whole = whole[:len(whole) - held(whole, CALL_END)].rstrip()  # blanks may be its last
                whole = whole.strip()
                if self.state == "args" and len(whole) > len(self.args_sent):
                    out.append({"index": self.calls - 1, "function": {"arguments": whole[len(self.args_sent):]}})
                    self.args_sent = whole
                if e < 0:
                    return out
                self.complete += self.state == "args"
                self.pos, self.state = e + len(CALL_END), "between"

    def finish(self) -> tuple:
        """At the choice's end: (the content not yet sent, [the last tool-call deltas], whether any call was
        complete: the choice's finish_reason is then "tool_calls"); without a call begun the held-back text is
        content after all."""
        deltas = self._calls(final=True) if self.in_section else []
        if self.calls == 0:
            rest, self.sent = self.text[self.sent:], len(self.text)
            return rest, [], False
        self.sent = len(self.text)
        return "", deltas, self.complete > 0
