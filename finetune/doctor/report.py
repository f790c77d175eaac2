"""The doctor's report: its lines (one per check: what was checked, what was found, and for a problem
its fix), and three ways to show them: the console text, doctor.json (docs/doctor.md has its fields)
and doctor.html, a self-contained page in the style of `finetune compare`'s report."""

from __future__ import annotations

import functools
import html
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from finetune.compare.report import PAGE_STYLE

OK, PROBLEM, SKIPPED = "ok", "problem", "skipped"


@dataclass
class Line:
    section: str  # environment | links | strategies
    name: str  # what was checked ("torch", "GPU 0", "zero2 losses", ...)
    status: str  # ok | problem | skipped
    detail: str  # what was found; for skipped, why
    fix: str | None = None  # one line, for a problem
    data: dict = field(default_factory=dict)  # the figures behind the line (doctor.json)

    def __post_init__(self):
        if self.status not in (OK, PROBLEM, SKIPPED):
            raise ValueError(f"status {self.status!r}: allowed ok, problem, skipped")
        if self.status == PROBLEM and not self.fix:
            raise ValueError(f"problem line {self.name!r} has no fix")


def ok(section: str, name: str, detail: str, /, **data) -> Line:
    return Line(section, name, OK, detail, data=data)


def problem(section: str, name: str, detail: str, fix: str, /, **data) -> Line:
    return Line(section, name, PROBLEM, detail, fix, data=data)


def skipped(section: str, name: str, why: str, /, **data) -> Line:
    return Line(section, name, SKIPPED, why, data=data)


class Section:
    """ok, problem and skipped with the section filled in."""

    def __init__(self, name: str):
        self.ok, self.problem, self.skipped = (functools.partial(f, name) for f in (ok, problem, skipped))


SCHEMA = 1
SECTIONS = ("environment", "links", "strategies")
TITLES = {"environment": "Environment", "links": "Links", "strategies": "Strategies"}
ROW_CLASS = {OK: "", PROBLEM: "failed", SKIPPED: "running"}  # compare's row colours
STRATEGY_HEADERS = (
    "strategy",
    "ranks",
    "engaged (read from the live run)",
    "precision",
    "loss step 1 -> last",
    "largest difference to single",
    "peak predicted / measured",
    "wall s",
)


def strategy_rows(report: dict) -> list[list[str]]:
    out = []
    for run in report["strategies"]["runs"]:
        losses = run.get("losses") or []
        cmp = run.get("comparison") or {}
        if run["name"] == report["strategies"].get("reference"):
            versus = "reference"
        elif cmp.get("max_loss_rel") is None:
            versus = "n/a"
        elif cmp.get("tolerance"):
            versus = f"{cmp['max_loss_rel']:.1e} (tol {cmp['tolerance']['loss']:g})"
        else:
            versus = f"{cmp['max_loss_rel']:.1e} (not judged)"
        out.append(
            [
                run["name"],
                str(run["world_size"]),
                run.get("engaged") or f"did not run (exit {run['returncode']})",
                run.get("precision") or "n/a",
                f"{losses[0]:.6f} -> {losses[-1]:.6f}" if losses else "n/a",
                versus,
                run.get("memory_text") or "n/a",
                f"{run['seconds']:.0f}",
            ]
        )
    return out


