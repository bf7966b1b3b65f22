"""Stage 01: the GPT-2 forward pass, from token ids to next-token logits.

Runs minfer's GPT2.forward on a batch, then repeats it step by step with the
model's own modules (embeddings -> blocks -> final LayerNorm -> LM head) to show
what happens inside, checks causality, compares the logits with transformers'
GPT2LMHeadModel, and picks the greedy next token.

    python tutorials/01_gpt2_forward.py          # MINFER_MODEL=/path to choose the checkpoint
"""

import torch
from _common import model_path, section

from minfer.models.gpt2 import GPT2
from minfer.text.tokenizer import Tokenizer

torch.manual_seed(0)
path = model_path()
model = GPT2.from_pretrained(path)  # float32 on the CPU: the reference precision
tokenizer = Tokenizer.from_dir(path)
cfg = model.config

section("the model")
n_params = sum(p.numel() for p in model.parameters())
print(
    f"{cfg.n_layer} blocks, {cfg.n_head} heads of {cfg.head_dim}, width C={cfg.n_embd}, "
    f"vocabulary V={cfg.vocab_size}, context {cfg.n_positions}: {n_params:,} parameters"
)
# The LM head has no weights of its own: it reuses the token embedding ("tied"), so the
# parameter count has no separate V x C output matrix.
assert not any("lm_head" in name for name, _ in model.named_parameters())

section("a batch of token ids")
texts = ["The quick brown fox jumps over the lazy dog.", "Once upon a time, in a land far away, there"]
encoded = [tokenizer.encode(t) for t in texts]
T = min(len(e) for e in encoded)  # the plain forward has no padding mask: cut both to one length
ids = torch.tensor([e[:T] for e in encoded])  # (B, T)
B = ids.shape[0]
print(f"input_ids: {tuple(ids.shape)} = (batch B, time T)")

with torch.inference_mode():
    logits = model(ids)  # (B, T, V)
print(f"logits:    {tuple(logits.shape)} = (B, T, V): a score for every vocabulary entry at every position")
assert logits.shape == (B, T, cfg.vocab_size)

section("inside GPT2.forward, one module at a time")
with torch.inference_mode():
    pos = torch.arange(T)  # (T,) positions 0..T-1
    x = model.wte(ids) + model.wpe(pos)  # (B, T, C): what the token is + where it is
    print(f"embeddings wte(ids) + wpe(pos): {tuple(x.shape)}")
    for i, block in enumerate(model.h):
        x = x + block.attn(block.ln_1(x))  # (B, T, C): mix information across positions
        x = x + block.mlp(block.ln_2(x))  # (B, T, C): transform each position on its own
        if i == 0:
            print(f"after block 0 (attention, then MLP, each added to the residual stream): {tuple(x.shape)}")
    h = model.ln_f(x)  # (B, T, C)
    manual = h @ model.wte.weight.T  # (B, T, C) @ (C, V) -> (B, T, V): the tied LM head
print(f"after {cfg.n_layer} blocks, ln_f and the LM head: {tuple(manual.shape)}")
diff = (manual - logits).abs().max().item()
print(f"max |manual - model(ids)| = {diff:.2e}")
assert diff <= 1e-4 * max(1.0, logits.abs().max().item())

section("causality: a position never sees the future")
with torch.inference_mode():
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % cfg.vocab_size  # change only the last token
    logits_changed = model(changed)
before = (logits_changed[:, :-1] - logits[:, :-1]).abs().max().item()
at_last = (logits_changed[:, -1] - logits[:, -1]).abs().max().item()
print(f"changing the last token moves earlier logits by {before:.1e} and the last position's by {at_last:.2f}")
assert before <= 1e-4 * max(1.0, logits.abs().max().item()) and at_last > 1e-3

section("parity with transformers' GPT2LMHeadModel")
try:
    import transformers
except ImportError:
    print("transformers is not installed: skipping the comparison (pip install -e \".[tutorials]\" to run it)")
else:
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    reference = transformers.GPT2LMHeadModel.from_pretrained(path).float().eval()
    with torch.inference_mode():
        expected = reference(ids).logits  # (B, T, V)
    diff = (logits - expected).abs().max().item()
    scale = max(1.0, expected.abs().max().item())
    # 1e-4 relative to the largest logit: float32 sums in a different order differ in the last
    # digits, and real GPT-2's logits are in the hundreds, the tiny random model's near 1.
    print(f"max |minfer - transformers| = {diff:.2e} (largest |logit| {expected.abs().max().item():.3g})")
    assert diff <= 1e-4 * scale
    assert torch.equal(logits[:, -1].argmax(-1), expected[:, -1].argmax(-1))

section("the greedy next token (token id, its text, its probability)")
# Only the last position's logits matter for what comes next; argmax is greedy decoding.
probs = logits[:, -1].softmax(-1)  # (B, V)
top = probs.topk(3, dim=-1)
for b in range(B):
    prompt = tokenizer.decode(ids[b].tolist())
    guesses = ", ".join(
        f"{t} {tokenizer.decode([t])!r} (p={p:.3f})" for p, t in zip(top.values[b].tolist(), top.indices[b].tolist())
    )
    print(f"{prompt!r} -> {guesses}")
    assert top.indices[b, 0].item() == logits[b, -1].argmax().item()
print("\nOK: shapes, the module-by-module forward, causality and the next token all check out.")
