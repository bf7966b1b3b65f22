"""What the shipped models' tests read from their model cards (minfer/models/builtin/*/README.md)."""

import re
from pathlib import Path


def card_copy_figures(path: Path) -> tuple[float, float]:
    card = (path / "README.md").read_text(encoding="utf-8")
    forced, greedy = re.search(r"([\d.]+)% are the model's greedy choice .*?\swrites\s+([\d.]+)% of them", card,
                               re.DOTALL).groups()
    return float(forced) / 100, float(greedy) / 100
