"""Line plots for the dashboard, drawn with plotext (textual-plotext's widget).

Curves come decimated from rundata.Curve, so a plot never holds more than a few thousand points
however long the run; NaN points are left out of a line, not drawn as zeros.
"""

from __future__ import annotations

import math

from textual_plotext import PlotextPlot

# plotext's colour names, one per run in an overlay
COLORS = ["cyan", "orange", "green", "magenta", "red", "blue", "yellow", "white"]


def finite(xs, ys):
    """The points of (xs, ys) whose y is a finite number."""
    pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None and math.isfinite(y)]
    return [p[0] for p in pts], [p[1] for p in pts]


class Plot(PlotextPlot):
    """A plot redrawn from a list of series: (label, xs, ys, style[, color index]), style
    "line", "dim" or "points"; without a colour index each series takes the next colour."""

    def __init__(self, title: str = "", **kw):
        super().__init__(**kw)
        self.title = title
        self.series: list[tuple] = []
        self.x_label = "step"
        self.log_y = False
        """A logarithmic y axis (points at or below 0 are left out)."""

    def show(self, series, title: str | None = None, x_label: str | None = None) -> None:
        self.series = series
        if title is not None:
            self.title = title
        if x_label is not None:
            self.x_label = x_label
        self._draw()
        self.refresh()

    def on_resize(self) -> None:
        self._draw()

    def _draw(self) -> None:
        plt = self.plt
        plt.clear_figure()
        plt.title(self.title)
        plt.xlabel(self.x_label)
        drawn = False
        if self.log_y:
            plt.yscale("log")
        for i, (label, xs, ys, style, *rest) in enumerate(self.series):
            xs, ys = finite(xs, ys)
            if self.log_y:
                xs, ys = [x for x, y in zip(xs, ys, strict=True) if y > 0], [y for y in ys if y > 0]
            if not xs:
                continue
            drawn = True
            color = COLORS[(rest[0] if rest else i) % len(COLORS)]
            if style == "points":
                plt.scatter(xs, ys, label=label, marker="dot", color=color)
            elif style == "dim":
                plt.plot(xs, ys, label=label, marker="braille", color="gray")
            else:
                plt.plot(xs, ys, label=label, marker="braille", color=color)
        if not drawn:
            plt.text("no data yet", x=0.5, y=0.5, alignment="center")
            plt.xlim(0, 1)
            plt.ylim(0, 1)
