"""REASONING_PARSER: a reply's thinking apart from its answer, as vLLM's `qwen3` and `deepseek_r1` parsers split it.

Both families think between `<think>` and `</think>`; their chat templates usually put `<think>` in the prompt,
so the output is "reasoning</think>answer" (older templates let the model write `<think>` itself: stripped). A reply
starts in its reasoning unless the prompt already ended it: the template closed a think block (`enable_thinking:
false` renders "<think>\\n\\n</think>" into Qwen3's prompt), or, for qwen3, the request turned thinking off. With no
`</think>` at all, the whole reply is reasoning (cut off by max_tokens, as vLLM reads it), except for qwen3 with
thinking off, where it is all answer.

ReasoningStream splits text as it streams: a marker split across deltas (or flush batches) is held back until it
is whole or cannot be one. It also counts the reasoning's tokens (usage.completion_tokens_details)."""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


def starts_in_content(parser: str, prompt_tail: str, template_kwargs: dict | None) -> bool:
    """Whether a reply begins with its answer: the prompt's last think marker is a `</think>`, or (qwen3) the
    request set enable_thinking false."""
    if parser == "qwen3" and (template_kwargs or {}).get("enable_thinking") is False:
        return True
    return prompt_tail.rfind(END) > prompt_tail.rfind(START)


class ReasoningStream:
    def __init__(self, in_content: bool = False):
        self.in_content = in_content
        self.pending = ""  # held back: may be the start of a marker
        self.seen_text = False  # reasoning text emitted (a `<think>` after it is text, not a marker)
        self.reasoning_tokens = 0
        self.reasoning, self.content = [], []  # everything split so far

    def feed(self, text: str, tokens: int = 0) -> tuple[str, str]:
        """(reasoning, answer) text of this delta; `tokens` of it count as reasoning while the reasoning runs (the
        delta that ends it included)."""
        if self.in_content:
            self.content.append(text)
            return "", text
        self.reasoning_tokens += tokens
        buf, out_r, out_c = self.pending + text, "", ""
        self.pending = ""
        if not self.seen_text:  # a leading <think> (after whitespace) is the model opening its own block
            head = buf.lstrip()
            if head.startswith(START):
                buf = buf[: len(buf) - len(head)] + head[len(START) :]
            elif START.startswith(head) and head:  # maybe the start of one: wait
                self.pending = buf
                return "", ""
        end = buf.find(END)
        if end >= 0:
            out_r, out_c = buf[:end], buf[end + len(END) :]
            self.in_content = True
        else:
            keep = _partial_suffix(buf, END)
            out_r, self.pending = buf[: len(buf) - keep], buf[len(buf) - keep :]
        self.seen_text = self.seen_text or bool(out_r.strip())
        self.reasoning.append(out_r)
        self.content.append(out_c)
        return out_r, out_c

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the reply: reasoning (a marker never completed is text)."""
        out, self.pending = self.pending, ""
        if out and not self.in_content:
            self.reasoning.append(out)
            return out, ""
        return "", ""

    def split(self) -> tuple[str | None, str | None]:
        """The whole reply so far: (reasoning or None, answer or None), vLLM's message fields."""
        r, c = "".join(self.reasoning), "".join(self.content)
        return (r or None), (c or None)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker` (0: none)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
