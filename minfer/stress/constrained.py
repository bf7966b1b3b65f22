"""The soak's constrained client: structured outputs and tool calls mixed into the load.

In turn, a regex, a choice list, a JSON schema and a grammar, asked the ways clients ask (vLLM's
structured_outputs and guided_* on completions, OpenAI's response_format on chat), and tools with
tool_choice "required", a named function and "auto" (the spawned server renders them through a
tool-aware chat template: soak.py), streamed or not, greedy or seeded, with n of 1 or 2. A reply must be
whole: one finish_reason per choice, a stream ending in [DONE] with no error event. A tool call must
name a tool and carry valid arguments, and an enforced reply that ends on its own ends with a call.
Every choice that finished with "stop" must meet its constraint: the
regex matches (re.fullmatch: the regexes keep to ASCII classes, where Python's and llguidance's agree),
the choice is one of the list, the JSON parses and has the schema's keys and kinds (checked by hand: the
soak runs with the runtime dependencies alone). A 429 (the queue is full) is counted, not failed.
"""

from __future__ import annotations

import json
import random
import re
import time

from .clients import Tally, Target, check_error_reply

PET = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                        "legs": {"type": "integer", "minimum": 0, "maximum": 8},
                                        "tame": {"type": "boolean"}},
       "required": ["name", "legs", "tame"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{1,5} [0-9]{1,3}(\.[0-9])?"
CHOICES = ["north", "south", "east", "west"]
GRAMMAR = 'start: "(" NUM ("," NUM)? ")"\nNUM: /[0-9]{1,2}/'
GRAMMAR_REGEX = r"\([0-9]{1,2}(,[0-9]{1,2})?\)"  # the same language


def is_pet(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == {"name", "legs", "tame"} and isinstance(value["name"], str)
            and len(value["name"]) <= 6 and type(value["legs"]) is int and 0 <= value["legs"] <= 8
            and type(value["tame"]) is bool)


# Short, so that the tools' prompt leaves room in a small model's context.
GO = {"type": "object", "additionalProperties": False, "required": ["to", "days"],
      "properties": {"to": {"type": "string", "maxLength": 6}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "go", "parameters": GO}},
         {"type": "function", "function": {"name": "now"}}]  # no parameters: called with {}


def valid_call(name: str, arguments: str) -> bool:
    try:
        value = json.loads(arguments)
    except ValueError:
        return False
    if name == "now":
        return value == {}
    return (name == "go" and isinstance(value, dict) and set(value) == {"to", "days"} and isinstance(value["to"], str)
            and len(value["to"]) <= 6 and type(value["days"]) is int and 1 <= value["days"] <= 7)


def text_meets(meets):
    """The check of a reply held to a text constraint: when it stops, its text meets it."""
    return lambda text, calls, finish_reason: not calls and (finish_reason != "stop" or meets(text))


def calls_valid(required: bool):
    """The check of a reply with tools: its calls are the tools' with valid arguments (the last one may be
    cut short by max_tokens: an enforced call is returned as far as it got, as OpenAI does), and an
    enforced reply that ended on its own ended with a call."""
    def check(text, calls, finish_reason):
        if finish_reason == "tool_calls":
            return bool(calls) and all(valid_call(name, arguments) for name, arguments in calls)
        if finish_reason == "length":
            return all(name in ("go", "now") for name, _ in calls) and all(valid_call(*c) for c in calls[:-1])
        return not calls and not required
    return check


# (what the request asks, on which endpoint, the check of a reply: (text, calls, finish_reason) -> bool),
# tools between the others, so that every client soon asks for both
ASKS = [
    ({"structured_outputs": {"regex": REGEX}}, "completions", text_meets(lambda t: re.fullmatch(REGEX, t) is not None)),
    ({"tools": TOOLS, "tool_choice": "required"}, "chat", calls_valid(required=True)),
    ({"guided_choice": CHOICES}, "completions", text_meets(lambda t: t in CHOICES)),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "go"}},
      "parallel_tool_calls": False}, "chat", calls_valid(required=True)),
    ({"structured_outputs": {"json": PET}}, "completions", text_meets(is_pet)),
    ({"tools": TOOLS, "tool_choice": "auto"}, "chat", calls_valid(required=False)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}}}, "chat",
     text_meets(is_pet)),
    ({"guided_grammar": GRAMMAR}, "completions", text_meets(lambda t: re.fullmatch(GRAMMAR_REGEX, t) is not None)),
    ({"guided_regex": REGEX}, "chat", text_meets(lambda t: re.fullmatch(REGEX, t) is not None)),
]


