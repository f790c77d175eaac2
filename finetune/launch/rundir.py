"""The run directory, `runs/<run_name>/` by default: created once, never silently replaced.

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


def prepare_run_dir(path: Path, *, overwrite: bool) -> None:
    """Create the run directory; an existing non-empty one is an error unless overwrite."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        if not overwrite:
            raise UserError(f"run directory {path} already exists; nothing was changed. Choose another "
                            f"--run.name, or pass --overwrite to replace it.")
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    path.mkdir(parents=True, exist_ok=True)


def save_resolved_config(path: Path, config: dict) -> Path:
    out = path / "config.yaml"
    out.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return out
