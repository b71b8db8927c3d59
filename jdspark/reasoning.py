"""A thinking model's reasoning split from its answer in chat completions (vLLM's ``--reasoning-parser``): the
message's ``reasoning_content`` and ``content``, streamed as ``delta.reasoning_content`` then ``delta.content``.

The format (``think``: Kimi K2-Thinking / K3, DeepSeek-R1 and others): the reasoning between ``<think>`` and
``</think>``, the answer after. A chat template may open the block itself (the rendered prompt ends with
``<think>``): the generated text then starts inside it (``started``). Without ``</think>``:
the whole text is reasoning when the block was open (a model cut off while thinking, by ``max_tokens``), else the
whole text is the answer (the model did not think). Special tokens are normally dropped from the text; where the
vocabulary has the markers as special tokens a chat request decodes them (``marker_ids``).
"""

from __future__ import annotations

from typing import Optional

from jdspark.tool_calls import held, special_ids

__all__ = ["PARSERS", "THINK_BEGIN", "THINK_END", "split", "marker_ids", "Splitter", "started_by"]

PARSERS = ("think",)  # ``--reasoning-parser`` choices (and "none")
THINK_BEGIN, THINK_END = "<think>", "</think>"


def split(text: str, started: bool) -> tuple:
    """(reasoning or None, answer) of a whole generated text (module doc)."""
    lead = len(text) - len(text.lstrip())
    if text.startswith(THINK_BEGIN, lead):
        text, started = text[lead + len(THINK_BEGIN):], True
    if not started:
        return None, text
    i = text.find(THINK_END)
    if i < 0:
        return text, ""
    return text[:i], text[i + len(THINK_END):]


def marker_ids(tokenizer) -> frozenset:
    """The ids of ``<think>`` / ``</think>`` among ``tokenizer``'s special tokens (empty where they are text)."""
    return special_ids(tokenizer, (THINK_BEGIN, THINK_END))


class Splitter:
    """A streamed choice's text split into reasoning and answer deltas as it comes: ``feed(delta)`` returns
    (reasoning, answer) that may be sent now (a tail that may be a marker's beginning is held back); ``finish()``
    what is left. The parts sent equal ``split`` of the whole text."""

    def __init__(self, started: bool):
        self.text, self.sent = "", 0
        self.state = "reasoning" if started else "start"  # start: a <think> may still open the block

    def feed(self, delta: str) -> tuple:
        self.text += delta
        reasoning, answer = [], []
        while True:
            rest = self.text[self.sent:]
            if self.state == "start":
                lead = len(rest) - len(rest.lstrip())
                body = rest[lead:]
                if body.startswith(THINK_BEGIN):
                    self.sent += lead + len(THINK_BEGIN)
                    self.state = "reasoning"
                    continue
                if not body or THINK_BEGIN.startswith(body):
                    break  # blank so far, or what may be the marker: wait
                self.state = "answer"
                continue
            if self.state == "reasoning":
                i = rest.find(THINK_END)
                if i >= 0:
                    reasoning.append(rest[:i])
                    self.sent += i + len(THINK_END)
                    self.state = "answer"
                    continue
                upto = len(rest) - held(rest, THINK_END)
                reasoning.append(rest[:upto])
                self.sent += upto
                break
            answer.append(rest)  # the answer: everything from here on
            self.sent = len(self.text)
            break
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple:
        """At the choice's end: (reasoning, answer) not yet sent."""
        rest, self.sent = self.text[self.sent:], len(self.text)
        if self.state == "reasoning":
            return rest, ""
        return "", rest


def started_by(prompt_text: Optional[str]) -> bool:
    """Whether a rendered chat prompt leaves the model inside a think block (it ends with ``<think>``)."""
    return bool(prompt_text) and prompt_text.rstrip().endswith(THINK_BEGIN)
