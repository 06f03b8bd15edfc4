"""Bar charts of benchmark results as PNG files (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def _figure(width: float):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, 3.6))
    return fig, fig.add_subplot()


def _save(fig, ax, path: Path, ylabel: str, title: str | None, legend: bool) -> None:
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=9)
    if legend:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def bar_png(path: Path, title: str, labels: Sequence[str], values: Sequence[float], ylabel: str,
            ref: Sequence[float] | None = None, ref_label: str | None = None) -> None:
    """One bar per label; ``ref``: a red tick per bar (e.g. a formula or a prediction)."""
    fig, ax = _figure(1.6 + 1.3 * len(labels))
    x = range(len(labels))
    ax.bar(x, values, color="tab:blue")
    if ref is not None:
        ax.plot(x, ref, "r_", markersize=30, mew=2, label=ref_label)
    ax.set_xticks(x, labels, fontsize=8, rotation=10)
    _save(fig, ax, path, ylabel, title, legend=ref is not None)


def grouped_bar_png(path: Path, labels: Sequence[str],
                    series: Sequence[tuple[str, Sequence[float]]], ylabel: str, *, title: str | None = None, xlabel: str | None = None,
                    hline: tuple[float, str] | None = None, width: float = 6.0,
                    tick_size: float | None = None) -> None:
    """Two bars per label, one per ``(name, values)`` in ``series``; ``hline`` = (y, label)."""
    if len(series) != 2:
        raise ValueError(f"grouped_bar_png draws 2 series side by side, got {len(series)}")
    fig, ax = _figure(width)
    x = range(len(labels))
    for off, (name, values) in zip((-0.2, 0.2), series):
        ax.bar([i + off for i in x], values, 0.4, label=name)
    if hline is not None:
        ax.axhline(hline[0], color="red", lw=1, ls="--", label=hline[1])
    ax.set_xticks(list(x), labels, fontsize=tick_size)
    if xlabel:
        ax.set_xlabel(xlabel)
    _save(fig, ax, path, ylabel, title, legend=True)
