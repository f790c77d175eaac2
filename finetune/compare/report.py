"""The comparison as text: a console table, a Markdown report and a self-contained HTML page
(plots embedded as base64 PNG data URIs, so the one file can be mailed or attached as is); and in
Weights & Biases, when the compared runs were logged there."""

from __future__ import annotations

import base64
import html
import os
from datetime import datetime, timezone
from pathlib import Path

from finetune.compare.table import Table
from finetune.telemetry import wandb_logging

# The pages' look, shared with `finetune doctor`'s page (finetune/doctor/report.py).
PAGE_STYLE = """body { font-family: system-ui, sans-serif; margin: 1.5em; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 6px; text-align: right; }
th { background: #f0f0f0; } td:first-child, td:nth-child(2), td:nth-child(3) { text-align: left; }
tr.baseline { background: #eef6ee; } tr.failed, tr.interrupted { background: #fbeaea; }
tr.running { background: #fff8e0; } .warning { color: #a00; } img { max-width: 100%; }
"""
# The comparison page's own rules on top: the headline table larger, its numbers right-aligned from the
# third column on, the full table scrolling sideways instead of widening the page.
COMPARE_STYLE = """body { max-width: 1600px; } th:first-child, th:nth-child(2) { text-align: left; }
table.headline { font-size: 15px; } table.headline td { padding: 5px 10px; }
table.headline td:nth-child(3) { text-align: right; } .scroll { overflow-x: auto; } .same { color: #333; }
"""
PLOT_TITLES = {
    "loss": "Loss against trained tokens",
    "throughput": "Trained tokens per second",
    "memory": "Peak memory: measured beside predicted",
}


CONSOLE_WIDTH = 120  # the console table's lines never exceed this (the run names are shortened first)


