"""A few SVG shapes, written by hand: enough for the tutorials' figures, with no drawing library.

Coordinates are pixels, rounded to one decimal so that the same state always draws the same file.
"""

from __future__ import annotations

from pathlib import Path
from xml.sax.saxutils import escape

FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
MONO = "DejaVu Sans Mono, Menlo, Consolas, monospace"

# One palette for every figure: a colour per sequence, and the states a block can be in.
SEQUENCE_COLOURS = ["#f4a259", "#5b8e7d", "#8cb369", "#bc4b51", "#7d5ba6", "#4f86c6"]
FREE = "#ffffff"
CACHED = "#d9d9d9"  # unreferenced, but holding a registered prefix
SHARED = "#1f3b73"  # held by more than one sequence
NULL = "#333333"  # the null block: never handed out, kept zeroed
INK = "#222222"
FAINT = "#888888"


def _n(value: float) -> str:
    return f"{round(value, 1):g}"


class Svg:
    def __init__(self, width: float, height: float, title: str):
        self.width, self.height, self.title = width, height, title
        self.items: list[str] = []

    def rect(self, x, y, w, h, fill=FREE, stroke=INK, width=1.0, rx=2.0, dash: str | None = None) -> None:
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        self.items.append(
            f'<rect x="{_n(x)}" y="{_n(y)}" width="{_n(w)}" height="{_n(h)}" rx="{_n(rx)}" '
            f'fill="{fill}" stroke="{stroke}" stroke-width="{_n(width)}"{extra}/>'
        )

    def text(self, x, y, s, size=12, anchor="start", fill=INK, bold=False, mono=False, italic=False) -> None:
        style = (' font-weight="bold"' if bold else "") + (' font-style="italic"' if italic else "")
        self.items.append(
            f'<text x="{_n(x)}" y="{_n(y)}" font-family="{MONO if mono else FONT}" font-size="{_n(size)}" '
            f'text-anchor="{anchor}" fill="{fill}"{style}>{escape(str(s))}</text>'
        )

    def line(self, x1, y1, x2, y2, stroke=INK, width=1.2, arrow=False, dash: str | None = None) -> None:
        extra = (' marker-end="url(#arrow)"' if arrow else "") + (f' stroke-dasharray="{dash}"' if dash else "")
        self.items.append(
            f'<line x1="{_n(x1)}" y1="{_n(y1)}" x2="{_n(x2)}" y2="{_n(y2)}" stroke="{stroke}" '
            f'stroke-width="{_n(width)}"{extra}/>'
        )

    def curve(self, x1, y1, x2, y2, bend=0.0, stroke=INK, width=1.2, arrow=True, dash: str | None = None) -> None:
        """A quadratic curve from (x1, y1) to (x2, y2), its middle pushed `bend` pixels sideways."""
        mx, my = (x1 + x2) / 2, (y1 + y2) / 2
        dx, dy = x2 - x1, y2 - y1
        length = max((dx * dx + dy * dy) ** 0.5, 1e-9)
        cx, cy = mx - dy / length * bend, my + dx / length * bend
        extra = (' marker-end="url(#arrow)"' if arrow else "") + (f' stroke-dasharray="{dash}"' if dash else "")
        self.items.append(
            f'<path d="M {_n(x1)} {_n(y1)} Q {_n(cx)} {_n(cy)} {_n(x2)} {_n(y2)}" fill="none" '
            f'stroke="{stroke}" stroke-width="{_n(width)}"{extra}/>'
        )

    def legend(self, x, y, entries: list[tuple[str, str]], size=11, gap=16) -> None:
        """A row of colour swatches with their labels, starting at (x, y)."""
        for colour, label in entries:
            self.rect(x, y - size + 1, size, size, fill=colour, rx=1)
            self.text(x + size + 4, y, label, size=size)
            x += size + 4 + 0.6 * size * len(label) + gap

    def render(self) -> str:
        head = (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{_n(self.width)}" height="{_n(self.height)}" '
            f'viewBox="0 0 {_n(self.width)} {_n(self.height)}" role="img" aria-label="{escape(self.title)}">\n'
            f"<title>{escape(self.title)}</title>\n"
            '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
            'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="context-stroke"/></marker></defs>\n'
            f'<rect width="100%" height="100%" fill="#ffffff"/>\n'
        )
        return head + "\n".join(self.items) + "\n</svg>\n"

    def save(self, path: Path) -> Path:
        path.write_text(self.render(), encoding="utf-8")
        return path
