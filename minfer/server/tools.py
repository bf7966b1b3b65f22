"""A chat request's tools: `tools`, `tool_choice` and `parallel_tool_calls`, read and checked once.

- `tools`: OpenAI's function definitions, `{"type": "function", "function": {"name", "description",
  "parameters"}}`, the parameters a JSON schema, checked as LLM.chat's are (text/tool_checks.py). They render
  through the chat template's `tools` variable, so a template that has none cannot take them (a 400 that says so).
- `tool_choice`: "auto" (the default with tools: the model's text decides, and a call it writes comes
  back in `tool_calls`), "none" (no tools rendered, content only), "required" (a call to one of the
  tools), or `{"type": "function", "function": {"name": ...}}` (a call to that one). "required" and a
  named function are enforced: a grammar (tool_calls.py) that the structured/ room holds the reply to,
  so the call's name is a tool's and its arguments validate against that tool's parameters. Under "auto", a
  tool with `strict: true` holds every call the reply makes to the tools (a strict one's arguments to its
  parameters), its text left free; a response_format, which leaves no room for a call, goes first.
- `parallel_tool_calls` (default true): a "required" reply holds one call, or with it one or more; a named
  function is called exactly once either way; an "auto" reply without it gives back its first call only.
- `stop` (not a tools field, but it meets them): stop strings end a reply's text. An enforced reply is calls
  only, so none apply to it (they could only cut a call in half); in an "auto" reply they act on the text as
  the model writes it, and a call they cut is content (finish_reason "stop"), as a call max_tokens cuts is.
OpenAI's older `functions` and `function_call` are refused, pointing here.

Unless tool_choice is "none", the replies are read back for calls (ToolReplies, with tool_calls.py's
parser): a call comes back in `message.tool_calls`, with finish_reason "tool_calls"; streamed, as
OpenAI's tool-call deltas (index, id and name, then fragments of the arguments), content that could
still open a call held back until it cannot.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..engine.outputs import CompletionDelta
from ..engine.sampling_params import SamplingParams
from ..engine.structured_outputs_params import StructuredOutputsParams
from .api_errors import invalid, refused
from ..errors import InvalidParameter
from ..text.chat_template import ChatTemplate
from ..text.tool_checks import check_tools
from .chat_messages import show
from .tool_calls import CallStream, ToolFormat, call_id, format_of, parameters, read

READ = frozenset({"tools", "tool_choice", "parallel_tool_calls", "functions", "function_call"})  # chat's fields
CHOICES = ("none", "auto", "required")


@dataclass
class Tools:
    tools: list[dict]
    choice: str  # "auto", "required", "none", or "function" (the one named)
    named: str | None  # the function tool_choice names
    parallel: bool
    format: ToolFormat

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def rendered(self) -> list[dict] | None:
        """The tools the chat template shows the model: none under "none"."""
        return None if self.choice == "none" else self.tools

    @property
    def enforced(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def strict(self) -> bool:
        """Under "auto", a tool asks for `strict`: the reply's calls are held to the tools, its text is free."""
        return self.choice == "auto" and any(t["function"].get("strict") is True for t in self.tools)

    def constraint(self, other: StructuredOutputsParams | None = None, source: str | None = None):
        """The grammar a "required" or named reply is held to (a StructuredOutputsParams), which leaves no
        room for another constraint (`other`, from the request's field `source`); under "auto" with a strict
        tool, the grammar of text whose calls are held to the tools."""
        if not self.enforced:
            return StructuredOutputsParams(grammar=self.format.auto_grammar(self.tools, self.parallel))
        if other is not None:
            raise invalid(source, f"'{source}' and tool_choice {self.choice!r} both hold the reply to a format: "
                          "a call's format is the tool's")
        names = [self.named] if self.named else self.names
        return StructuredOutputsParams(grammar=self.format.grammar(self.tools, names, self.parallel))

    def fault(self, error: InvalidParameter, check) -> InvalidParameter:
        """Why the tools' grammar does not compile (`error`, from the engine), named by the field at fault: the first
        held tool whose parameters do not compile alone (`check` compiles a StructuredOutputsParams), with its
        reason; else `error`'s first line (the rest quotes the grammar minfer wrote, not the client's)."""
        for i, tool in enumerate(self.tools):
            if self._holds(tool) and tool["function"].get("parameters") is not None:
                try:
                    check(StructuredOutputsParams(json=parameters(tool)))
                except InvalidParameter as e:
                    field = f"tools[{i}].function.parameters"
                    return InvalidParameter(field, f"'{field}' is invalid: {e}", e.code)
        reason = re.sub(r"at \d+\(\d+\): ", "", str(error).splitlines()[0])  # llguidance's line and column
        return InvalidParameter("tools", f"'tools' is invalid: {reason}", error.code)

    def _holds(self, tool: dict) -> bool:
        """Whether the reply's grammar holds calls of `tool` to its parameters."""
        if self.choice == "function":
            return tool["function"]["name"] == self.named
        return self.enforced or tool["function"].get("strict") is True

    def uncut(self, params: SamplingParams) -> SamplingParams:
        """`params` for a reply to these tools. Stop strings end a reply's text, never a call: an enforced reply
        is calls only, so there they could only cut a call in half (vLLM's do), into arguments no client runs."""
        return replace(params, stop=None) if self.enforced else params


