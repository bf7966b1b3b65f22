"""The per-request pause rule (speculative/speculator.py): a request whose proposals keep failing
stops speculating for a cool-down that doubles, and a draft model's cost raises the bar it must clear."""

from dataclasses import dataclass, field

from minfer import SamplingParams
from minfer.speculative.speculator import FAIL_SHARE, FIRST_COOLDOWN, Speculator


@dataclass(eq=False)  # eq=False: hashable by identity, as the weak dictionaries need
class FakeSequence:
    """What the Speculator reads of a decoding Sequence: a repeating text, so n-grams always match."""

    token_ids: list[int] = field(default_factory=lambda: [1, 2, 3, 1, 2, 3, 1, 2])
    num_prompt_tokens: int = 4
    params: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=1000, seed=0))
    forks: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_computed_tokens(self) -> int:
        return self.num_tokens - 1

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def emit(self, n: int) -> None:
        self.token_ids += [self.token_ids[-3]] * n


class FakeDraft:
    """A proposer whose every proposal costs half a target forward."""

    cost_per_proposal = 0.5

    def propose(self, token_ids, k, key=None):
        return [0] * k


def verify_with_share(spec: Speculator, seq: FakeSequence, share: float, steps: int) -> list[bool]:
    """`steps` decode steps in which `share` of the proposals are kept: whether each step speculated."""
    speculated = []
    for _ in range(steps):
        draft = spec.propose(seq, budget=64, num_running=1)
        speculated.append(bool(draft))
        if draft:
            kept = round(share * len(draft))
            seq.emit(kept + 1)  # as the scheduler does: the tokens first, then the record
            spec.record(seq, len(draft), kept)
        else:
            seq.emit(1)
    return speculated


def test_failing_proposals_pause_a_request_for_a_doubling_cool_down():
    spec, seq = Speculator(4, 1, 3), FakeSequence()
    steps = verify_with_share(spec, seq, share=0.0, steps=60)
    first_pause = steps.index(False)
    assert all(steps[:first_pause]) and first_pause > 1  # a few chances first, from a hopeful average
    runs, current = [], 0  # lengths of the pauses, in steps (one token each while paused)
    for s in steps[first_pause:]:
        if s:
            if current:
                runs.append(current)
            current = 0
        else:
            current += 1
    assert runs[:2] == [FIRST_COOLDOWN, 2 * FIRST_COOLDOWN]


def test_proposals_kept_often_enough_never_pause():
    spec, seq = Speculator(4, 1, 3), FakeSequence()
    assert all(verify_with_share(spec, seq, share=0.25, steps=40))  # 1 of 4 kept: above FAIL_SHARE
    assert spec.fail_share == FAIL_SHARE


def test_a_draft_models_cost_raises_the_share_that_pays():
    """Half of the proposals kept pays for n-gram lookup, which costs nothing, but not for a draft whose
    proposals cost half a target forward each."""
    spec, seq = Speculator(4, None, None, draft=FakeDraft()), FakeSequence()
    assert spec.fail_share == FAIL_SHARE + 0.5
    steps = verify_with_share(spec, seq, share=0.5, steps=40)
    assert not all(steps)
    spec, seq = Speculator(4, None, None, draft=FakeDraft()), FakeSequence()
    assert all(verify_with_share(spec, seq, share=0.75, steps=40))
