"""StepStats: what one engine step did, for benchmarks, traces, metrics and the engine event feed."""

from __future__ import annotations

from dataclasses import dataclass

from .sequence import ScheduledChunk


@dataclass
class StepStats:
    """What one step did, for benchmarks, traces and the engine event feed."""

    start: float  # time.perf_counter() when the step began
    end: float  # ... and when its tokens were sampled
    num_seqs: int
    num_decode_tokens: int
    num_prefill_tokens: int
    num_sampled: int  # tokens emitted (with speculative decoding, accepted proposals too)
    attended_pairs: int  # attention work: queries x the context each attends to
    cached_context_tokens: int  # context read from the cache (chunks that do not start at 0)
    num_preemptions: int
    kv_blocks_used: int
    num_draft_tokens: int = 0  # speculative/: proposals verified this step ...
    num_accepted_tokens: int = 0  # ... and accepted

    @classmethod
    def of(cls, chunks: list[ScheduledChunk], start: float, end: float, num_preemptions: int, kv_blocks_used: int):
        """A step's figures from its chunks; a feature adds its own counts (speculative/: accepted proposals)."""
        # Rows of one query each (a decode, a speculating sequence's verify rows) past the prompt are decode rows.
        decode_tokens = sum(
            c.num_rows for c in chunks if len(c.query_runs()) == c.num_rows and c.start >= c.seq.num_prompt_tokens
        )
        return cls(
            start=start,
            end=end,
            num_seqs=len(chunks),
            num_decode_tokens=decode_tokens,
            num_prefill_tokens=sum(c.num_rows for c in chunks) - decode_tokens,
            num_sampled=sum(len(c.samplers) for c in chunks),
            attended_pairs=sum(c.num_rows * (c.start + c.num_rows) for c in chunks),
            cached_context_tokens=sum(c.start + c.num_rows for c in chunks if c.start > 0),
            num_preemptions=num_preemptions,
            kv_blocks_used=kv_blocks_used,
        )
