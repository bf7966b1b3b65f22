"""The copy warm-up (`--copy-warmup-steps`): before the stories, drill the model on rows that say a
run of random tokens twice, with its MLPs switched off, until it copies.

Copying a passage from the context (what n-gram speculative decoding needs) takes an induction
circuit: one head marks each token with the token before it, a later head looks for the current
token's earlier copy and reads what followed it. On the stories alone a model this small never
forms one: memorising the grammar's phrases lowers the loss sooner, and the MLPs learn to do that.
On random runs there is nothing to memorise, so only copying lowers the loss; with the MLPs off the
heads must do it. Once formed, the circuit survives the stories (docs/speculative.md: 81% of a
retold story copied greedily, against 2% without the warm-up, at the same held-out loss).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

ROWS, MIN_RUN, MAX_RUN = 32, 8, 30  # a drill batch: 32 rows, each a run of 8-30 tokens told twice
LOSS_WINDOW = 100  # steps the stopping rule averages over
COPYING_SHARE = 0.9  # stop once the loss has fallen 90% of the way from guessing to copying


def drill_batch(generator: torch.Generator, vocab_size: int, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (ROWS, 2 MAX_RUN): a run of random tokens (never <|endoftext|>) then the
    same run again from position 0, padded with <|endoftext|>; targets -1 on the padding (not scored)."""
    rows = torch.full((ROWS, 2 * MAX_RUN + 1), eos_id)
    targets = torch.full((ROWS, 2 * MAX_RUN + 1), -1)
    for r in range(ROWS):
        n = int(torch.randint(MIN_RUN, MAX_RUN + 1, (1,), generator=generator))
        run = torch.randint(0, vocab_size - 1, (n,), generator=generator)  # (n,), ids without eos_id...
        run += run >= eos_id  # ...wherever eos_id sits
        rows[r, : 2 * n] = targets[r, : 2 * n] = run.repeat(2)
    return rows[:, :-1], targets[:, 1:]


def losses_if(vocab_size: int) -> tuple[float, float]:
    """The drill's expected loss (nats per scored token) when guessing uniformly, and when copying
    perfectly: a row of run n scores 2n - 1 tokens, of which n cannot be foreseen (the first telling's
    last n - 1, and the retelling's first: nothing says where the run ends)."""
    guess = math.log(vocab_size - 1)
    runs = range(MIN_RUN, MAX_RUN + 1)
    return guess, guess * sum(runs) / sum(2 * n - 1 for n in runs)


def copy_warmup(model: nn.Module, optimizer: torch.optim.Optimizer, max_steps: int, lr: float, seed: int,
                vocab_size: int, eos_id: int, log: Callable[[str], None] = print) -> dict:
    """Drill until the mean loss of the last LOSS_WINDOW steps is COPYING_SHARE of the way to copying,
    at most `max_steps` steps; learning rate `lr` after a 100-step ramp. Returns the steps run and the
    final mean loss (the model card states them)."""
    if model.config.max_positions < 2 * MAX_RUN:
        raise ValueError(f"the copy warm-up's rows are {2 * MAX_RUN} tokens; the model's context is "
                         f"{model.config.max_positions}")
    guess, copying = losses_if(vocab_size)
    goal = guess - COPYING_SHARE * (guess - copying)
    generator = torch.Generator().manual_seed(seed)
    mlps = [m.mlp for m in model.modules() if hasattr(m, "mlp")]  # every block's
    hooks = [mlp.register_forward_hook(lambda module, args, out: torch.zeros_like(out)) for mlp in mlps]
    recent: list[float] = []
    try:
        for step in range(max_steps):
            inputs, targets = drill_batch(generator, vocab_size, eos_id)
            for group in optimizer.param_groups:
                group["lr"] = lr * min(1.0, (step + 1) / 100)
            logits = model(inputs)  # (ROWS, 2 MAX_RUN, V)
            loss = F.cross_entropy(logits.reshape(-1, vocab_size), targets.reshape(-1), ignore_index=-1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            recent = (recent + [loss.item()])[-LOSS_WINDOW:]
            mean = sum(recent) / len(recent)
            if (step + 1) % 250 == 0:
                log(f"copy warm-up {step + 1}/{max_steps}: drill loss {mean:.3f} (guessing {guess:.2f}, "
                    f"copying {copying:.2f}; stops below {goal:.2f})")
            if len(recent) == LOSS_WINDOW and mean < goal:
                break
    finally:
        for hook in hooks:
            hook.remove()
    steps = step + 1 if max_steps else 0
    final = sum(recent) / len(recent) if recent else float("nan")
    if max_steps and final >= goal:
        log(f"copy warm-up: {steps} steps, the limit, ended above the goal (drill loss {final:.3f}, "
            f"goal {goal:.2f}): copying is partial at best, and may not survive the stories")
    else:
        log(f"copy warm-up: copying after {steps} steps (drill loss {final:.3f})")
    return dict(steps=steps, drill_loss=final, guess_loss=guess, copying_loss=copying)
