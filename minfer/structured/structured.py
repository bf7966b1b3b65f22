"""Structured outputs in the engine: which sequences hold a grammar, and what each step does to them.

The core calls a `Structured` at five lines (engine/features.py names them):
- `check`, where the engine checks a request once (the server's handler thread, or add_request): the
  constraint compiles (grammars.py), or InvalidParameter names it, which the server answers with a 400;
- `add`: each of a new request's sequences (n of them) gets a matcher of its own, a copy of the
  compiled grammar in its start state;
- `start`, as the runner lays a step out: the masks of the step's constrained rows begin filling, to be
  applied to the logits after the forward (masks.py). Only sequences that hold a matcher pay anything;
- `until_complete`, as a verification's tokens are recorded: they end at the one that completes the
  grammar. Plain decoding ends the request there; a verification may have accepted proposals past it
  (the completed grammar's end of sentence, which the mask allows), which plain decoding never draws;
- `advance`, after the step's tokens are recorded: each matcher takes its sequence's new tokens. A
  grammar that has completed (nothing but an end of sentence may follow) ends its request with "stop",
  whatever ignore_eos or min_tokens say. A token the matcher refuses can only come from a row that had
  nothing to draw (a grammar that dead-ends): the request ends with finish_reason "grammar_dead_end".

A matcher counts the output tokens it has taken, so a preempted sequence, recomputed, feeds it nothing
twice; a speculating sequence feeds it every token a verification kept, however many. Logprobs stay the
raw model's: scoring/ reads them before the mask. With speculative decoding, a constrained sequence's
proposals are checked against its grammar (each verify row gets the mask of the state its proposals
lead to), which the engine says once in its log.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from ..engine.sampling_params import SamplingParams
from ..engine.sequence import ScheduledChunk, Sequence
from ..text.tokenizer import Tokenizer
from .grammars import Grammars, import_llguidance
from .masks import MaskedRows, MaskFiller, StepMasks

log = logging.getLogger("minfer.structured")

DEAD_END = "grammar_dead_end"  # the finish_reason of a request whose grammar allowed nothing it could draw


@dataclass
class Held:
    """A sequence's matcher, and how many of its output tokens the matcher has taken."""

    matcher: object
    consumed: int = 0


class Structured:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, device: torch.device, speculating: bool = False):
        self.grammars = Grammars(tokenizer, vocab_size)
        self.masks = MaskFiller(vocab_size, device, tokenizer.eos_token_ids)
        self.live: weakref.WeakKeyDictionary[Sequence, Held] = weakref.WeakKeyDictionary()  # while they run
        self.speculating = speculating  # the engine verifies proposals: say once how constrained ones are
        self._said_how_proposals_are_checked = False

    def check(self, params: SamplingParams) -> None:
        """The request's constraint compiles (kept for add), else InvalidParameter naming structured_outputs."""
        self.grammars.compiled(params.structured_outputs)

    def add(self, seqs: list[Sequence]) -> None:
        """A new request's sequences, each with a matcher of its own."""
        for seq in seqs:
            self.live[seq] = Held(self.grammars.matcher(seq.params.structured_outputs))
        if self.speculating and not self._said_how_proposals_are_checked:
            self._said_how_proposals_are_checked = True
            log.info("structured outputs: the proposals of constrained requests are checked against their "
                     "grammar (each verify row is masked by the state its proposals lead to)")

    @property
    def stats(self) -> dict:
        """What the masks have cost (bench.py's report)."""
        return self.masks.stats.as_dict() | {"grammars_compiled": self.grammars.num_compiled}

    def start(self, chunks: list[ScheduledChunk]) -> StepMasks | None:
        """Start filling the masks of the step's constrained rows; None if the step has none. A sequence's
        rows are consecutive: its own state's, then one after each proposal it verifies (the chunk's last
        input ids)."""
        groups: list[MaskedRows] = []
        logit_row = mask_row = 0
        for chunk in chunks:
            rows = chunk.sampled_rows()
            i = 0
            while i < len(rows):
                seq = rows[i][1]
                n = next((j for j in range(i, len(rows)) if rows[j][1] is not seq), len(rows)) - i
                held = self.live.get(seq)
                if held is not None:
                    drafts = chunk.input_ids()[chunk.seq.num_tokens - chunk.start :][: n - 1]
                    groups.append(MaskedRows(seq, held.matcher, mask_row, drafts, logit_row + i))
                    mask_row += n
                i += n
            logit_row += len(rows)
        return self.masks.start(import_llguidance(), groups) if groups else None

    def until_complete(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """The tokens a sequence emits this step, up to the one that completes its grammar (all of them if
        none does). The matcher is left as it was: `advance` feeds it what the sequence kept."""
        held = self.live.get(seq)
        if held is None:
            return tokens
        matcher, taken = held.matcher, 0
        for token in tokens[:-1]:  # the last token ends the emission anyway
            if matcher.try_consume_tokens([token]) != 1:  # refused (a stop token it does not know): advance says
                break
            taken += 1
            if matcher.is_stopped():
                break
        stopped = matcher.is_stopped()
        matcher.rollback(taken)
        return tokens[:taken] if stopped else tokens

    def advance(self, chunks: list[ScheduledChunk]) -> list[tuple[Sequence, str]]:
        """Each matcher takes the tokens its sequence was given this step. Returns the sequences to end,
        each with its finish_reason: "stop" where the grammar completed, DEAD_END where it refused a token.
        Finished sequences let go of their matcher."""
        ended, seen = [], set()
        for chunk in chunks:
            for _, seq in chunk.sampled_rows():
                held = self.live.get(seq)
                if held is None or seq in seen:
                    continue
                seen.add(seq)
                new = seq.output_token_ids[held.consumed :]
                held.consumed += len(new)
                if seq.is_finished and new and new[-1] not in self.masks.end_ids and new[-1] in seq.stop_token_ids:
                    new = new[:-1]  # a stop token the grammar does not know (masks.py allowed it where it may end)
                if not held.matcher.consume_tokens(new):  # drawn where nothing was allowed (masks.py)
                    log.warning("request %s: its %s allowed no token it could draw (%s); it ends with "
                                "finish_reason %r", seq.request_id, seq.params.structured_outputs.kind,
                                held.matcher.get_error().splitlines()[0][:200], DEAD_END)
                    ended.append((seq, DEAD_END))
                elif held.matcher.is_stopped() and not seq.is_finished:
                    ended.append((seq, "stop"))  # complete: only an end of sentence could follow
                if seq.is_finished or (ended and ended[-1][0] is seq):
                    del self.live[seq]
        return ended
