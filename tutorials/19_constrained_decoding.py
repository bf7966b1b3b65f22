"""Stage 19: constrained decoding. A regex, a JSON schema or a grammar becomes a token mask at every step:
tokens that cannot continue a valid output get -inf before the sampler sees them.

It loads the model of the other stages and: compiles a regex with llguidance and replays a constrained
output through it, printing how many tokens each step allowed; holds stories to a JSON schema (on
minfer-tiny, its stories; on a random checkpoint, noise, but noise that parses), beside the same prompt
unconstrained; shows that a completed grammar ends the request; and times what the masks cost beside
plain decoding (printed, not asserted: timings are noisy). Last, a tool call: on a random Qwen3
checkpoint whose chat template renders tools, tool_choice "required" becomes a grammar of calls, and the
reply is read back into OpenAI's tool_calls.

    python tutorials/19_constrained_decoding.py   # MINFER_MODEL=/path to choose the checkpoint
"""

import json
import re
import tempfile
import time

import torch
from _common import model_path, section

from minfer import LLM, SamplingParams, StructuredOutputsParams
from minfer.checkpoints import write_random_checkpoint
from minfer.server.chat_requests import parse_chat
from minfer.server.requests import ModelInfo
from minfer.server.responder import Responder
from minfer.structured.masks import unpack
from minfer.text.chat_template import ChatTemplate

torch.manual_seed(0)
path = model_path()
llm = LLM(path)
tokenizer, vocab = llm.tokenizer, llm.model.config.vocab_size
room = llm.scheduler.features.structured  # the structured/ room, attached by build_engine

section("1. a regex becomes a token mask at each step")
regex = r"[A-Z][a-z]{1,7} (went|ran|saw) (to )?the [a-z]{2,8}\."
params = SamplingParams(max_tokens=40, temperature=0.8, seed=1, structured_outputs=StructuredOutputsParams(regex=regex))
out = llm.generate(["Once upon a time"], params, use_tqdm=False)[0]
print(f"  regex {regex}\n  output {out.text!r} ({out.finish_reason})")
assert out.finish_reason == "stop" and re.fullmatch(regex, out.text)
# Replay the output through a fresh matcher: the mask before each token, and the token drawn from it.
matcher = room.grammars.matcher(params.structured_outputs)
words = (vocab + 31) // 32
for token in out.token_ids:
    bits = torch.zeros(1, words, dtype=torch.int32)  # one bit per row of the logits
    matcher.unsafe_compute_mask_ptr(bits.data_ptr(), 4 * words)
    allowed = unpack(bits, vocab)[0]  # (V,) bool
    examples = [tokenizer.decode([t]) for t in allowed.nonzero().flatten()[:5].tolist()]
    print(f"  {int(allowed.sum()):5d} of {vocab} tokens allowed, e.g. {examples}; drawn {tokenizer.decode([token])!r}")
    assert allowed[token]  # the sampler only ever draws an allowed token
    matcher.consume_token(token)
assert matcher.is_stopped()  # the regex is complete: nothing but an end may follow, so the request ended

section("2. stories held to a JSON schema")
schema = {
    "type": "object",
    "properties": {
        "hero": {"enum": ["Tom", "Lily", "Max", "Sam"]},
        "age": {"type": "integer", "minimum": 3, "maximum": 9},
        "story": {"type": "string", "maxLength": 60},
    },
    "required": ["hero", "age", "story"],
    "additionalProperties": False,
}
shaped = SamplingParams(max_tokens=80, temperature=0.7, seed=3, structured_outputs=StructuredOutputsParams(json=schema))
free = SamplingParams(max_tokens=40, temperature=0.7, seed=3)
outs = llm.generate(["Once upon a time"] * 2, [shaped, free], use_tqdm=False)
print(f"  constrained:   {outs[0].text!r} ({outs[0].finish_reason})")
print(f"  unconstrained: {outs[1].text!r}")
if outs[0].finish_reason == "stop":  # the schema bounds everything, so it ends; a cut output would not parse
    story = json.loads(outs[0].text)
    assert story["hero"] in schema["properties"]["hero"]["enum"] and 3 <= story["age"] <= 9, story
    print(f"  parsed: hero {story['hero']}, age {story['age']}, story {story['story']!r}")

section("3. a completed grammar ends the request, whatever ignore_eos says")
choice = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                        structured_outputs=StructuredOutputsParams(choice=["happily ever after", "the end"]))
out = llm.generate(["And they lived"], choice, use_tqdm=False)[0]
print(f"  {out.text!r}: {len(out.token_ids)} tokens of a max_tokens of 30 ({out.finish_reason})")
assert out.text in ("happily ever after", "the end") and out.finish_reason == "stop"

section("4. what the masks cost")
n, length = 8, 24
endless = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 1000}  # never ends
constrained = SamplingParams(max_tokens=length, temperature=0.8, seed=5, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(json=endless))
plain = SamplingParams(max_tokens=length, temperature=0.8, seed=5, ignore_eos=True)
llm.generate(["Once upon a time"] * n, [plain, constrained] * (n // 2), use_tqdm=False)  # warm-up: compiles the schema
for name, p in (("plain", plain), ("constrained", constrained)):
    steps, start = llm.scheduler.num_steps, time.perf_counter()
    outs = llm.generate(["Once upon a time"] * n, p, use_tqdm=False)
    ms = (time.perf_counter() - start) / (llm.scheduler.num_steps - steps) * 1e3
    print(f"  {name:<12} {n} streams x {length} tokens: {ms:.2f} ms per step")
    assert all(len(o.token_ids) == length for o in outs)
stats = room.stats
print(f"  per masked row: llguidance's fill {stats['fill_us_per_row']:.0f} us on the mask thread, while the forward "
      f"runs (the step waited {stats['wait_us_per_row']:.0f} us of it); applying {stats['apply_us_per_row']:.0f} us")
assert not room.live  # every constrained sequence has let go of its matcher

section("5. a tool call, held to its tool's schema")
# A random Qwen3 with a template that renders tools (the writer's tools=True), its context long enough
# for the tools' prompt. Random weights: only the grammar makes it call anything at all.
scratch = tempfile.TemporaryDirectory(prefix="minfer-qwen3-tiny-")  # removed when the script ends
qwen = str(write_random_checkpoint(scratch.name, "qwen3-tiny", tools=True, max_position_embeddings=2048))
chat = LLM(qwen)
info = ModelInfo("qwen", chat.tokenizer, 2048, ChatTemplate.from_dir(qwen, chat.tokenizer))
weather = {"type": "object", "additionalProperties": False, "required": ["city", "days"], "properties": {
    "city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 200, "temperature": 0,
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}],
        "tool_choice": "required", "parallel_tool_calls": False}
request = parse_chat(body, info)  # what the server does with the request
print(f"  the prompt renders the tools: {'<tools>' in chat.tokenizer.decode(request.prompt_token_ids)}")
grammar = request.params.structured_outputs.grammar  # tool_choice "required", as a grammar of calls
print("  the reply is held to:\n    " + grammar.replace("\n", "\n    ")[:300] + " ...")
out = chat.generate([request.prompt_token_ids], request.params, use_tqdm=False)[0]
print(f"  the model wrote {out.text!r}")
message = Responder("qwen", True, request, chat.tokenizer).response([(out,)])["choices"][0]
call = message["message"]["tool_calls"][0]["function"]
print(f"  the reply: finish_reason {message['finish_reason']!r}, {call['name']}({call['arguments']})")
arguments = json.loads(call["arguments"])
assert message["finish_reason"] == "tool_calls" and call["name"] == "get_weather" and 1 <= arguments["days"] <= 7
