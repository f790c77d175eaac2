"""The comparison's plots as PNG files (matplotlib, Agg backend: no display needed).

loss_vs_tokens.png   loss against cumulative trained tokens, every run overlaid
throughput.png       trained tokens/s per run (all devices, and per device)
memory.png           peak memory per run: measured beside the predicted components (when recorded)
"""

from __future__ import annotations

import math
from pathlib import Path

from finetune.compare.table import Table, loss_curve
from finetune.planning.plan_text import COLUMNS as COMPONENT_GROUPS

DPI = 110
# fp32 reduction-order differences between backends stay below this (tests/training/test_strategies.py)
LOSS_RTOL = 1e-5


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; works without a display (CI, SSH)
    import matplotlib.pyplot as plt

    return plt


def write_plots(table: Table, out_dir: Path) -> dict[str, Path]:
    """name -> PNG path, for every plot."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return {
        "loss": _save(loss_figure(table), out_dir / "loss_vs_tokens.png"),
        "throughput": _save(throughput_figure(table), out_dir / "throughput.png"),
        "memory": memory_plot(table, out_dir / "memory.png"),
    }


def _save(fig, path: Path, **how) -> Path:
    fig.savefig(path, dpi=DPI, **how)
    _pyplot().close(fig)
    return path


# The predicted components in the plan's groups (finetune/planning/plan_text.py COLUMNS): a legend of a
# few entries instead of one per component (14 in a five-strategy comparison).
GROUP_LABELS = {
    "params": "weights",
    "master": "master weights",
    "optim": "optimizer states",
    "grads": "gradients",
    "activ": "activations",
    "loss": "loss buffers",
}


def component_group(name: str) -> str:
    for group, names in COMPONENT_GROUPS:
        if name in names:
            return GROUP_LABELS[group]
    return "process base" if name == "process_base" else "other (batch, workspaces, ...)"


def grouped(components: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, gib in components.items():
        out[component_group(name)] = out.get(component_group(name), 0.0) + (gib or 0.0)
    return out


def _labels(table: Table) -> list[str]:
    return [row["run"] for row in table.rows]


def loss_figure(table: Table):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    missing, groups = [], []  # groups: [xs, ys, [labels]]
    for run, label in zip(table.runs, _labels(table)):
        xs, ys = loss_curve(run) if run.record is not None else ([], [])
        if not xs:
            missing.append(label)
            continue
        # Numerically equivalent strategies (same data, seed and batch) give the same curve; overlaid,
        # only the last would show. One line per distinct curve, its label naming every run on it.
        # Same = equal to LOSS_RTOL, the cross-strategy equivalence tolerance of tests/training/test_strategies.py.
        same = next(
            (g for g in groups if g[0] == xs and all(math.isclose(a, b, rel_tol=LOSS_RTOL) for a, b in zip(g[1], ys))),
            None,
        )
        if same and len(same[1]) == len(ys):
            same[2].append(label)
        else:
            groups.append([xs, ys, [label]])
    for xs, ys, labels in groups:
        ax.plot(
            xs, ys, marker="o", markersize=3, label=" = ".join(labels) + (" (same losses)" if len(labels) > 1 else "")
        )
    ax.set_xlabel("trained tokens (cumulative, all ranks; label positions != -100)")
    ax.set_ylabel("training loss (mean over each logging window)")
    ax.set_title("Loss against trained tokens")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    if missing:
        note = "no logged steps: " + ", ".join(missing)
        ax.text(0.01, 0.01, note, transform=ax.transAxes, fontsize=8, va="bottom", color="firebrick")
    fig.tight_layout()
    return fig


def throughput_figure(table: Table):
    plt = _pyplot()
    labels = _labels(table)
    total = [row["tokens_per_s"] or 0 for row in table.rows]
    per_device = [row["tokens_per_s_per_device"] or 0 for row in table.rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels)), 4.8))
    x = range(len(labels))
    width = 0.38
    bars = ax.bar([i - width / 2 for i in x], total, width, label="all devices")
    ax.bar([i + width / 2 for i in x], per_device, width, label="per device")
    for bar, row in zip(bars, table.rows):
        text = (
            "n/a"
            if row["tokens_per_s"] is None
            else (f"{row['speedup']:.2f}x" if row["speedup"] is not None else f"{row['tokens_per_s']:,.0f}")
        )
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("trained tokens / s")
    ax.set_title("Throughput" + (" (labels: speedup vs baseline)" if table.baseline is not None else ""))
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def memory_plot(table: Table, path: Path) -> Path:
    return _save(memory_figure(table), path, bbox_inches="tight")  # the legend sits outside the axes


def memory_figure(table: Table):
    """One panel per memory kind that any run recorded (device, host): for each run a bar of the
    measured peak and, when the record has a prediction, a stacked bar of its components."""
    plt = _pyplot()
    labels = _labels(table)
    kinds = [
        k
        for k, key in (("device", "device_peak_allocated_gib"), ("host", "host_peak_rss_gib"))
        if any(r.get("memory", "max", key) is not None for r in table.runs if r.record is not None)
    ]
    kinds = kinds or ["host"]
    fig, axes = plt.subplots(1, len(kinds), figsize=(max(6, 1.6 * len(labels)) * len(kinds), 4.8), squeeze=False)
    width = 0.38
    for ax, kind in zip(axes[0], kinds):
        key = "device_peak_allocated_gib" if kind == "device" else "host_peak_rss_gib"
        measured = [(r.get("memory", "max", key) if r.record is not None else None) for r in table.runs]
        x = list(range(len(labels)))
        label = "measured peak" + (" allocated" if kind == "device" else " RSS")
        # dimgray: no component has a grey
        ax.bar([i - width / 2 for i in x], [m or 0 for m in measured], width, color="dimgray", label=label)
        # tab10 without its blue (the other plots' first run) and its grey (7: the measured bar's)
        colors = iter(c for n, c in enumerate(plt.get_cmap("tab10").colors) if n not in (0, 7))
        component_colors: dict[str, tuple] = {}
        any_prediction = False
        for i, run in enumerate(table.runs):
            side = ((run.get("predicted_memory") if run.record is not None else None) or {}).get(kind) or {}
            bottom = 0.0
            for name, gib in grouped(side.get("components_gib") or {}).items():
                if not gib:
                    continue
                first = name not in component_colors  # one legend entry per component
                if first:
                    component_colors[name] = next(colors)
                label = f"predicted: {name}" if first else None
                ax.bar(i + width / 2, gib, width, bottom=bottom, color=component_colors[name], label=label)
                bottom += gib
                any_prediction = True
            if not side:
                ax.annotate(
                    "no prediction", (i + width / 2, 0), ha="center", va="bottom", fontsize=7, rotation=90, color="gray"
                )
        for i, m in enumerate(measured):
            if m is None:
                ax.annotate("n/a", (i - width / 2, 0), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, labels, rotation=20, ha="right", fontsize=8)
        ax.set_xlim(-0.6, len(labels) - 0.4)  # room for the last predicted bar (annotations outside are not drawn)
        ax.set_ylabel("GiB (2^30 bytes), max over ranks")
        ax.set_title(f"Peak {kind} memory" + ("" if any_prediction else " (no predictions recorded)"))
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)  # outside: never over a bar
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig
