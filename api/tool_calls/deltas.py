"""One streamed output's text to OpenAI's chat deltas when it may hold tool calls.

Each piece of text is added to what came before and the whole is parsed again (a reply is
at most a few thousand tokens, and parsing is linear); what the parse holds beyond what
was sent goes out: new content, a new call's index, id, type and name (with empty
arguments, as OpenAI's first tool-call chunk), then its arguments in fragments."""

from __future__ import annotations

from dataclasses import dataclass, field

from api.tool_calls.choice import ToolPlan


@dataclass
class _SentCall:
    id: str
    arguments: int = 0  # characters of arguments sent


@dataclass
class OutputDeltas:
    plan: ToolPlan
    # The output's name for its calls' ids (choice.output_key()).
    output_key: str
    text: str = ""
    content: str = ""  # content sent
    calls: list[_SentCall] = field(default_factory=list)

    def delta(self, piece: str, final: bool) -> dict:
        """The delta for `piece` ({} when it adds nothing to send yet); `final`: the output has ended."""
        self.text += piece
        parsed = self.plan.parse(self.text, final)
        delta: dict = {}
        # A finished text whose calls were malformed is all content: send what extends what was sent.
        if parsed.content and len(parsed.content) > len(self.content) and parsed.content.startswith(self.content):
            delta["content"] = parsed.content[len(self.content):]
            self.content = parsed.content
        tool_calls = []
        for index, call in enumerate(parsed.calls):
            if index == len(self.calls):
                if call.name is None:
                    break  # named later: its arguments wait for it
                self.calls.append(_SentCall(self.plan.call_id(self.output_key, index)))
                tool_calls.append({"index": index, "id": self.calls[index].id, "type": "function",
                                   "function": {"name": call.name, "arguments": ""}})
            sent = self.calls[index]
            if len(call.arguments) > sent.arguments:
                fragment = call.arguments[sent.arguments:]
                sent.arguments = len(call.arguments)
                if tool_calls and tool_calls[-1]["index"] == index:
                    tool_calls[-1]["function"]["arguments"] = fragment
                else:
                    tool_calls.append({"index": index, "function": {"arguments": fragment}})
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        return self.plan.finish_reason(reason, bool(self.calls))
