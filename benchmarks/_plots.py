"""What the plots of the docs' performance page share: their size and their text sizes.

The page shows each PNG scaled to the width of its content column: 46em, 736 CSS pixels
with furo's default font. A point of text in a figure ``WIDTH`` inches wide therefore
shows as ``page_px(1)`` = 1.39 pixels there, whatever resolution the PNG is saved at, and
``RC`` keeps every label at 13 pixels or more (the page's own text is 16). The PNG is
saved at ``DPI``, twice the column's pixels, so that it stays sharp on high-density
screens and when opened at full size. Every figure is drawn inside
``matplotlib.pyplot.rc_context(RC)`` (text takes its size when it is created) and written
by :func:`save`, which keeps the figure's width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from matplotlib.figure import Figure

#: the width of the page's content column, in CSS pixels (furo: 46em at 16 px)
PAGE_WIDTH_PX = 736
#: the width of every figure, in inches
WIDTH = 7.36
#: resolution of the PNG: 1,472 pixels wide, twice the column
DPI = 200
#: the least size of text on the page, in CSS pixels, once the PNG is scaled to the column
MIN_PAGE_PX = 11

#: matplotlib settings: the smallest text, 9.5 pt, shows as 13.2 px on the page
RC: dict[str, Any] = {
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "xtick.labelsize": 9.5,
    "ytick.labelsize": 9.5,
    "legend.fontsize": 9.5,
    "figure.titlesize": 11.5,
    "lines.linewidth": 1.8,
    "lines.markersize": 6.5,
}


def page_px(points: float, figure_width: float = WIDTH) -> float:
    """The size on the page, in CSS pixels, of ``points`` of text in a figure
    ``figure_width`` inches wide, shown at the content column's width."""
    return points * PAGE_WIDTH_PX / (figure_width * 72)


def save(fig: Figure, path: str | Path) -> None:
    """Write ``fig`` as a PNG at ``DPI`` and close it. The figure keeps its size (no tight
    bounding box, which would change its width and so the scale of its text on the page)."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=DPI)
    plt.close(fig)
