"""Tool calls in a model's reply: how each chat family writes one, the grammar that enforces it, and the
parser that reads calls back, from a whole reply or from one still streaming.

Two formats, chosen by what the chat template writes (`format_of`):
- Qwen3's (Hermes'): `<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>`,
  a block per call; text outside the blocks is content;
- Llama 3's: the reply is a JSON object `{"name": "get_weather", "parameters": {...}}`, two calls
  separated by "; ".
A call's `arguments` is its raw JSON text as the model wrote it, so a stream's fragments add up to
exactly what a whole reply gives. A block that does not read as a call (bad JSON, a name that is not a
tool) is content, whole: a reply never holds half a call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ..text.chat_template import ChatTemplate

WHITESPACE = "[ ]?"  # JSON's whitespace in an enforced call: at most one space, as structured/ defaults to


@dataclass(frozen=True)
class ToolFormat:
    name: str
    open: str  # what opens a call ("" where the reply is the call)
    close: str  # what closes it
    arguments: str  # the key of the arguments
    separator: str  # between two calls

    def grammar(self, tools: list[dict], names: list[str], parallel: bool) -> str:
        """A Lark grammar (llguidance's, with %json) for calls to `names`, their arguments valid against
        the tools' parameters: exactly one call, or with `parallel` one or more."""
        body = self._body([(t, parameters(t)) for t in tools if t["function"]["name"] in names])
        call = f"{json.dumps(self.open + chr(10))} body {json.dumps(chr(10) + self.close)}" if self.open else "body"
        more = f" ({json.dumps(self.separator)} call)*" if parallel else ""
        return f"start: call{more}\ncall: {call}\n{body}"

    def auto_grammar(self, tools: list[dict], parallel: bool) -> str:
        """The grammar of an "auto" reply with a strict tool: text, but every call it opens is a call to a
        tool, a strict one's arguments valid against its parameters (another's, any object); with
        `parallel`, as many calls as it likes, else one at most. Lexemes' `&` and `~` are llguidance's."""
        body = self._body([(t, parameters(t) if t["function"].get("strict") else {"type": "object"}) for t in tools])
        if not self.open:  # Llama 3's: the reply is the calls, or text that does not open as a call would
            more = f" ({json.dumps(self.separator)} body)*" if parallel else ""
            return f"start: TEXT | calls\nTEXT: /{ANY}/ & ~/[ \\t\\n]*\\{{{ANY}/\ncalls: body{more}\n{body}"
        # As llguidance's StructTag: the text before an opening is lazy (it ends at the opening, and a call
        # follows); the text after the last call holds no opening.
        return (f"%llguidance {{}}\nstart: call{'*' if parallel else '?'} tail\ntail: TAIL\n"
                f"TAIL: /{ANY}/ & ~/{ANY}{_regex(self.open)}{ANY}/\nopening[lazy]: TEXT {json.dumps(self.open)}\n"
                f"TEXT: /{ANY}/\ncall: opening {json.dumps(chr(10))} body {json.dumps(chr(10) + self.close)}\n{body}")

    def _body(self, tools: list[tuple[dict, dict]]) -> str:
        """The rule `body`: a call's JSON object, one alternative per (tool, schema of its arguments)."""
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", self.arguments],
                  "properties": {"name": {"const": t["function"]["name"]}, self.arguments: schema}}
                 for t, schema in tools]
        return f"body: %json {json.dumps({'x-guidance': {'whitespace_pattern': WHITESPACE}, 'anyOf': calls})}"


ANY = r"(.|\n)*"  # any text, as a regex


def _regex(text: str) -> str:
    """`text` as a regex matching it (Rust's syntax: only its own metacharacters escaped)."""
    return "".join("\\" + c if c in r"\.+*?()|[]{}^$#&-~/" else c for c in text)


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments", "\n")
LLAMA3_JSON = ToolFormat("llama3_json", "", "", "parameters", "; ")


def format_of(template: ChatTemplate) -> ToolFormat:
    """The format a tool-aware template teaches: Hermes' tags where it writes them, else Llama 3's JSON."""
    return HERMES if template.source is not None and HERMES.open in template.source else LLAMA3_JSON


