"""What ``usp-eval`` writes: ``passkey.json`` + ``passkey.png`` (the length x depth heatmap)
and ``position_loss.json`` + ``position_loss.png`` (loss against position, one curve per
length), and the console's one line per length. Matplotlib's Agg backend (no display)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from .passkey import SCORING, accuracy_grid, cell_passes


def passkey_result(scores: list[dict], lengths: Sequence[int], depths: Sequence[float],
                   train_len: int | None, key_digits: int, step: int | None = None) -> dict:
    """passkey.json's content; ``step``: the optimizer step of the weights scored (None: a
    checkpoint of no run, or fresh weights)."""
    return {"lengths": list(lengths), "depths": list(depths),
            "accuracy": accuracy_grid(scores, lengths, depths), "scoring": SCORING,
            "key_digits": key_digits, "chance": 1.0 / (9 * 10 ** (key_digits - 1)),  # first digit not 0
            "train_length": train_len, "step": step, "cases": scores}


def passkey_title(result: dict) -> str:
    """The heatmap's title: the step scored, the cases a cell (passed / cases in each
    cell), the keys and chance."""
    per_cell = sorted({len(cell_passes(result["cases"], n, d))
                       for n in result["lengths"] for d in result["depths"]} - {0})
    cases = "-".join(str(n) for n in (per_cell[:1] + per_cell[-1:] if len(per_cell) > 1
                                      else per_cell))
    step = result.get("step")
    return (f"passkey retrieval{'' if step is None else f' at step {step}'}: {cases} cases a "
            f"cell, {result['key_digits']}-digit keys, chance {result['chance']:.3g}\n"
            "(cell: passed / cases, teacher-forced exact match)")


def passkey_metrics(result: dict) -> dict[str, float]:
    """The metrics of a passkey result, keyed as ``metrics.jsonl`` and wandb hold them:
    ``passkey_acc/<L>`` (the pass rate over every case of length L, all depths) and
    ``passkey_logprob/<L>`` (their mean key log-likelihood per token), lengths in order."""
    out = {}
    for length in result["lengths"]:
        mine = [c for c in result["cases"] if c["length"] == length]
        out[f"passkey_acc/{length}"] = sum(c["passed"] for c in mine) / len(mine)
        out[f"passkey_logprob/{length}"] = sum(c["key_logprob"] for c in mine) / len(mine)
    return out


def passkey_lines(result: dict) -> list[str]:
    """One console line per length: accuracy over its depths and the mean key log-likelihood."""
    lines = []
    for length, row in zip(result["lengths"], result["accuracy"]):
        mine = [c for c in result["cases"] if c["length"] == length]
        lp = sum(c["key_logprob"] for c in mine) / len(mine)
        worst = min(zip(row, result["depths"]))
        lines.append(f"passkey L={length}: accuracy {sum(row) / len(row):.3f} over "
                     f"{len(row)} depths ({len(mine)} cases; lowest {worst[0]:.2f} at depth "
                     f"{worst[1]:g}), key log-likelihood {lp:.3f}/token")
    return lines


def position_lines(result: dict) -> list[str]:
    return [f"position loss L={length}: first bucket {row[0]:.3f}, last {row[-1]:.3f} "
            f"({len(row)} buckets)" for length, row in zip(result["lengths"], result["loss"])]


def write_json(path: Path, content: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(content, indent=1) + "\n")
    tmp.replace(path)


def _figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def cell_text(result: dict, i: int, j: int) -> str:
    """What heatmap cell (length i, depth j) says: passed / cases, as in passkey.json's
    accuracy (``2/4`` is 0.5), or ``-`` for a cell without cases."""
    mine = cell_passes(result["cases"], result["lengths"][i], result["depths"][j])
    return f"{sum(mine)}/{len(mine)}" if mine else "-"


def passkey_png(result: dict, path: Path) -> None:
    """The heatmap: depths across, lengths down, accuracy as colour (0..1, colour bar), each
    cell's passed / cases written in it (``cell_text``), the step, the cases a cell and chance
    in the title (``passkey_title``), the training length's row marked."""
    lengths, depths, acc = result["lengths"], result["depths"], result["accuracy"]
    fig = _figure(max(6.4, 2.8 + 0.55 * len(depths)), max(3.6, 1.8 + 0.5 * len(lengths)))
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(acc, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    fig.colorbar(im, ax=ax, label="accuracy")
    ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
    train = result.get("train_length")
    ax.set_yticks(range(len(lengths)), [f"{n}{' (train)' if n == train else ''}"
                                        for n in lengths])
    ax.set_xlabel("needle depth (0: start of the haystack, 1: end)")
    ax.set_ylabel("sequence length (tokens)")
    ax.set_title(passkey_title(result), fontsize=9)
    for i, row in enumerate(acc):
        for j, v in enumerate(row):
            ax.text(j, i, cell_text(result, i, j), ha="center", va="center", fontsize=9)
    if train in lengths:
        i = lengths.index(train)
        from matplotlib.patches import Rectangle

        ax.add_patch(Rectangle((-0.5, i - 0.5), len(depths), 1, fill=False, lw=2.0,
                               ec="black"))
    fig.tight_layout()
    fig.savefig(str(path))


def position_png(result: dict, path: Path, train_len: int | None) -> None:
    """Loss against position (bucket centres, tokens), one curve per length; the training
    length as a dashed line."""
    fig = _figure(6.4, 4.0)
    ax = fig.add_subplot(1, 1, 1)
    for length, row in zip(result["lengths"], result["loss"]):
        b = len(row)
        ax.plot([(i + 0.5) * length / b for i in range(b)], row, marker="o", ms=3,
                label=f"L={length}")
    if train_len:
        ax.axvline(train_len, color="grey", ls="--", lw=1, label=f"training length {train_len}")
    ax.set_xlabel("position in the window (tokens)")
    ax.set_ylabel("mean loss per token (nats)")
    ax.set_title(f"loss by position ({result['buckets']} buckets per length)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path))
