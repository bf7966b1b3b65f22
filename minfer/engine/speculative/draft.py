"""The draft-model proposer: a smaller model with the target's vocabulary proposes k tokens greedily.

Its KV cache is a second cache tensor on the target's blocks: the same number of blocks, the same block
size, read and written through the same block tables and slots (as vLLM v1's draft proposers do). So
whatever the engine does to blocks it does to both caches at once: allocation, the rollback of rejected
proposals (their slots are written over next step), preemption (freed, recomputed together), prefix-cache
hits (a cached block holds both models' K/V of the same tokens) and copy-on-write. That holds as long as
the draft computes K/V for every token the target does, so it follows every forward the target runs.

Which draft positions hold K/V, for a sequence of L tokens whose last one (t_{L-1}, the target's latest
sampled token) is not yet computed by either model (num_computed_tokens = L - 1):
1. before the step (propose): the draft cache holds positions 0 .. L-2, as the target's does (step 3
   of every earlier step put them there). Draft step j = 0 .. k-1 feeds one row per speculating
   sequence: t_{L-1} at position L-1, then d_0 at L, ..., d_{k-2} at L+k-2, writing their K/V into the
   slots the verify rows will take, and its argmax is d_j. d_{k-1}'s K/V is not written here.
2. the target verifies t_{L-1}, d_0 .. d_{k-1} at positions L-1 .. L+k-1 and keeps a of the proposals.
3. after the target's forward (follow): the draft runs the very rows the target ran (prefill chunks,
   decode rows, verify rows) with the same positions and slots, so its cache holds every position the
   target's holds: L-1 .. L+k-1 written again with the same tokens, d_{k-1} included. Positions
   L-1 .. L-1+a are now kept tokens; the slots past them hold rejected proposals, written over when
   those positions are next computed, by both models alike.
So at the next step's propose the draft again holds every position the target has computed.

The proposal is a point mass (the draft's argmax), so the acceptance rule of verify.py stays exact for
sampling too. Proposals are placeholders (PENDING) when the batcher schedules a step: it reserves k rows
and blocks for a sequence, and the draft fills every sequence's proposals with k batched forwards just
before the target's step runs (ModelRunner.execute).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ...attention.kv_cache import KVCache, slot_of
from ...attention.paged import PagedBatch, StepLayout
from ...models.registry import load_model
from ..prepare import prepare_model
from ..sequence import ScheduledChunk

PENDING = -1  # a proposal the draft model fills in before the step runs


def load_draft_model(config, target: torch.nn.Module, context_len: int) -> torch.nn.Module:
    """The checkpoint of config.speculative_model, in the target's device and dtype; a clear error if it
    cannot be a draft for `target` (another vocabulary, a shorter context)."""
    path = config.speculative_model
    try:
        draft = load_model(path, device=target.device, dtype=target.dtype)
    except (FileNotFoundError, OSError, ValueError) as e:
        raise ValueError(f"--speculative-model {path!r}: {e}") from None
    draft_vocab, target_vocab = draft.config.vocab_size, target.config.vocab_size
    if draft_vocab != target_vocab:
        raise ValueError(
            f"--speculative-model {path!r} has a vocabulary of {draft_vocab} tokens, the model {target_vocab}: "
            "a draft must share the target's tokenizer"
        )
    if draft.config.max_positions < context_len:
        raise ValueError(
            f"--speculative-model {path!r} has a context of {draft.config.max_positions} tokens, shorter than "
            f"the model's {context_len}: give --max-model-len {draft.config.max_positions} or less"
        )
    return draft


class DraftProposer:
    """The draft model, its KV cache (on the target's blocks) and attention backend."""

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, config=None):
        # Prepared as the target is, but unquantized: a draft is small already.
        attention = SimpleNamespace(
            enforce_eager=getattr(config, "enforce_eager", False), attention_backend=getattr(config, "attention_backend", None)
        )
        model, self.attention_backend = prepare_model(model, attention)
        self.model = model
        self.kv_cache = KVCache(model.config, num_blocks, block_size, model.device, model.dtype)
        self.block_size = block_size
        self.device = model.device

    @staticmethod
    def bytes_per_block(model: torch.nn.Module, block_size: int) -> int:
        return KVCache.bytes_per_block(model.config, block_size, model.dtype)

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """What the Speculator asks of a proposer: k placeholders, filled by fill() before the step runs."""
        return [PENDING] * k

    @torch.inference_mode()
    def fill(self, chunks: list[ScheduledChunk]) -> None:
        """Fill the PENDING proposals of the step's speculating chunks: forward j runs one row per chunk
        with more than j proposals (its last token, then its proposal j - 1) and takes the argmax."""
        pending = [c for c in chunks if c.draft and c.draft[0] == PENDING]
        for j in range(max((len(c.draft) for c in pending), default=0)):
            live = [c for c in pending if len(c.draft) > j]
            ids = [c.seq.token_ids[c.start] if j == 0 else c.draft[j - 1] for c in live]
            positions = [c.start + j for c in live]  # c.start: the sequence's last token's position
            tables = [c.seq.block_table for c in live]
            slots = [slot_of(t, p, self.block_size) for t, p in zip(tables, positions)]
            n = len(live)
            flat = torch.tensor(ids + positions + slots + list(range(n))).to(self.device)
            ids_t, pos_t, slots_t, rows_t = flat.split([n, n, n, n])
            layout = StepLayout(
                slots_t, list(range(n)), [1] * n, [p + 1 for p in positions], tables, self.block_size,
                self.kv_cache.null_block,
            )
            logits = _with_logit_bias(self._forward(ids_t, pos_t, layout, rows_t), live)  # (n, V)
            for chunk, token in zip(live, logits.argmax(dim=-1).tolist()):
                chunk.draft[j] = token

    @torch.inference_mode()
    def follow(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: StepLayout) -> None:
        """Run the rows the target just ran (input_ids, positions (N,), the step's layout), for their K/V
        only: no LM head."""
        self._forward(input_ids, positions, layout, positions[:0])

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, layout: StepLayout, rows: torch.Tensor):
        meta = self.attention_backend.build_metadata(layout)
        return self.model(ids, PagedBatch(positions, self.kv_cache, meta, rows))


def _with_logit_bias(logits: torch.Tensor, chunks: list[ScheduledChunk]) -> torch.Tensor:
    """(n, V) draft logits with each request's logit_bias added: a proposal the bias forbids would only
    be rejected (any proposal is exact; a likelier one is accepted more often)."""
    entries = [(i, t, b) for i, c in enumerate(chunks) for t, b in (c.seq.params.logit_bias or {}).items()]
    if not entries:
        return logits
    rows, tokens, biases = zip(*entries)
    index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
    return logits.float().index_put(index, torch.tensor(biases, device=logits.device), accumulate=True)