class ToolReplies:
    """One response's chat replies, read for calls to the request's tools: every call, or without
    parallel_tool_calls the first."""

    def __init__(self, tools: Tools, num_choices: int):
        self.tools, self.names, self.limit = tools, set(tools.names), None if tools.parallel else 1
        self.streams = [CallStream(tools.format, self.names, tools.enforced, self.limit) for _ in range(num_choices)]

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A whole reply as the assistant's message: its content, and the calls read out of it."""
        reading = read(self.tools.format, text, self.names, final=True, partial=self.tools.enforced)
        calls = [{"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in reading.calls[: self.limit]]
        if not calls:
            return {"role": "assistant", "content": reading.content}, finish_reason
        message = {"role": "assistant", "content": reading.content or None, "tool_calls": calls}
        return message, _finish_reason(finish_reason, all(c.complete for c in reading.calls[: self.limit]))

    def add(self, index: int, delta: CompletionDelta) -> tuple[str, list[dict]]:
        """A streamed reply's delta: (content to send, tool-call deltas to send)."""
        return self.streams[index].add(delta.text, final=delta.finish_reason is not None)

    def finish_reason(self, index: int, finish_reason: str | None) -> str | None:
        stream = self.streams[index]
        return _finish_reason(finish_reason, stream.complete) if stream.called else finish_reason


def _finish_reason(finish_reason: str | None, complete: bool) -> str | None:
    """A reply that called: "tool_calls" where it stopped with its calls whole; any other ending keeps its
    reason ("length" where max_tokens cut a call)."""
    return "tool_calls" if finish_reason == "stop" and complete else finish_reason


def read_tools(body: dict, template: ChatTemplate) -> Tools | None:
    """The request's tools, checked; None if it has none (and asks nothing of them)."""
    for old in ("functions", "function_call"):
        if body.get(old) is not None:
            raise invalid(old, f"'{old}' is OpenAI's deprecated way to offer functions: send them in 'tools' "
                          "(and 'tool_choice' for which to call)", "unsupported_parameter")
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", f"'parallel_tool_calls' must be a boolean, got {show(parallel)}",
                      "invalid_type")
    if tools is None or tools == []:
        if choice is not None and choice != "none":
            raise invalid("tool_choice", "'tool_choice' needs 'tools': give the functions the model may call")
        return None
    try:  # the tools themselves, then (unless none are to be rendered) that the template renders them
        check_tools(tools, None if choice == "none" else template)
    except InvalidParameter as e:
        raise refused(e) from None
    names, named = [t["function"]["name"] for t in tools], None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        function = choice.get("function")
        named = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(named, str):
            raise invalid("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                          '{"type": "function", "function": {"name": ...}}, got ' + show(choice))
        if named not in names:
            raise invalid("tool_choice", f"'tool_choice' names {named!r}, which is not one of the tools: "
                          f"{', '.join(names)}")
        choice = "function"
    elif choice not in CHOICES:
        raise invalid("tool_choice", f"'tool_choice' must be one of {', '.join(CHOICES)} or a named function, "
                      f"got {show(choice)}")
    # A named function is called once, as OpenAI's forced function is (and vLLM's), whatever parallel_tool_calls says
    parallel = choice != "function" and parallel is not False
    return Tools(tools, choice, named, parallel, format_of(template))