def _table(headers, rows, indent="  ") -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    out = [
        indent + "  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(),
        indent + "  ".join("-" * w for w in widths),
    ]
    return out + [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def console(report: dict, all_lines: list[Line]) -> str:
    width = max((len(line.name) for line in all_lines), default=10)
    out = [f"finetune doctor ({report['mode']}): {report['machine']}", ""]
    for section in SECTIONS:
        chosen = [line for line in all_lines if line.section == section]
        if section == "strategies":
            if not report.get("strategies"):
                continue
            s = report["strategies"]
            out.append(f"{TITLES[section]}: {s['description']}")
            if s["runs"]:
                out += _table(STRATEGY_HEADERS, strategy_rows(report))
            chosen = [line for line in chosen if line.status != OK]
        elif not chosen:
            continue
        else:
            out.append(TITLES[section])
        for line in chosen:
            out.append(f"  {line.status:8} {line.name.ljust(width)}  {line.detail}")
            if line.fix:
                out.append(f"  {'':8} {''.ljust(width)}  fix: {line.fix}")
        out.append("")
    out.append(verdict(report))
    return "\n".join(out)


def verdict(report: dict) -> str:
    counts = report["counts"]
    timing = ", ".join(f"{k} {v:.0f} s" for k, v in report["seconds"].items())
    if not report["problems"]:
        return f"all well: {counts[OK]} ok, {counts[SKIPPED]} skipped, no problem ({timing})"
    lines = [f"{len(report['problems'])} problem(s) ({counts[OK]} ok, {counts[SKIPPED]} skipped; {timing}):"]
    for p in report["problems"]:
        lines += [f"  - {p['section']} / {p['name']}: {p['detail']}", f"    fix: {p['fix']}"]
    return "\n".join(lines)


def build(
    mode: str,
    machine: str,
    all_lines: list[Line],
    strategies: dict | None,
    links: dict | None,
    seconds: dict,
    command: list[str],
) -> dict:
    counts = {status: sum(line.status == status for line in all_lines) for status in (OK, PROBLEM, SKIPPED)}
    return {
        "schema": SCHEMA,
        "mode": mode,
        "machine": machine,
        "command": command,
        "ok": counts[PROBLEM] == 0,
        "counts": counts,
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "lines": [asdict(line) for line in all_lines],
        "problems": [asdict(line) for line in all_lines if line.status == PROBLEM],
        "links": links,
        "strategies": strategies,
    }


def write(report: dict, all_lines: list[Line], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "doctor.json", "html": out_dir / "doctor.html"}
    for key, text in (("json", json.dumps(report, indent=2) + "\n"), ("html", page(report, all_lines))):
        tmp = paths[key].with_name(f".{paths[key].name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, paths[key])
    return paths


def page(report: dict, all_lines: list[Line]) -> str:
    esc = html.escape
    body = [
        f"<h1>finetune doctor</h1><p>{esc(report['machine'])}; mode {esc(report['mode'])}; "
        f"<code>{esc(' '.join(report['command']))}</code></p>",
        f'<p class="{"" if report["ok"] else "warning"}">{esc(verdict(report)).replace(chr(10), "<br>")}</p>',
    ]
    for section in SECTIONS:
        chosen = [line for line in all_lines if line.section == section]
        if section == "strategies" and report.get("strategies"):
            s = report["strategies"]
            body.append(f"<h2>{TITLES[section]}</h2><p>{esc(s['description'])}</p>")
            body.append(_html_table(STRATEGY_HEADERS, strategy_rows(report)))
            body.append(_loss_table(s))
        elif chosen:
            body.append(f"<h2>{TITLES[section]}</h2>")
        if chosen:
            body.append(
                _html_table(
                    ("status", "check", "found", "fix"),
                    [[x.status, x.name, x.detail, x.fix or ""] for x in chosen],
                    [ROW_CLASS[x.status] for x in chosen],
                    klass="lines",
                )
            )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>finetune doctor</title>
<style>
{PAGE_STYLE}table.lines td {{ text-align: left; }} h2 {{ margin-top: 1.2em; }}
</style></head><body>
{"".join(body)}
</body></html>
"""


def _html_table(headers, rows, classes=None, klass="") -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    trs = "".join(
        f'<tr class="{(classes or [""] * len(rows))[i]}">' + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>"
        for i, r in enumerate(rows)
    )
    return f'<table class="{klass}"><thead><tr>{head}</tr></thead><tbody>{trs}</tbody></table>'


def _loss_table(s: dict) -> str:
    runs = [r for r in s["runs"] if r.get("losses")]
    if not runs:
        return ""
    steps = max(len(r["losses"]) for r in runs)
    rows = [[r["name"], *(f"{x:.6f}" for x in r["losses"])] for r in runs]
    return "<p>Per-step losses</p>" + _html_table(("strategy", *(f"step {i + 1}" for i in range(steps))), rows)
