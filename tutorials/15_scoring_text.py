"""Stage 15: scoring text. Logprobs, echo, and perplexity in windows, each checked against transformers.

1. What a logprob is: the engine's logprob of every prompt token and every generated token, with the
   top 3 at each position, equal to transformers' log_softmax of the same positions.
2. How an eval harness scores a multiple-choice question: one batched completions request with
   `echo`, `logprobs` and `max_tokens: 0`, sent to minfer's server; each choice's score is the sum of
   its own tokens' logprobs after the question.
3. Perplexity of a text longer than a window: each window one engine request with prompt_logprobs,
   scoring only the tokens no earlier window scored.

    python tutorials/15_scoring_text.py   # MINFER_MODEL=/path to choose the checkpoint
"""

import http.client
import json
import math
import threading

import torch
from _common import model_path, section

try:
    import transformers
except ImportError:  # a plain `pip install -e .`: the reference this stage checks against is missing
    raise SystemExit('stage 15 checks every number against transformers: pip install -e ".[tutorials]"') from None

from minfer import LLM, EngineConfig, SamplingParams
from minfer.bench.perplexity import windows
from minfer.server.serve import create_server

TOL = 1e-4
path = model_path()
llm = LLM(path, dtype="float32", num_kv_blocks=64)
hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
tok = llm.tokenizer


def reference(ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every position: row t is the distribution of token t + 1."""
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].log_softmax(-1)  # (T, V)


def show(token_id: int) -> str:
    return repr(tok.decode([token_id]))


section("1. A logprob: log P(token | everything before it)")
prompt = tok.encode_prompt("Once upon a time, there was a little")
out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, logprobs=3, prompt_logprobs=3))[0]
ids = out.prompt_token_ids + out.token_ids
ref = reference(ids)
print(f"{'token':>14}  {'logprob':>9}  top 3 at that position")
for t, entry in enumerate(out.prompt_logprobs + out.logprobs):
    if entry is None:  # the first token has nothing before it: no logprob
        print(f"{show(ids[t]):>14}  {'-':>9}")
        continue
    tops = ", ".join(f"{show(i)} {lp:.2f}" for i, lp in entry.top)
    print(f"{show(entry.token_id):>14}  {entry.logprob:9.4f}  {tops}")
    assert abs(entry.logprob - ref[t - 1, ids[t]].item()) < TOL  # position t - 1 predicts token t
    assert [i for i, _ in entry.top] == ref[t - 1].topk(3).indices.tolist()
greedy_ok = all(e.top[0][0] == e.token_id for e in out.logprobs)
print(f"generated greedily: each generated token is the top of its distribution ({greedy_ok})")
assert greedy_ok

section("2. Multiple choice, the way lm-evaluation-harness asks: echo + logprobs, nothing generated")
server = create_server(EngineConfig(path, dtype="float32", num_kv_blocks=64), port=0, served_model_name="tutorial")
threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
question = "Tim and Bob played with the toy car all"
choices = [" day.", " apples.", " blue."]
context = tok.encode_prompt(question)
prompts = [context + tok.encode(c) for c in choices]  # token ids: the harness tokenizes itself
body = {"model": "tutorial", "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0}
conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
reply = json.loads(conn.getresponse().read())
scores = []
for choice, ids, answer in zip(reply["choices"], prompts, choices):
    continuation = choice["logprobs"]["token_logprobs"][len(context) :]  # the answer's own tokens
    tops = choice["logprobs"]["top_logprobs"][len(context) :]
    score = sum(continuation)
    is_greedy = all(lp == max(top.values()) for lp, top in zip(continuation, tops))
    expected = reference(ids)[len(context) - 1 : -1].gather(1, torch.tensor(ids[len(context) :])[:, None]).sum()
    print(f"{question!r} + {answer!r}: logprob {score:8.3f}  greedy: {is_greedy}")
    assert abs(score - expected.item()) < TOL
    scores.append(score)
print(f"the harness picks {choices[scores.index(max(scores))]!r}: the likeliest continuation")
server.stop(grace=1.0)

section("3. Perplexity in windows: a text longer than the model may read at once")
text = (  # a story from minfer-tiny's held-out text
    "Once upon a time, there was a happy bunny named Jane. Her best friend was a mouse named Ruby. One day, "
    "Jane and Ruby went to the woods to play. She saw a shiny key under a fence. But the key was stuck in the "
    'pond. Jane said, "I want to share the key!" Ruby came and helped her get the key. Jane and Ruby played '
    "with the key all day. Jane learned that it is good to be kind. The end."
)
ids = tok.encode_prompt(text)
window, stride = 48, 24  # each window sees at least 24 tokens of context
params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
nll, scored = 0.0, 0
for begin, end, first in windows(len(ids), window, stride):
    out = llm.generate([ids[begin:end]], params, use_tqdm=False)[0]
    entries = out.prompt_logprobs[first - begin :]  # only the tokens no earlier window scored
    nll -= sum(e.logprob for e in entries)
    scored += len(entries)
    ref_window = reference(ids[begin:end])
    expected = -sum(ref_window[t - begin - 1, ids[t]].item() for t in range(first, end))
    assert abs(-sum(e.logprob for e in entries) - expected) < 10 * TOL
print(
    f"{len(ids)} tokens, {scored} scored, windows of {window} every {stride}: perplexity {math.exp(nll / scored):.2f}"
)
assert scored == len(ids) - 1