def constrained(target: Target, tally: Tally, end: float, seed: int) -> None:
    rng = random.Random(seed)
    turn = seed % len(ASKS)
    tools_served = True  # until the server says its chat template renders none (--base-url: any server)
    while time.monotonic() < end:
        fields, endpoint, check = ASKS[turn]
        turn = (turn + 1) % len(ASKS)
        if "tools" in fields and not tools_served:
            continue
        body = {"max_tokens": 40, "n": rng.choice([1, 1, 2]), "stream": rng.random() < 0.5, **fields}
        body.update({"temperature": 0} if rng.random() < 0.5 else {"temperature": 0.9, "seed": rng.randrange(2**31)})
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 12))]  # byte tokens: in any GPT-2 vocabulary
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": bytes(prompt).decode("latin-1")}]
        else:
            body["prompt"] = prompt
        try:
            replies = _ask(target, tally, endpoint, body)
        except OSError as e:
            tally.fail(f"constrained: {type(e).__name__}: {e}")
            time.sleep(0.2)  # no hot loop against a server that is gone
            continue
        if replies is NO_TOOLS:
            tools_served = False
            continue
        if replies is None:
            continue
        kind = "tool" if "tools" in fields else "constrained"
        for text, calls, finish_reason in replies:
            tally.count(f"{kind} outputs ending with {finish_reason}")
            tally.count("tool calls returned", len(calls))
            if not check(text, calls, finish_reason):
                tally.fail(f"{kind}: a reply does not meet {fields}: {finish_reason}, {text[:80]!r}, {calls}")
        tally.count(f"{kind} requests answered")


NO_TOOLS: list = []  # _ask's answer when the server's chat template renders no tools


def _ask(target: Target, tally: Tally, endpoint: str, body: dict) -> list[tuple[str, list, str]] | None:
    """Each choice's (text, [(name, arguments)], finish_reason), in index order; None if the request was
    refused or broken; NO_TOOLS if it had tools the server's template cannot render."""
    conn = target.connection()
    try:
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        payload = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        check_error_reply(tally, "constrained", resp.status, payload)  # a 5xx or a stack trace fails
        if resp.status == 429:
            tally.count("constrained requests refused with 429")
        elif resp.status == 400 and "tools" in body and b"does not render tools" in payload:  # a 400 as it should be
            tally.count("tool requests refused: the chat template renders no tools")
            return NO_TOOLS
        elif resp.status < 500:
            tally.fail(f"constrained: got {resp.status}: {payload[:200]!r}")
        return None
    if not body["stream"]:
        choices = sorted(json.loads(payload)["choices"], key=lambda c: c["index"])
        if endpoint != "chat":
            return [(c["text"], [], c["finish_reason"]) for c in choices]
        return [(c["message"]["content"] or "", [(t["function"]["name"], t["function"]["arguments"])
                                                 for t in c["message"].get("tool_calls") or []], c["finish_reason"])
                for c in choices]
    events = [line[6:].strip() for line in payload.splitlines() if line.startswith(b"data: ")]
    if not events or events[-1] != b"[DONE]" or any(b'"error"' in e for e in events):
        tally.fail(f"constrained stream ended badly: {events[-2:]}")
        return None
    texts, calls, finishes = {}, {}, {}
    for chunk in (json.loads(e) for e in events[:-1]):
        for c in chunk["choices"]:
            delta = c.get("delta", {})
            piece = c.get("text") if endpoint != "chat" else delta.get("content")
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
            for d in delta.get("tool_calls") or []:  # a call's name first, then its arguments' fragments
                call = calls.setdefault(c["index"], {}).setdefault(d["index"], ["", ""])
                call[0] += d["function"].get("name") or ""
                call[1] += d["function"].get("arguments") or ""
            if c["finish_reason"]:
                finishes[c["index"]] = c["finish_reason"]
    if sorted(finishes) != list(range(body["n"])):
        tally.fail(f"constrained stream: finish_reasons {finishes} for n = {body['n']}")
        return None
    return [(texts.get(i, ""), [tuple(v) for _, v in sorted(calls.get(i, {}).items())], finishes[i])
            for i in range(body["n"])]