def console_table(table: Table) -> str:
    """The headline table (the values equal in every run said once above it) within CONSOLE_WIDTH
    columns, then its notes, each a whole line (a run's error is greppable as it was written); the full
    table is in report.md and report.html."""
    keys = list(table.headline)
    headers = [_headline_header(table, k) for k in keys]
    cells = [[table.headline_cell(i, k) for k in keys] for i in range(len(table.rows))]
    widths = [max(len(h), *(len(r[j]) for r in cells)) for j, h in enumerate(headers)]
    over = sum(widths) + 2 * (len(widths) - 1) - CONSOLE_WIDTH
    if over > 0:  # shorten the run names (then the strategies): the other cells are short numbers
        for j in (0, 1):
            cut = min(over, widths[j] - max(len(headers[j]), 12))
            if cut > 0:
                widths[j] -= cut
                over -= cut
                cells = [[_shorten(v, widths[j]) if n == j else v for n, v in enumerate(r)] for r in cells]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [*same_for_every_run(table), line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
    notes = _footnotes(table) + [f"n/a: {m}" for m in _missing_reasons(table, table.headline)]
    return "\n".join([line.rstrip() for line in out] + [""] + notes)


def _headline_header(table: Table, key: str) -> str:
    if key == "peak_gib":
        return {"device": "dev GiB", "host": "host GiB"}.get(_memory_basis(table), "peak GiB")
    return table.column(key).header


def _memory_basis(table: Table) -> str | None:
    bases = {row["memory_basis"] for row in table.rows if row.get("memory_basis")}
    if not bases:
        bases = {"device" if row["device_peak_gib"] is not None else "host" for row in table.rows}
    return bases.pop() if len(bases) == 1 else None


def _split_same(table: Table) -> tuple[list, list]:
    """(columns every run shares a value of, with it; columns no run has a value of)."""
    same = table.constant_columns()
    return [(c, text) for c, text in same if text != "n/a"], [c for c, text in same if text == "n/a"]


def same_for_every_run(table: Table) -> list[str]:
    """The console lines above the table: the values every run shares, and the columns no run has."""
    shared, missing = _split_same(table)
    return _wrap_items("same for every run: ", [f"{c.header} {text}" for c, text in shared]) + _wrap_items(
        "n/a for every run (why: report.md): ", [c.header for c in missing]
    )


def _wrap_items(head: str, items: list[str]) -> list[str]:
    """`head` and the items joined by "; ", wrapped between items (never inside one)."""
    if not items:
        return []
    lines, line = [], head
    for n, item in enumerate(items):
        piece = item + (";" if n < len(items) - 1 else "")
        if len(line) + len(piece) + 1 > CONSOLE_WIDTH and line.strip():
            lines.append(line.rstrip())
            line = "  "
        line += ("" if line.endswith((": ", "  ")) else " ") + piece
    return lines + [line.rstrip()]


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "~"


def _footnotes(table: Table) -> list[str]:
    lines = [f"baseline: {table.baseline.label + ' — ' if table.baseline else ''}{table.baseline_note}"]
    cost = "n/a, no --gpu-hour-price given"
    if table.gpu_hour_price is not None:
        cost = f"{table.gpu_hour_price} USD per device-hour x devices x training time (summary.train_s)"
    lines.append(f"cost per 1M trained tokens: {cost}")
    bases = {row["memory_basis"] for row in table.rows if row["memory_basis"]}
    basis = {"device": "peak device memory allocated (device)", "host": "host peak RSS (host)"}
    if bases:
        lines.append("memory ratio: " + " and ".join(basis[b] for b in sorted(bases)))
    for row in table.rows:
        if row.get("scaling_reference") and (row["devices"] or 0) > 1:
            lines.append(f"scaling efficiency of {row['run']}: against {row['scaling_reference']}")
            lines[-1] += _above_100(row["scaling_efficiency"])
    for row in table.rows:
        if row["error"]:
            lines.append(f"{row['run']} {row['status']}: {row['error']}")
    lines += [f"warning: {w}" for w in table.warnings]
    return lines


NOISE = 1.2  # scaling efficiency up to this: run-to-run noise of throughput on a shared machine


def _above_100(efficiency: float) -> str:
    """N devices cannot do more than N x one device's work of the same step: a little above 100% is noise, more is a
    reference that ran slower per device (another machine, a busier one, too few steps to measure)."""
    if efficiency <= 1:
        return ""
    if efficiency <= NOISE:
        return f"; {efficiency:.0%} is above 100%: within run-to-run noise"
    return (
        f"; {efficiency:.0%} is more than run-to-run noise above 100%: the reference was slower per device than this "
        "run (another or a busier machine, or too few steps measured), so the figure says little"
    )


def headline_titles(table: Table) -> list[str]:
    """The headline's column titles (Markdown, HTML): the memory basis is said in the titles."""
    basis = {"device": "device allocated", "host": "host RSS"}.get(_memory_basis(table), "device or host")
    titles = {
        "run": "run",
        "strategy": "strategy (offload)",
        "tokens_per_s": "trained tokens/s",
        "speedup": "speedup vs baseline",
        "peak_gib": f"peak memory per device, GiB ({basis})",
        "memory_ratio": "memory ratio vs baseline",
        "scaling_efficiency": "scaling efficiency",
        "cost_per_mtok": "$ per 1M trained tokens",
        "task_metric": _task_title(table),
        "comparable": "comparable",
    }
    return [titles[k] for k in table.headline]


def _task_title(table: Table) -> str:
    """'exact match (before)': the metric the runs measured, by its name."""
    metrics = {r.get("eval", "metric") for r in table.runs if r.record is not None and r.get("eval", "metric")}
    return (metrics.pop().replace("_", " ") if len(metrics) == 1 else "task metric") + " (before)"


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
    shared, missing_everywhere = _split_same(table)
    if shared:
        lines += ["**Same for every run:** " + "; ".join(f"{c.title}: {text}" for c, text in shared), ""]
    if missing_everywhere:
        lines += ["**n/a for every run** (why: below): " + "; ".join(c.title for c in missing_everywhere), ""]
    lines += _md_table(
        headline_titles(table), [[table.headline_cell(i, k) for k in table.headline] for i in range(len(table.rows))]
    )
    lines += ["", *[f"- {n}" for n in _footnotes(table) if not n.startswith("warning:")], ""]
    for name, path in plots.items():
        lines += [f"## {PLOT_TITLES[name]}", "", f"![{PLOT_TITLES[name]}]({_relative(path, out_dir)})", ""]
    lines += ["## All columns", ""]
    lines += _md_table([c.title for c in cols], [[table.cell(i, c.key) for c in cols] for i in range(len(table.rows))])
    lines += [""]
    missing = _missing_reasons(table)
    if missing:
        lines += ["Why some cells are n/a:", ""] + [f"- {m}" for m in missing] + [""]
    lines += ["Run records:", ""] + [f"- {r.label}: `{r.path}`" for r in table.runs] + [""]
    return "\n".join(lines)


def _md_table(titles: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    return out + ["| " + " | ".join(v.replace("|", "\\|") for v in row) + " |" for row in rows]


def _missing_reasons(table: Table, keys=None) -> list[str]:
    """Each distinct (column, reason) once, with the runs it applies to (of the columns `keys`, else all)."""
    titles = {c.key: c.title for c in table.columns if keys is None or c.key in keys}
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


def _html_rows(table: Table, keys: list[str], cell) -> str:
    esc = html.escape
    body = []
    for i, row in enumerate(table.rows):
        klass = "baseline" if table.baseline is not None and table.runs[i] is table.baseline else row["status"]
        cells = []
        for key in keys:
            why = table.notes[i].get(key) if row.get(key) is None else None
            title = f' title="{esc(why)}"' if why else ""
            cells.append(f"<td{title}>{esc(cell(i, key))}</td>")
        body.append(f'<tr class="{esc(klass)}">{"".join(cells)}</tr>')
    return "".join(body)


def html_page(table: Table, plots: dict[str, Path]) -> str:
    esc = html.escape
    cols = table.columns
    headline = "".join(f"<th>{esc(t)}</th>" for t in headline_titles(table))
    head = "".join(f"<th>{esc(c.title)}</th>" for c in cols)
    shared, missing_everywhere = _split_same(table)
    same_html = (
        '<p class="same"><b>Same for every run:</b> '
        + "; ".join(f"{esc(c.title)}: <b>{esc(text)}</b>" for c, text in shared)
        + "</p>"
        if shared
        else ""
    ) + (
        '<p class="same"><b>n/a for every run</b> (why: below): '
        + "; ".join(esc(c.title) for c in missing_everywhere)
        + "</p>"
        if missing_everywhere
        else ""
    )
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
{PAGE_STYLE}{COMPARE_STYLE}</style></head><body>
<h1>Run comparison</h1>
<p>{len(table.runs)} run record(s); generated {esc(datetime.now(timezone.utc).isoformat(timespec="seconds"))}
by <code>finetune compare</code>. Hover an n/a cell for the reason.</p>
{warnings}
{same_html}
<table class="headline"><thead><tr>{headline}</tr></thead><tbody>{_html_rows(table, list(table.headline), table.headline_cell)}</tbody></table>
<ul>{notes}</ul>
{"".join(figures)}
<h2>All columns</h2>
<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{_html_rows(table, [c.key for c in cols], table.cell)}</tbody></table></div>
{f"<p>Why some cells are n/a:</p><ul>{missing}</ul>" if missing else ""}
</body></html>
"""


def write_reports(table: Table, plots: dict[str, Path], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "report.md"
    md.write_text(markdown(table, plots, out_dir), encoding="utf-8")
    page = out_dir / "report.html"
    page.write_text(html_page(table, plots), encoding="utf-8")
    return {"markdown": md, "html": page}


# ---- W&B: one comparison run per (project, group) of the runs that logged there (docs/compare.md).


def wandb_groups(table: Table) -> dict[tuple[str, str], list[str]]:
    """(project, group) -> labels of the runs logged to W&B there."""
    out: dict[tuple[str, str], list[str]] = {}
    for run in table.runs:
        if run.record is None:
            continue
        logging_cfg = run.get("config", "logging", default={})
        if wandb_logging.enabled(logging_cfg.get("report_to") or []):
            key = (logging_cfg.get("wandb_project") or "finetune", run.get("recipe"))
            out.setdefault(key, []).append(run.label)
    return out


def log_comparison(table: Table, plots: dict[str, Path], out_dir: Path) -> list[str]:
    """Log into every group the runs were logged to; returns one line per W&B run created."""
    groups = wandb_groups(table)
    if not groups:
        return []
    import wandb

    saved = {k: v for k, v in os.environ.items() if k.startswith("WANDB_")}
    try:
        return _log_to_wandb(wandb, table, plots, out_dir, groups)
    finally:  # configure_environment sets WANDB_* for this process; a caller's later runs must not inherit them
        for key in [k for k in os.environ if k.startswith("WANDB_")]:
            del os.environ[key]
        os.environ.update(saved)


def _log_to_wandb(wandb, table: Table, plots: dict[str, Path], out_dir: Path, groups: dict) -> list[str]:
    mode = wandb_logging.configure_environment(next(iter(groups))[0], out_dir)
    columns = [c.title for c in table.columns]
    lines = []
    for (project, group), labels in groups.items():
        rows = [[_plain(table.rows[i][c.key]) for c in table.columns] for i in range(len(table.rows))]
        run = wandb.init(
            project=project,
            group=group,
            job_type="comparison",
            name=f"compare-{group}",
            dir=os.environ.get("WANDB_DIR", str(out_dir)),
            reinit="create_new",
            config={
                "compared_runs": [r.label for r in table.runs],
                "baseline": table.baseline.label if table.baseline else None,
                "gpu_hour_price": table.gpu_hour_price,
            },
        )
        run.log(
            {
                "comparison/table": wandb.Table(columns=columns, data=rows),
                **{f"comparison/{name}": wandb.Image(str(path)) for name, path in plots.items()},
            }
        )
        run.summary["comparison/warnings"] = table.warnings
        run.finish()
        lines.append(
            f"W&B ({mode}): comparison logged to project {project!r}, group {group!r} "
            f"(runs logged there: {', '.join(labels)})"
        )
    return lines


def _plain(value):
    """Table cells: numbers stay numbers (sortable in the UI); missing values are None."""
    return value if value is None or isinstance(value, (int, float, str)) else str(value)
