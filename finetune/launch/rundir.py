"""The run directory, `runs/<run_name>/` by default: created once, never silently replaced (a
directory left by a run that failed before its first step is reused, and the console says so).

    runs/<name>/config.yaml     the resolved configuration (defaults < recipe < overrides)
    runs/<name>/run.json        the run record (finetune/telemetry/record.py)
    runs/<name>/data/           generated data (the demo recipe)
    runs/<name>/model/          the adapter (LoRA, QLoRA) or full model, with the tokenizer
    runs/<name>/checkpoint-*/   Trainer checkpoints, when training.save_strategy asks for them
"""

from __future__ import annotations

import shutil
from datetime import datetime
from pathlib import Path

import yaml

from finetune.errors import UserError


def default_run_name(recipe: str) -> str:
    return f"{recipe}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def resolve_run_dir(name: str, output_dir: str | None) -> Path:
    return Path(output_dir) if output_dir else Path("runs") / name


def create(cfg, resumed: tuple[str, Path] | None = None) -> tuple[str, str]:
    """Rank 0: the run's name and directory, created. A resumed run's directory (`resumed`, from the
    resume plan) is reused as it is; --resume=PATH may name a new one."""
    if resumed is not None:
        name, path = resumed
        path.mkdir(parents=True, exist_ok=True)
        return name, str(path)
    name = cfg.run.name or default_run_name(cfg.recipe)
    path = resolve_run_dir(name, cfg.run.output_dir)
    prepare_run_dir(
        path, overwrite=cfg.run.overwrite, name_given_by="--run.output_dir" if cfg.run.output_dir else "--run.name"
    )
    return name, str(path)


# What a run that failed before its first step leaves behind (run.json, the resolved config, the
# demo data it generated, an interrupted atomic write): nothing a retry would lose.
LEFT_BEFORE_FIRST_STEP = {"run.json", "config.yaml", "data"}


def prepare_run_dir(path: Path, *, overwrite: bool, name_given_by: str = "--run.name") -> None:
    """Create the run directory. An existing non-empty one is an error unless overwrite, or unless
    it is what a run that failed before its first step left (reusable(): reused, said so)."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        why = None if overwrite else reusable(path)
        if not overwrite and why is None:
            raise UserError(exists_message(path, name_given_by))
        if why is not None:
            print(f"reusing run directory {path}: {why}", flush=True)
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    path.mkdir(parents=True, exist_ok=True)


def reusable(path: Path) -> str | None:
    """Why `path` can be reused by a new run (its run.json says the run failed before step 1, and it
    holds nothing but what such a run writes: no checkpoint, no model), or None."""
    import json

    if not path.is_dir():
        return None
    names = {p.name for p in path.iterdir() if not p.name.startswith(".run.json.")}  # + interrupted writes
    if "run.json" not in names or not names <= LEFT_BEFORE_FIRST_STEP:
        return None
    try:
        record = json.loads((path / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    summary = record.get("summary") if isinstance(record, dict) else None
    if (
        not isinstance(summary, dict)
        or summary.get("status") != "failed"
        or summary.get("steps")
        or record.get("steps")
    ):
        return None
    return (
        f"its run failed before its first step ({summary.get('error') or 'no error recorded'}) and left no "
        f"checkpoint; its run.json, config.yaml and data/ are replaced"
    )


def exists_message(path: Path, name_given_by: str = "--run.name") -> str:
    """The refusal for an existing run directory, with the commands that retry."""
    steps = [
        int(p.name.split("-", 1)[1])
        for p in (path.glob("checkpoint-*") if path.is_dir() else [])
        if p.is_dir() and p.name.split("-", 1)[1].isdigit()
    ]
    fresh = next(f"{path.name}-{n}" for n in range(2, 10_000) if not (path.parent / f"{path.name}-{n}").exists())
    other = f"--run.name={fresh}" if name_given_by == "--run.name" else f"--run.output_dir={path.parent / fresh}"
    lines = [
        f"run directory {path} already exists; nothing was changed. Retry with the same command and one of:",
        f"    {other}   (a new run directory)",
        f"    --overwrite   (deletes {path} and everything in it first)",
    ]
    if steps:  # --resume picks the newest complete one (finetune/checkpointing/checkpoints.py)
        lines.append(
            f"    --resume   (continues this run from its newest complete checkpoint, up to checkpoint-{max(steps)})"
        )
    return "\n".join(lines)


def save_resolved_config(path: Path, config: dict) -> Path:
    out = path / "config.yaml"
    out.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return out
