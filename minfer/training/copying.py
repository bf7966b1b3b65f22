"""How well a trained model copies from its context: on `bench.py --workload copy`'s prompt (two held-out
stories, then the first one's opening sentence again: bench/workload.py's copy_prompt), the share of the
first story's remaining tokens it writes back verbatim. That share is what n-gram speculation (prompt
lookup) can win."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer
from torch import nn

from ..bench.workload import EOS, copy_prompt


@dataclass
class CopyScore:
    teacher_forced: float  # share of the retold story's tokens that are the model's argmax, given the true ones before
    greedy: float  # share of them greedy decoding writes before its first difference, over all stories


@torch.inference_mode()
def copy_accuracy(model: nn.Module, tokenizer: Tokenizer, stories: list[str], num: int = 20) -> CopyScore:
    """Copy accuracy on stories[0:2], stories[2:4], ... (the first `num` prompts that fit in the context),
    scored on the rest of the first story and its <|endoftext|>. One plain forward per prompt, without a
    cache: the model is tiny. NaN if no prompt fits."""
    was_training = model.training
    model.eval()
    forced = greedy = total = scored = 0
    for first, second in zip(stories[0::2], stories[1::2]):
        prompt = tokenizer.encode(copy_prompt(first, second)).ids
        full = tokenizer.encode(f"{first}{EOS}{second}{EOS}{first}{EOS}").ids
        assert full[: len(prompt)] == prompt, "the opening must end on a token boundary"
        if len(full) > model.config.max_positions:
            continue
        if scored == num:
            break
        scored += 1
        target = full[len(prompt) :]
        logits = model(torch.tensor([full[:-1]]))[0, len(prompt) - 1 :]  # (len(target), V)
        right = (logits.argmax(-1) == torch.tensor(target)).tolist()  # (len(target),) given the true tokens before
        forced += sum(right)
        # Greedy decoding feeds back its own tokens: while they are the target's, its inputs are the teacher-
        # forced ones, so it writes exactly the leading run of right guesses (causal attention: a position's
        # logits do not depend on what follows it).
        greedy += right.index(False) if False in right else len(right)
        total += len(target)
    model.train(was_training)
    if not total:
        return CopyScore(float("nan"), float("nan"))
    return CopyScore(teacher_forced=forced / total, greedy=greedy / total)
