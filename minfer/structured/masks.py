"""One step's token masks: computed while the forward runs, then applied to the constrained rows' logits.

A mask is a bitmask, one bit per token of the model's vocabulary: 32 tokens to an int32 word, token t
allowed if bit t % 32 of word t // 32 is set (llguidance's layout). Read as bytes (little-endian, as x86,
Arm and GPUs are), byte b holds tokens 8b .. 8b + 7: a 256-row table turns each byte into its 8 tokens'
entries, one index_select for the whole mask. A step's masks are the rows
(R, ceil(V / 32)) of a host buffer, one per sampled row of a constrained sequence:
- `MaskFiller.start` hands the step's matchers to llguidance on a thread of its own. llguidance runs
  without the GIL, in parallel over the sequences, so the masks fill while the model's forward runs
  (on a GPU the forward only queues kernels: the host is free anyway);
- `StepMasks.apply` waits for them, copies them to the logits' device and adds 0 or -inf to every token
  of those rows (one index_add_; a bool masked_fill_ took 3x as long on a CPU): before logit_bias,
  penalties, temperature, min_p, top-k and top-p, so each of those acts on what the grammar allows. Rows
  of unconstrained sequences are not touched.
A speculating sequence's verify rows each get the mask of the state its proposals lead to (llguidance
advances a matcher over the proposals and rolls it back); rows past a proposal the grammar refuses
allow everything: their tokens are thrown away with the rejected proposal.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from ..engine.sequence import Sequence
from ..host_to_device import to_device

ALL_ALLOWED = -1  # an int32 word with every bit set


def bit_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """(256, 8): byte b's bit j, token 8b + j. Made where it is used: a copy to a GPU would wait for it."""
    return (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1


def expand(bits: torch.Tensor, vocab_size: int, table: torch.Tensor) -> torch.Tensor:
    """bits (R, W) int32 -> (R, vocab_size): each token's entry of `table` (256, 8), by its byte and bit."""
    R = bits.shape[0]
    return table.index_select(0, bits.view(torch.uint8).flatten().int()).view(R, -1)[:, :vocab_size]


def unpack(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bits (R, W) int32 -> allowed (R, vocab_size) bool."""
    return expand(bits, vocab_size, bit_table(bits.device).bool())


def bias_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(256, 8) of `dtype`: 0 for an allowed token, -inf for a forbidden one."""
    return torch.zeros(256, 8, dtype=dtype, device=device).masked_fill_(bit_table(device) == 0, float("-inf"))


@dataclass
class MaskStats:
    """What masks have cost since the engine started (bench.py reports it per constrained row)."""

    steps: int = 0
    rows: int = 0  # masks filled: one per sampled row of a constrained sequence
    fill_seconds: float = 0.0  # llguidance's work, on the mask thread
    wait_seconds: float = 0.0  # of it, what the step waited for after its forward
    apply_seconds: float = 0.0  # copying and applying the masks to the logits

    def as_dict(self) -> dict:
        per_row = lambda s: 1e6 * s / self.rows if self.rows else 0.0  # noqa: E731
        return {"steps": self.steps, "rows": self.rows, "fill_us_per_row": per_row(self.fill_seconds),
                "wait_us_per_row": per_row(self.wait_seconds), "apply_us_per_row": per_row(self.apply_seconds)}


@dataclass
class MaskedRows:
    """One constrained sequence's rows in a step: its matcher, its first mask row, the proposals its later
    rows follow, and its first row in the step's logits."""

    seq: Sequence
    matcher: object
    first: int
    drafts: list[int]
    logit_row: int

    @property
    def num_rows(self) -> int:
        return 1 + len(self.drafts)


class MaskFiller:
    def __init__(self, vocab_size: int, device: torch.device, end_ids: list[int] = ()):
        self.vocab_size = vocab_size
        self.end_ids = frozenset(end_ids)  # the ids llguidance knows as an end of sentence (the checkpoint's EOS)
        self.words = (vocab_size + 31) // 32
        self.device = device
        self.host = torch.empty(0, self.words, dtype=torch.int32)  # grown on demand; pinned on a GPU
        self.biases: dict[torch.dtype, torch.Tensor] = {}  # bias_table, by the logits' dtype
        self.stats = MaskStats()
        self._executor = self._thread = None
        self._job: Future | None = None  # the last step's fill

    def start(self, llg, groups: list[MaskedRows]) -> StepMasks:
        """Begin filling the masks of `groups` (on the mask thread); StepMasks.apply waits for them."""
        if self._thread is None:
            self._executor = llg.LLExecutor()  # llguidance's own threads, one sequence each at a time
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minfer-masks")
        if self._job is not None:  # a step that failed between start and apply may have left its fill running
            wait([self._job])
        num_rows = sum(g.num_rows for g in groups)
        if self.host.shape[0] < num_rows:
            pin = self.device.type == "cuda"
            rows = max(num_rows, 2 * self.host.shape[0])
            self.host = torch.empty(rows, self.words, dtype=torch.int32, pin_memory=pin)
        bits = self.host[:num_rows]  # (R, W)
        bits.fill_(ALL_ALLOWED)  # rows llguidance leaves alone (past a refused proposal) allow everything
        job = self._job = self._thread.submit(self._fill, [(g.matcher, g.first, g.drafts) for g in groups], bits)
        self.stats.steps += 1
        self.stats.rows += num_rows
        return StepMasks(self, groups, bits, job)

    def _fill(self, entries: list, bits: torch.Tensor) -> None:
        """Each matcher's masks into its rows of `bits` (R, W): its own state's, then one per proposal."""
        start = time.perf_counter()
        assert bits.is_contiguous() and bits.dtype == torch.int32
        where, size, num_rows = bits.data_ptr(), 4 * self.words, bits.shape[0]
        plain = [(matcher, row) for matcher, row, drafts in entries if not drafts]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, where, size, num_rows)
        verifying = [entry for entry in entries if entry[2]]
        if verifying:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(verifying, where, size, num_rows)
        self.stats.fill_seconds += time.perf_counter() - start


@dataclass
class StepMasks:
    filler: MaskFiller
    groups: list[MaskedRows]
    bits: torch.Tensor  # (R, W) on the host, being filled
    job: Future

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (S, V) of the step's sampled rows, with what each constrained row's grammar forbids at -inf."""
        filler, start = self.filler, time.perf_counter()
        self.job.result()  # the masks, if the forward did not outlast them
        waited = time.perf_counter()
        self._allow_stop_tokens_where_the_grammar_may_end()
        self._free_rows_with_nothing_to_draw()
        if logits.dtype not in filler.biases:
            filler.biases[logits.dtype] = bias_table(logits.dtype, logits.device)
        bits = to_device_bits(self.bits, logits.device)  # (R, W)
        bias = expand(bits, filler.vocab_size, filler.biases[logits.dtype])  # (R, V): 0 or -inf
        rows = [g.logit_row + j for g in self.groups for j in range(g.num_rows)]
        if len(rows) == logits.shape[0]:  # every sampled row is constrained (rows are in order)
            logits.add_(bias)
        else:
            logits.index_add_(0, to_device(rows, logits.device), bias)
        filler.stats.wait_seconds += waited - start
        filler.stats.apply_seconds += time.perf_counter() - waited
        return logits

    def _allow_stop_tokens_where_the_grammar_may_end(self) -> None:
        """A row whose grammar may end here (its mask allows an end of sentence) allows its sequence's other stop
        tokens too, which llguidance does not know: a chat template's end of turn that the checkpoint does not
        name as an end of sentence, a request's stop_token_ids. Masked, the reply could only run to max_tokens."""
        ends, vocab = self.filler.end_ids, self.filler.vocab_size
        by_byte = self.bits.view(torch.uint8)  # (R, 4W): token t is bit t % 8 of byte t // 8
        for g in self.groups:
            stops = [t for t in g.seq.stop_token_ids if t < vocab and t not in ends]
            for r in range(g.first, g.first + g.num_rows) if stops else ():
                if any(int(by_byte[r, e // 8]) >> (e % 8) & 1 for e in ends if e < vocab):
                    for t in stops:
                        by_byte[r, t // 8] |= 1 << (t % 8)

    def _free_rows_with_nothing_to_draw(self) -> None:
        """A row whose mask allows no token the request may draw (its grammar dead-ends, or allows only an
        end of sentence that min_tokens holds back) would be all -inf, which no sampler can draw from: it
        stays unmasked, and the token it draws, which its matcher refuses, ends the request (Structured.advance)."""
        nothing = ~self.bits.any(dim=1)  # (R,): rows without a single allowed token
        for g in self.groups:
            seq = g.seq
            if seq.params.min_tokens > seq.num_output_tokens and not nothing[g.first]:
                free = unpack(self.bits[g.first][None], self.filler.vocab_size)[0]  # (V,)
                free[[t for t in seq.min_tokens_stop_ids if t < free.shape[0]]] = False
                nothing[g.first] = not free.any()
        self.bits[nothing] = ALL_ALLOWED


def to_device_bits(bits: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The host bitmask on the logits' device: from pinned memory without a host sync on a GPU."""
    return bits if device.type == "cpu" else bits.to(device, non_blocking=True)
