"""The comparison in Weights & Biases, when the compared runs were logged there.

A run was logged to W&B when its resolved config has `wandb` in logging.report_to. Training runs
are grouped by recipe (finetune/telemetry/wandb_logging.py), so the comparison goes into that group: one
W&B run per (project, group) among those runs, job_type "comparison", holding the table as a
wandb.Table ("comparison/table") and each plot as a wandb.Image ("comparison/<plot>").
Offline without an API key, exactly like training runs (wandb_logging.configure_environment);
the files then lie in <out>/wandb and `wandb sync` uploads them.
"""

from __future__ import annotations

import os
from pathlib import Path

from finetune.compare.table import Table
from finetune.telemetry import wandb_logging


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
        return _log(wandb, table, plots, out_dir, groups)
    finally:  # configure_environment sets WANDB_* for this process; a caller's later runs must not inherit them
        for key in [k for k in os.environ if k.startswith("WANDB_")]:
            del os.environ[key]
        os.environ.update(saved)


def _log(wandb, table: Table, plots: dict[str, Path], out_dir: Path, groups: dict) -> list[str]:
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
