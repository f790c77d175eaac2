"""The comparison as text: a console table, a Markdown report and a self-contained HTML page
(plots embedded as base64 PNG data URIs, so the one file can be mailed or attached as is)."""

from __future__ import annotations

import base64
import html
from datetime import datetime, timezone
from pathlib import Path

from finetune.compare.table import Table

# The pages' look, shared with `finetune doctor`'s page (finetune/doctor/report.py).
PAGE_STYLE = """body { font-family: system-ui, sans-serif; margin: 1.5em; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 6px; text-align: right; }
th { background: #f0f0f0; } td:first-child, td:nth-child(2), td:nth-child(3) { text-align: left; }
tr.baseline { background: #eef6ee; } tr.failed, tr.interrupted { background: #fbeaea; }
tr.running { background: #fff8e0; } .warning { color: #a00; } img { max-width: 100%; }
"""
PLOT_TITLES = {
    "loss": "Loss against trained tokens",
    "throughput": "Trained tokens per second",
    "memory": "Peak memory: measured beside predicted",
}


def console_table(table: Table) -> str:
    headers = [c.header for c in table.columns]
    cells = [[table.cell(i, c.key) for c in table.columns] for i in range(len(table.rows))]
    widths = [max(len(h), *(len(r[j]) for r in cells)) for j, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(out + [""] + _footnotes(table) + [f"n/a: {m}" for m in _missing_reasons(table)])


def _footnotes(table: Table) -> list[str]:
    lines = [f"baseline: {table.baseline.label + ' — ' if table.baseline else ''}{table.baseline_note}"]
    lines.append(
        "cost per 1M trained tokens: "
        + (
            f"{table.gpu_hour_price} USD per device-hour x devices x training time (summary.train_s)"
            if table.gpu_hour_price is not None
            else "n/a, no --gpu-hour-price given"
        )
    )
    bases = {row["memory_basis"] for row in table.rows if row["memory_basis"]}
    if bases:
        lines.append(
            "memory ratio: "
            + " and ".join(
                {"device": "peak device memory allocated (device)", "host": "host peak RSS (host)"}[b]
                for b in sorted(bases)
            )
        )
    for row in table.rows:
        if row.get("scaling_reference") and (row["devices"] or 0) > 1:
            lines.append(f"scaling efficiency of {row['run']}: against {row['scaling_reference']}")
    for row in table.rows:
        if row["error"]:
            lines.append(f"{row['run']} {row['status']}: {row['error']}")
    lines += [f"warning: {w}" for w in table.warnings]
    return lines


def markdown(table: Table, plots: dict[str, Path], out_dir: Path) -> str:
    cols = table.columns
    generated = datetime.now(timezone.utc).isoformat(timespec="seconds")
    lines = [
        "# Run comparison",
        "",
        f"Generated {generated} by `finetune compare` from {len(table.runs)} run record(s).",
        "",
    ]
    lines += [f"> **warning:** {w}" for w in table.warnings] + ([""] if table.warnings else [])
    lines += ["| " + " | ".join(c.title for c in cols) + " |", "|" + "---|" * len(cols)]
    for i in range(len(table.rows)):
        lines.append("| " + " | ".join(table.cell(i, c.key).replace("|", "\\|") for c in cols) + " |")
    lines += ["", *[f"- {n}" for n in _footnotes(table) if not n.startswith("warning:")], ""]
    missing = _missing_reasons(table)
    if missing:
        lines += ["Why some cells are n/a:", ""] + [f"- {m}" for m in missing] + [""]
    lines += ["Run records:", ""] + [f"- {r.label}: `{r.path}`" for r in table.runs] + [""]
    for name, path in plots.items():
        lines += [f"## {PLOT_TITLES[name]}", "", f"![{PLOT_TITLES[name]}]({_relative(path, out_dir)})", ""]
    return "\n".join(lines)


def _missing_reasons(table: Table) -> list[str]:
    """Each distinct (column, reason) once, with the runs it applies to."""
    titles = {c.key: c.title for c in table.columns}
    grouped: dict[tuple[str, str], list[str]] = {}
    for row, notes in zip(table.rows, table.notes):
        for key, reason in notes.items():
            if key in titles and row.get(key) is None:
                grouped.setdefault((titles[key], reason), []).append(row["run"])
    return [f"{title}: {reason} ({', '.join(runs)})" for (title, reason), runs in grouped.items()]


def _relative(path: Path, base: Path) -> str:
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path)


def html_page(table: Table, plots: dict[str, Path]) -> str:
    esc = html.escape
    cols = table.columns
    head = "".join(f"<th>{esc(c.title)}</th>" for c in cols)
    body = []
    for i, row in enumerate(table.rows):
        klass = "baseline" if table.baseline is not None and table.runs[i] is table.baseline else row["status"]
        cells = []
        for c in cols:
            why = table.notes[i].get(c.key) if row.get(c.key) is None else None
            title = f' title="{esc(why)}"' if why else ""
            cells.append(f"<td{title}>{esc(table.cell(i, c.key))}</td>")
        body.append(f'<tr class="{esc(klass)}">{"".join(cells)}</tr>')
    warnings = "".join(f'<p class="warning">warning: {esc(w)}</p>' for w in table.warnings)
    notes = "".join(f"<li>{esc(n)}</li>" for n in _footnotes(table) if not n.startswith("warning:"))
    missing = "".join(f"<li>{esc(m)}</li>" for m in _missing_reasons(table))
    figures = []
    for name, path in plots.items():
        data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
        figures.append(
            f'<h2>{esc(PLOT_TITLES[name])}</h2><img alt="{esc(PLOT_TITLES[name])}" src="data:image/png;base64,{data}">'
        )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>finetune: run comparison</title>
<style>
{PAGE_STYLE}</style></head><body>
<h1>Run comparison</h1>
<p>{len(table.runs)} run record(s); generated {esc(datetime.now(timezone.utc).isoformat(timespec="seconds"))}
by <code>finetune compare</code>. Hover an n/a cell for the reason.</p>
{warnings}
<table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>
<ul>{notes}</ul>
{f"<p>Why some cells are n/a:</p><ul>{missing}</ul>" if missing else ""}
{"".join(figures)}
</body></html>
"""


def write_reports(table: Table, plots: dict[str, Path], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "report.md"
    md.write_text(markdown(table, plots, out_dir), encoding="utf-8")
    page = out_dir / "report.html"
    page.write_text(html_page(table, plots), encoding="utf-8")
    return {"markdown": md, "html": page}
