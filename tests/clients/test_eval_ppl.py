"""`minfer eval-ppl` against transformers: the perplexity Hugging Face's "perplexity of fixed-length models"
loop gives on the same checkpoint, written here on its own (windows of `window` tokens every `stride`, each
scoring the tokens no earlier one did), with the text tokenized as the HF guide does: with the BOS a
tokenizer adds. GPT-2, Qwen3 and Llama (whose tokenizer adds a BOS), fp32, texts shorter than a window,
exactly a window, and a stride no multiple of the length."""

import math

import pytest
import torch

from minfer.bench.perplexity import file_perplexity
from minfer.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXT = "Once upon a time, a small fox found a red kite in the tall grass and ran to show it to her friend. " * 3
ARCHS = {"tiny": "GPT2LMHeadModel", "qwen3-tiny": "Qwen3ForCausalLM", "llama-tiny": "LlamaForCausalLM"}


def hf_perplexity(model, ids: list[int], window: int, stride: int) -> tuple[float, int]:
    """(perplexity, tokens scored): token 0 has nothing before it; every other token once, in the first window
    that holds it, predicted by the logits one place before it."""
    nll, scored, done = 0.0, 0, 1
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        with torch.inference_mode():
            logprobs = model(torch.tensor([ids[begin:end]])).logits[0].float().log_softmax(-1)
        for t in range(max(done, begin + 1), end):
            nll -= logprobs[t - 1 - begin, ids[t]].item()
            scored += 1
        done = max(done, end)
        if end == len(ids):
            break
    return math.exp(nll / scored), scored


@pytest.mark.parametrize("preset", ARCHS)
def test_eval_ppl_is_transformers_perplexity_by_the_same_windows(preset, make_checkpoint, tmp_path):
    path = make_checkpoint(preset)
    tokenizer = Tokenizer.from_dir(path)
    model = getattr(transformers, ARCHS[preset]).from_pretrained(path, torch_dtype=torch.float32).eval()
    one_window = tokenizer.decode(tokenizer.encode(TEXT)[:20])
    for text, window, stride in [(TEXT[:30], 32, 16), (one_window, len(tokenizer.encode_prompt(one_window)), 7),
                                 (TEXT, 32, 7), (TEXT, 32, 31)]:
        (tmp_path / "text.txt").write_text(text, encoding="utf-8")
        ids = tokenizer.backend.encode(text).ids  # as HF's guide tokenizes it: with the tokenizer's own BOS
        ours, _, _ = file_perplexity(str(path), tmp_path / "text.txt", window=window, stride=stride)
        ref, scored = hf_perplexity(model, ids, window, stride)
        assert ours.tokens == scored == len(ids) - 1, (text, window, stride)
        assert abs(ours.perplexity - ref) <= 1e-5 * ref, (text, window, stride, ours.perplexity, ref)
