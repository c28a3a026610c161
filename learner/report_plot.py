"""A hand-written SVG chart for ``rev88 evaluate``: per-draw accuracy, the mean
(with a ±1 sample-SD band), and the challenge's error bands drawn as the
accuracy each one requires (a 2 % error band is the line at 98 % accuracy).

No plotting library: the chart is a few dozen SVG elements whose coordinates
come from one linear scale (``Frame``), so tests can read them back and check
that every mark sits where its value says.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from xml.sax.saxutils import escape, quoteattr

WIDTH, HEIGHT = 760, 440
LEFT, RIGHT, TOP, BOTTOM = 70, 190, 70, 60  # margins; the right one holds the band labels
BAND_COLOURS = ("#1b7837", "#5aae61", "#2166ac", "#b2182b", "#8c510a")
LABEL_GAP = 13.0  # smallest vertical distance between two band labels, px


@dataclasses.dataclass(frozen=True)
class Frame:
    """The plot area and its scales: accuracy in percent -> y, draw index -> x."""

    lo: float  # accuracy (%) at the bottom edge
    hi: float  # accuracy (%) at the top edge
    count: int  # number of draws along x

    @property
    def left(self) -> float:
        return float(LEFT)

    @property
    def right(self) -> float:
        return float(WIDTH - RIGHT)

    @property
    def top(self) -> float:
        return float(TOP)

    @property
    def bottom(self) -> float:
        return float(HEIGHT - BOTTOM)

    def y(self, percent: float) -> float:
        return self.top + (self.hi - percent) / (self.hi - self.lo) * (self.bottom - self.top)

    def x(self, index: int) -> float:
        step = (self.right - self.left) / self.count
        return self.left + (index + 0.5) * step


def y_range(values: Sequence[float]) -> tuple[float, float]:
    """Whole-percent bounds with at least half a point of room around every value."""
    lo = math.floor(min(values) - 0.5)
    hi = math.ceil(max(values) + 0.5)
    lo, hi = max(lo, 0), min(hi, 100)
    if hi - lo < 2:
        hi = min(100, lo + 2)
        lo = hi - 2
    return float(lo), float(hi)


def tick_step(span: float) -> int:
    for step in (1, 2, 5, 10):
        if span / step <= 15:
            return step
    return 20


def spread_labels(ys: Sequence[float], gap: float = LABEL_GAP) -> list[float]:
    """Label positions near ``ys`` but at least ``gap`` apart (order kept)."""
    order = sorted(range(len(ys)), key=lambda i: ys[i])
    placed: dict[int, float] = {}
    last = -math.inf
    for i in order:
        placed[i] = max(ys[i], last + gap)
        last = placed[i]
    return [placed[i] for i in range(len(ys))]


def _fmt(v: float) -> str:
    return f"{v:.2f}"


def _text(x: float, y: float, body: str, **attrs: str) -> str:
    extra = "".join(f" {k.replace('_', '-')}={quoteattr(v)}" for k, v in attrs.items())
    return f'<text x="{_fmt(x)}" y="{_fmt(y)}"{extra}>{escape(body)}</text>'


def accuracy_svg(
    draws: Sequence[int],
    correct: Sequence[int],
    total: Sequence[int],
    mean_percent: float,
    sd_pp: float | None,
    bands: Sequence[int] = (2, 3, 5, 8, 12),
    met: Sequence[bool] | None = None,
    title: str = "rev88 per-draw accuracy",
) -> str:
    """The chart as SVG text. Accuracies are ``correct/total``; mean and SD in percent.

    ``met`` (one flag per band, decided by the caller's exact rule) adds "met" or
    "not met" to each band's label.
    """
    if not draws or not (len(draws) == len(correct) == len(total)):
        raise ValueError("accuracy_svg needs one correct/total pair per draw, and at least one draw")
    if met is not None and len(met) != len(bands):
        raise ValueError("accuracy_svg needs one met flag per band")
    acc = [100.0 * c / t for c, t in zip(correct, total)]
    thresholds = [100.0 - b for b in bands]
    lo, hi = y_range([*acc, *thresholds, mean_percent])
    frame = Frame(lo, hi, len(draws))
    parts: list[str] = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        _text(LEFT, 24, title, font_size="15", font_weight="bold"),
    ]
    # Legend under the title.
    ly = 46
    parts += [
        f'<circle cx="{LEFT + 6}" cy="{ly - 4}" r="4" fill="#222"/>',
        _text(LEFT + 16, ly, "draw accuracy"),
        f'<line x1="{LEFT + 120}" y1="{ly - 4}" x2="{LEFT + 150}" y2="{ly - 4}" stroke="#d6604d" stroke-width="2"/>',
        _text(LEFT + 156, ly, f"mean {mean_percent:.2f} %"),
    ]
    if sd_pp is not None:
        parts += [
            f'<rect x="{LEFT + 270}" y="{ly - 10}" width="30" height="12" fill="#d6604d" fill-opacity="0.15"/>',
            _text(LEFT + 306, ly, f"mean ± 1 SD ({sd_pp:.2f} pp)"),
        ]
    # Grid and y ticks.
    step = tick_step(hi - lo)
    tick = math.ceil(lo / step) * step
    while tick <= hi + 1e-9:
        y = frame.y(tick)
        parts.append(
            f'<line x1="{_fmt(frame.left)}" y1="{_fmt(y)}" x2="{_fmt(frame.right)}" y2="{_fmt(y)}" '
            'stroke="#e5e5e5" stroke-width="1"/>'
        )
        parts.append(_text(frame.left - 8, y + 4, f"{tick:g}", text_anchor="end"))
        tick += step
    # Mean ± SD band, clipped to the frame.
    if sd_pp is not None and sd_pp > 0:
        y1 = frame.y(min(hi, mean_percent + sd_pp))
        y2 = frame.y(max(lo, mean_percent - sd_pp))
        parts.append(
            f'<rect class="sd" x="{_fmt(frame.left)}" y="{_fmt(y1)}" width="{_fmt(frame.right - frame.left)}" '
            f'height="{_fmt(y2 - y1)}" fill="#d6604d" fill-opacity="0.15"/>'
        )
    # Error-band thresholds, as accuracy lines, labelled in the right margin.
    band_ys = [frame.y(t) for t in thresholds]
    verdicts = [("" if met is None else (": met" if ok else ": not met")) for ok in (met or bands)]
    for band, thr, y, ly_, colour, verdict in zip(
        bands, thresholds, band_ys, spread_labels(band_ys), BAND_COLOURS * 3, verdicts
    ):
        parts.append(
            f'<line class="band" data-band="{band}" data-accuracy="{thr:g}" x1="{_fmt(frame.left)}" '
            f'y1="{_fmt(y)}" x2="{_fmt(frame.right)}" y2="{_fmt(y)}" stroke="{colour}" '
            'stroke-width="1.5" stroke-dasharray="6 4"/>'
        )
        parts.append(_text(frame.right + 8, ly_ + 4, f"{band} % band: {thr:g} %{verdict}", fill=colour))
    # The mean.
    ym = frame.y(mean_percent)
    parts.append(
        f'<line id="mean" x1="{_fmt(frame.left)}" y1="{_fmt(ym)}" x2="{_fmt(frame.right)}" y2="{_fmt(ym)}" '
        'stroke="#d6604d" stroke-width="2"/>'
    )
    # Points, x labels.
    for i, (k, c, t, a) in enumerate(zip(draws, correct, total, acc)):
        x, y = frame.x(i), frame.y(a)
        parts.append(
            f'<circle class="draw" data-draw="{k}" cx="{_fmt(x)}" cy="{_fmt(y)}" r="4" fill="#222">'
            f"<title>{escape(f'draw {k}: {c:,} / {t:,} = {a:.2f} %')}</title></circle>"
        )
        parts.append(_text(x, frame.bottom + 18, str(k), text_anchor="middle"))
    # Axes and titles.
    parts += [
        f'<rect x="{_fmt(frame.left)}" y="{_fmt(frame.top)}" width="{_fmt(frame.right - frame.left)}" '
        f'height="{_fmt(frame.bottom - frame.top)}" fill="none" stroke="#444"/>',
        _text(
            (frame.left + frame.right) / 2,
            HEIGHT - 16,
            "draw k (dataset seed 2026091400 + k)",
            text_anchor="middle",
        ),
        _text(
            18,
            (frame.top + frame.bottom) / 2,
            "accuracy (%)",
            text_anchor="middle",
            transform=f"rotate(-90 18 {_fmt((frame.top + frame.bottom) / 2)})",
        ),
        "</svg>",
    ]
    return "\n".join(parts) + "\n"