def parameters(tool: dict) -> dict:
    """A tool's parameter schema, as the grammar holds its arguments; none given is an empty parameter list
    (OpenAI's reading). Arguments are an object, whether or not the schema says `"type": "object"` (a bare {}
    allows any value). The schema stands inside the call's, so it is a resource of its own (`$id`): its local
    references ("#/$defs/City", as pydantic writes them, or "#") resolve against it, not the call's schema."""
    given = tool["function"].get("parameters")
    if given is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return {"$id": f"urn:minfer:tool:{tool['function']['name']}", **given, "type": "object"}


@dataclass
class Call:
    name: str
    arguments: str  # the arguments' raw JSON text; while streaming, as much of it as can no longer change
    complete: bool = True


@dataclass
class Reading:
    content: str  # the text that is not a call, stripped at both ends (while streaming: what is settled)
    calls: list[Call]


class CallStream:
    """One streamed choice's reply, read again as it grows: what it adds to the content, and OpenAI's
    tool-call deltas (a call's index, id and name first, then fragments of its arguments)."""

    def __init__(self, fmt: ToolFormat, names: set[str], partial: bool, limit: int | None = None):
        self.fmt, self.names, self.partial, self.limit = fmt, names, partial, limit  # limit: the calls kept
        self.text = ""
        self.content_sent = 0
        self.sent: list[list] = []  # per call: [id, arguments sent]
        self.complete = True  # every call read so far has closed

    def add(self, piece: str, final: bool) -> tuple[str, list[dict]]:
        """(content to send, tool-call deltas to send) once `piece` has joined the reply."""
        self.text += piece
        reading = read(self.fmt, self.text, self.names, final, self.partial)
        content, self.content_sent = reading.content[self.content_sent :], len(reading.content)
        deltas, self.complete = [], all(call.complete for call in reading.calls[: self.limit])
        for i, call in enumerate(reading.calls[: self.limit]):
            if i == len(self.sent):
                self.sent.append([call_id(), ""])
                deltas.append({"index": i, "id": self.sent[i][0], "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            sent = self.sent[i][1]
            if call.arguments.startswith(sent) and len(call.arguments) > len(sent):
                deltas.append({"index": i, "function": {"arguments": call.arguments[len(sent) :]}})
                self.sent[i][1] = call.arguments
        return content, deltas

    @property
    def called(self) -> bool:
        return bool(self.sent)


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(arguments|parameters)"\s*:\s*')


def read(fmt: ToolFormat, text: str, names: set[str], final: bool, partial: bool) -> Reading:
    """What `text` says: its content and its calls. Until `final`, only what more text cannot change:
    content that could still open a call is held back. With `partial` (calls the grammar enforces, so
    they always complete), an open call is read as far as it goes; without, it waits until it closes."""
    pieces, calls, at, after_call = [], [], 0, False
    while at <= len(text):
        start = _next_call(fmt, text, at)
        # Llama 3's separator after a call, or before one, is not content; between two blocks that are no
        # calls, the text is the content's own (it waits while the next block may yet become a call)
        separator = not fmt.open and after_call
        if start < 0:
            tail = text[at:].lstrip(" \n\t;") if separator else text[at:]
            pieces.append(tail if final else tail[: len(tail) - _opening_prefix(fmt, tail)])
            break
        gap = "" if separator else text[at:start]
        if fmt.open:  # Hermes' blocks are tagged: what stands between them is content
            pieces.append(gap)
            gap = ""
        end, after = _end_of_call(fmt, text, start, final and not partial)
        if end < 0:  # open: it may still become a call
            if partial and (call := _open_call(fmt, text[start + len(fmt.open) :])) is not None:
                calls.append(call)
            elif final:
                pieces.append(gap + text[start:])
            break
        call = _call(text[start + len(fmt.open) : end], names)
        if call is None:
            pieces.append(gap + text[start:after])  # not a call: its text is content, whole
        else:
            calls.append(call)
        after_call, at = call is not None, after
    # Stripped at both ends, whole or streaming: trailing whitespace may yet stand between two calls.
    return Reading("".join(pieces).strip(), calls)


def _next_call(fmt: ToolFormat, text: str, at: int) -> int:
    """Where the next call opens at or after `at`, or -1."""
    if fmt.open:
        return text.find(fmt.open, at)
    rest = text[at:]  # Llama 3's: the reply is the calls, or it is content
    stripped = rest.lstrip(" \n\t;" if at else " \n\t")
    return at + len(rest) - len(stripped) if stripped.startswith("{") else -1


def _end_of_call(fmt: ToolFormat, text: str, start: int, whole: bool) -> tuple[int, int]:
    """(where the call's JSON ends, where the text after it starts), or (-1, -1) while it is open. A closing
    tag inside one of the JSON's strings (an argument may well hold "</tool_call>") does not close it: only
    one outside them does, or, in a `whole` reply where none does (a stray quote), the first of all."""
    if fmt.close:
        end = _close_outside_strings(fmt, text, start + len(fmt.open))
        if end < 0 and whole:
            end = text.find(fmt.close, start)
        return (end, end + len(fmt.close)) if end >= 0 else (-1, -1)
    try:
        _, end = json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return -1, -1
    return end, end


def _close_outside_strings(fmt: ToolFormat, text: str, at: int) -> int:
    """Where the first closing tag at or after `at` that no JSON string holds starts, or -1. Whether a
    point is inside a string depends on the text before it alone, so a stream's prefix finds what the whole
    reply does."""
    in_string = False
    for m in re.finditer(r'\\.?|"|' + re.escape(fmt.close), text[at:], re.S):  # an escape hides its character
        if m.group() == '"':
            in_string = not in_string
        elif not in_string and m.group() == fmt.close:
            return at + m.start()
    return -1


def _opening_prefix(fmt: ToolFormat, tail: str) -> int:
    """How much of the end of `tail` could be the start of a call's opening (held back, as a stop string's)."""
    if not fmt.open:  # Llama 3's: only whitespace, or after a block a separator, may yet stand before a call
        return len(tail) if not tail.strip(" \n\t;") else 0
    return next((k for k in range(min(len(fmt.open) - 1, len(tail)), 0, -1) if tail.endswith(fmt.open[:k])), 0)


def _call(body: str, names: set[str]) -> Call | None:
    """A closed call's JSON object as a Call, or None if it is not one: bad JSON, or no such tool."""
    members = _members(body.strip())
    if members is None or not isinstance(members.get("name", (None,))[0], str):
        return None
    arguments = members.get("arguments") or members.get("parameters")
    if members["name"][0] not in names or arguments is None or not isinstance(arguments[0], dict):
        return None
    return Call(members["name"][0], arguments[1])


def _open_call(fmt: ToolFormat, body: str) -> Call | None:
    """An enforced call still being written: its name once whole, and its arguments so far, less what may
    be the end of the call (its last "}" on: the arguments' own last one may yet be followed by more)."""
    header = HEADER.match(body)
    if header is None:
        return None
    arguments = body[header.end() :]
    return Call(header.group(1), arguments[: arguments.rfind("}")].rstrip() if "}" in arguments else arguments,
                complete=False)


def _members(text: str) -> dict[str, tuple[object, str]] | None:
    """A JSON object's top-level members, key -> (value, the value's raw text); None if `text` is not
    exactly one object. json does the parsing; this only walks between its values."""
    decoder = json.JSONDecoder()
    try:
        whole, end = decoder.raw_decode(text)
    except ValueError:
        return None
    if not isinstance(whole, dict) or end != len(text):
        return None
    members, i = {}, _skip(text, 1)
    while text[i] != "}":
        key, i = decoder.raw_decode(text, i)
        i = _skip(text, _skip(text, i) + 1)  # past the ':'
        value, j = decoder.raw_decode(text, i)
        members[key] = (value, text[i:j])
        i = _skip(text, j)
        i = _skip(text, i + 1) if text[i] == "," else i
    return members


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i
