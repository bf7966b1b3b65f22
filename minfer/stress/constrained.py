"""The soak's constrained client: structured outputs mixed into the load.

In turn, a regex, a choice list, a JSON schema and a grammar, asked the ways clients ask (vLLM's
structured_outputs and guided_* on completions, OpenAI's response_format on chat), streamed or not,
greedy or seeded, with n of 1 or 2. A reply must be whole: one finish_reason per choice, a stream ending
in [DONE] with no error event. Every choice that finished with "stop" must meet its constraint: the
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


# (what the request asks, on which endpoint, whether an output meets it)
ASKS = [
    ({"structured_outputs": {"regex": REGEX}}, "completions", lambda t: re.fullmatch(REGEX, t) is not None),
    ({"guided_choice": CHOICES}, "completions", lambda t: t in CHOICES),
    ({"structured_outputs": {"json": PET}}, "completions", is_pet),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}}}, "chat", is_pet),
    ({"guided_grammar": GRAMMAR}, "completions", lambda t: re.fullmatch(GRAMMAR_REGEX, t) is not None),
    ({"guided_regex": REGEX}, "chat", lambda t: re.fullmatch(REGEX, t) is not None),
]


def constrained(target: Target, tally: Tally, end: float, seed: int) -> None:
    rng = random.Random(seed)
    turn = seed % len(ASKS)
    while time.monotonic() < end:
        fields, endpoint, meets = ASKS[turn]
        turn = (turn + 1) % len(ASKS)
        body = {"max_tokens": 60, "n": rng.choice([1, 1, 2]), "stream": rng.random() < 0.5, **fields}
        body.update({"temperature": 0} if rng.random() < 0.5 else {"temperature": 0.9, "seed": rng.randrange(2**31)})
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 12))]  # byte tokens: in any GPT-2 vocabulary
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": bytes(prompt).decode("latin-1")}]
        else:
            body["prompt"] = prompt
        try:
            texts = _ask(target, tally, endpoint, body)
        except OSError as e:
            tally.fail(f"constrained: {type(e).__name__}: {e}")
            time.sleep(0.2)  # no hot loop against a server that is gone
            continue
        if texts is None:
            continue
        for text, finish_reason in texts:
            tally.count(f"constrained outputs ending with {finish_reason}")
            if finish_reason == "stop" and not meets(text):
                tally.fail(f"constrained: an output that stopped does not meet {fields}: {text[:120]!r}")
        tally.count("constrained requests answered")


def _ask(target: Target, tally: Tally, endpoint: str, body: dict) -> list[tuple[str, str]] | None:
    """Each choice's (text, finish_reason), in index order; None if the request was refused or broken."""
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
        elif resp.status < 500:
            tally.fail(f"constrained: got {resp.status}: {payload[:200]!r}")
        return None
    if not body["stream"]:
        choices = sorted(json.loads(payload)["choices"], key=lambda c: c["index"])
        return [(c["message"]["content"] if endpoint == "chat" else c["text"], c["finish_reason"]) for c in choices]
    events = [line[6:].strip() for line in payload.splitlines() if line.startswith(b"data: ")]
    if not events or events[-1] != b"[DONE]" or any(b'"error"' in e for e in events):
        tally.fail(f"constrained stream ended badly: {events[-2:]}")
        return None
    texts, finishes = {}, {}
    for chunk in (json.loads(e) for e in events[:-1]):
        for c in chunk["choices"]:
            piece = c.get("text") if endpoint != "chat" else c["delta"].get("content")
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
            if c["finish_reason"]:
                finishes[c["index"]] = c["finish_reason"]
    if sorted(finishes) != list(range(body["n"])):
        tally.fail(f"constrained stream: finish_reasons {finishes} for n = {body['n']}")
        return None
    return [(texts.get(i, ""), finishes[i]) for i in range(body["n"])]
