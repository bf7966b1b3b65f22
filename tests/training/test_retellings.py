"""minfer-tiny's training text retells some stories verbatim (stories.with_retellings), so the model learns
to copy from its context; the copy score (training/copying.py) measures that on bench's copy prompt."""

import pytest

from minfer.bench.workload import copy_prompt
from minfer.training.stories import stories, with_retellings
from minfer.training.train_tiny import TrainOptions


def originals_and_repeats(texts: list[str], mixed: list[str]) -> tuple[list[str], list[tuple[int, str]]]:
    """Split `mixed` back into the original stories, in order, and (index of the last original before it,
    text) for each repeat. Stories from the grammar rarely coincide, so a text equal to an original
    already seen and not the next original is a repeat."""
    kept, repeats, i = [], [], 0
    for text in mixed:
        if i < len(texts) and text == texts[i]:
            kept.append(text)
            i += 1
        else:
            repeats.append((i - 1, text))
    return kept, repeats


def test_retellings_are_verbatim_recent_and_seeded():
    texts = stories(3, 2000)
    assert len(set(texts)) == len(texts)  # so originals_and_repeats can tell them apart
    mixed = with_retellings(texts, 0.25, seed=0)
    kept, repeats = originals_and_repeats(texts, mixed)
    assert kept == texts  # every original, in order
    assert 0.22 * len(texts) < len(repeats) < 0.28 * len(texts)
    for last, text in repeats:  # each repeats, word for word, one of the last three stories told
        assert text in texts[max(0, last - 2) : last + 1], (last, text)
    backs = {last - texts.index(text) for last, text in repeats}
    assert backs == {0, 1, 2}  # right after, one story between (bench's copy prompt), and two between
    assert with_retellings(texts, 0.25, seed=0) == mixed
    assert with_retellings(texts, 0.25, seed=1) != mixed
    assert with_retellings(texts, 0.0, seed=0) == texts  # no retellings: the stream of old
    with pytest.raises(ValueError, match="fraction"):
        with_retellings(texts, 1.5, seed=0)


def test_the_trainer_retells_by_default_and_the_copy_prompt_is_benchs(tmp_path):
    from minfer.bench.workload import copy_texts

    assert 0.2 <= TrainOptions().retell <= 0.3
    texts = stories("heldout-0", 4)
    (tmp_path / "heldout.txt").write_text("".join(f"{t}<|endoftext|>\n" for t in texts), encoding="utf-8")
    assert copy_texts(tmp_path, 2) == [copy_prompt(texts[0], texts[1]), copy_prompt(texts[2], texts[3])]
