"""The draft-model proposer: a smaller model with the target's vocabulary proposes k tokens greedily.

Its KV cache is a second cache tensor on the target's blocks: the same number of blocks, the same block
size, read and written through the same block tables and slots (as vLLM v1's draft proposers do). So
the engine's block bookkeeping serves both caches: allocation, the rollback of rejected proposals
(their slots are written over later), freeing on preemption or finish, copy-on-write (both caches
copied). The draft computes its K/V lazily, only for sequences that speculate: a sequence that decodes
plainly (unseeded in a large batch, paused, prefilling) costs the draft nothing, and catches up when it
next speculates.

Which draft positions hold K/V. DraftProposer remembers, per sequence, what it last wrote; num_valid()
cuts that at the first position whose token the sequence did not keep (a rejected proposal). Take a
speculating sequence whose first c tokens the target has computed (num_computed_tokens = c); its last
token t_c is computed by neither.
- Forward 0 runs its positions v .. c, v = num_valid(seq): the ones the draft lacks (after a
  verification: 0 or 1 of them; at its first speculation, or after a preemption, all of them), then
  t_c, whose logits give d_0.
- Forward j = 1 .. k-1 runs d_{j-1} at position c+j; its argmax is d_j. So positions 0 .. c+k-1 now
  hold draft K/V; d_{k-1}'s (position c+k) is not written.
- The target verifies t_c, d_0 .. d_{k-1} at positions c .. c+k and keeps a proposals: it has then
  computed c' = c+1+a positions, c .. c+a holding t_c, d_0 .. d_{a-1}, exactly the tokens the draft ran
  there. So the valid prefix is min(c + k, c'): all of them if a <= k-1, all but c+k if a = k (forward 0
  runs it next time). Past it lie rejected proposals, written over when computed again; the target
  computes past them later (plain decodes), so the cut is at the first token that differs, not at c'.
- A preemption frees the blocks: the record counts for nothing once seq.num_preemptions has changed.
- A prefix-cache hit or a fork's shared blocks may hold draft K/V or not (the sequence that filled them
  may never have speculated): a sequence trusts only its own record, so it writes them again. That is
  harmless: a shared block holds the same tokens after the same prefix, so the same values.

The proposal is a point mass (the draft's argmax), so the acceptance rule of verify.py stays exact for
sampling too. Proposals are placeholders (PENDING) when the batcher schedules a step: it reserves k rows
and blocks for a sequence, and the draft fills every sequence's proposals with k forwards batched across
sequences just before the target's step runs (ModelRunner.execute).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..attention.kv_cache import KVCache, slot_of
from ..attention.backend import AttentionBackend, StepLayout
from ..attention.paged import PagedBatch
from ..engine.draw import greedy_tokens
from ..engine.sequence import ScheduledChunk, Sequence
from ..host_to_device import to_device
from ..models.registry import load_model
from .speculation import VerifyChunk

PENDING = -1  # a proposal the draft model fills in before the step runs


def load_draft_model(config, target: torch.nn.Module, context_len: int, weights=None) -> torch.nn.Module:
    """The checkpoint of config.speculative_model, in the target's device and dtype; a clear error if it
    cannot be a draft for `target` (another vocabulary, a shorter context). `weights`: the loader of
    quantized checkpoints, handed in (models/loader.py's WeightLoader), so that one loads as it was written."""
    path = config.speculative_model
    try:
        draft = load_model(path, device=target.device, dtype=target.dtype, weights=weights)
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
    """The draft model (prepared as the target is, but not quantized unless its checkpoint is), its KV cache
    (on the target's blocks) and attention backend."""

    def __init__(self, model: torch.nn.Module, attention: AttentionBackend, num_blocks: int, block_size: int,
                 target_config=None):
        self.model = model
        self.attention_backend = attention
        self.kv_cache = attention.new_cache(model.config, num_blocks, block_size, model.device, model.dtype)
        self.block_size = block_size
        self.device = model.device
        # One proposal costs one draft forward. Measured in target forwards, that is about layers over
        # layers on small models, whose forwards are mostly per-layer overhead; on large ones, where
        # bytes rule, the draft is cheaper still, so this errs towards pausing (speculator.py).
        self.cost_per_proposal = model.config.num_layers / target_config.num_layers if target_config else 0.0
        self._written: weakref.WeakKeyDictionary[Sequence, _Written] = weakref.WeakKeyDictionary()  # num_valid()

    @staticmethod
    def bytes_per_block(model: torch.nn.Module, block_size: int) -> int:
        return KVCache.bytes_per_block(model.config, block_size, model.dtype)

    def propose(self, token_ids: list[int], k: int, key: object | None = None) -> list[int]:
        """What the Speculator asks of a proposer: k placeholders, filled by run() before the step runs.
        (key names the sequence, as for the n-gram proposer; the draft's state lives in its cache.)"""
        return [PENDING] * k

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> None:
        """Before the target's step: the PENDING proposals of its speculating chunks. Forward 0 runs each
        one's positions the draft has not computed, up to its last token, and draws proposal 0; forward
        j > 0 runs one row per chunk with more than j proposals (proposal j - 1) and draws proposal j."""
        speculating = pending = [c for c in chunks if isinstance(c, VerifyChunk)]
        if not pending:
            return  # no draft work: the sequences that speculate later catch up then
        rows = _Rows()
        for c in pending:
            first = self.num_valid(c.seq)
            rows.add(c.seq.token_ids[first : c.start + 1], first, c.seq.block_table)
        _take_argmax(pending, 0, self._forward(rows))
        for j in range(1, max(len(c.draft) for c in pending)):
            pending = [c for c in pending if len(c.draft) > j]
            rows = _Rows()
            for c in pending:
                rows.add([c.draft[j - 1]], c.start + j, c.seq.block_table)
            _take_argmax(pending, j, self._forward(rows))
        for c in speculating:  # positions 0 .. c.start - 1 hold draft K/V; then t_c, d_0 .. d_{k-2}
            tail = [c.seq.token_ids[c.start], *c.draft[:-1]]
            self._written[c.seq] = _Written(c.start, tail, c.seq.num_preemptions)

    def num_valid(self, seq: Sequence) -> int:
        """How many of seq's first positions hold the draft's K/V of seq's own tokens: those the draft
        wrote, up to the first where seq's token is not the one it ran (a rejected proposal), and no
        further than the target has computed; 0 if the draft never ran for seq, or seq was preempted since
        (its blocks were freed)."""
        written = self._written.get(seq)
        if written is None or written.num_preemptions != seq.num_preemptions:
            return 0
        kept = seq.token_ids[written.start : written.start + len(written.tail)]
        same = next((i for i, (a, b) in enumerate(zip(kept, written.tail)) if a != b), len(kept))
        return min(written.start + same, seq.num_computed_tokens)

    def _forward(self, rows: _Rows) -> torch.Tensor:
        """The draft over `rows` (writing their K/V) -> (S, V) logits of their sampled rows."""
        n, s = len(rows.ids), len(rows.sample_rows)
        slots = [slot_of(t, p, self.block_size) for t, p in zip(rows.row_tables, rows.positions)]
        flat = to_device(rows.ids + rows.positions + slots + rows.sample_rows, self.device)
        ids_t, pos_t, slots_t, sample_t = flat.split([n, n, n, s])
        layout = StepLayout(
            slots_t, rows.starts, rows.lens, rows.context_lens, rows.tables, self.block_size, self.kv_cache.null_block
        )
        meta = self.attention_backend.build_metadata(layout)
        return self.model(ids_t, PagedBatch(pos_t, self.kv_cache, meta, sample_t))


@dataclass
class _Written:
    """What the draft last wrote for a sequence: every position before `start`, then `tail` from there."""

    start: int
    tail: list[int]
    num_preemptions: int  # the sequence's, then: a preemption since freed the blocks


class _Rows:
    """One draft forward's rows, flattened as ModelRunner.prepare does: each sequence's run of
    consecutive positions, its last row sampled."""

    def __init__(self):
        self.ids: list[int] = []
        self.positions: list[int] = []
        self.row_tables: list[list[int]] = []  # per row: its sequence's block table
        self.sample_rows: list[int] = []
        self.starts: list[int] = []  # per sequence, as StepLayout has them
        self.lens: list[int] = []
        self.context_lens: list[int] = []
        self.tables: list[list[int]] = []

    def add(self, ids: list[int], first: int, table: list[int]) -> None:
        """A sequence's tokens `ids` at positions first, first + 1, ...; its last row draws."""
        self.starts.append(len(self.ids))
        self.lens.append(len(ids))
        self.context_lens.append(first + len(ids))
        self.tables.append(table)
        self.ids += ids
        self.positions += range(first, first + len(ids))
        self.row_tables += [table] * len(ids)
        self.sample_rows.append(len(self.ids) - 1)


def _take_argmax(chunks: list[ScheduledChunk], j: int, logits: torch.Tensor) -> None:
    """Proposal j of each chunk: the argmax of its row of logits (len(chunks), V)."""
    if chunks:
        for chunk, token in zip(chunks, greedy_tokens(_with_logit_bias(logits, chunks)).tolist()):
            chunk.draft[j] = token


def _with_logit_bias(logits: torch.Tensor, chunks: list[ScheduledChunk]) -> torch.Tensor:
    """(n, V) draft logits with each request's logit_bias added: a proposal the bias forbids would only
    be rejected (any proposal is exact; a likelier one is accepted more often)."""
    entries = [(i, t, b) for i, c in enumerate(chunks) for t, b in (c.seq.params.logit_bias or {}).items()]
    if not entries:
        return logits
    rows, tokens, biases = zip(*entries)
    index = (to_device(rows, logits.device), to_device(tokens, logits.device))
    return logits.float().index_put(index, to_device(biases, logits.device, torch.float32), accumulate=True)
