"""Weights & Biases, when `logging.report_to` includes wandb (rank 0): online, or offline into the run
directory (README.md "W&B keys" says when, and what goes where). Each log window reaches W&B through
transformers' WandbCallback, which finds our run.
"""

from __future__ import annotations

import logging
import netrc
import os
from pathlib import Path

from finetune.telemetry.record import RecordView

log = logging.getLogger(__name__)

# wandb's init_timeout (s) when online, unless WANDB_INIT_TIMEOUT says otherwise: measured here (wandb
# 0.31), an unreachable server ends wandb.init after about init_timeout + 10 s (31 s with 20, 27 s with
# 15, 22 s with 10); wandb's own default is 90 (190 s seen).
INIT_TIMEOUT_S = 15


def enabled(report_to: list[str]) -> bool:
    return "wandb" in report_to


class WandB:
    """W&B as a sink of the run's record (finetune/telemetry/sinks.py): the run is started with the
    record's declared sections and closed with its summary and the run-record artifact. Each log
    window goes in through transformers' WandbCallback (report_to: wandb), which finds this run."""

    def __init__(self, project: str, run_dir: Path):
        self.project, self.run_dir, self.run = project, run_dir, None

    def start(self, record: RecordView) -> None:
        self.run = start(record, project=self.project, run_dir=self.run_dir)

    def close(self, record: RecordView, exit_code: int) -> None:
        if self.run is None:
            return
        if exit_code == 0:
            files = [self.run_dir / "run.json", self.run_dir / "config.yaml", *launch_config_files()]
            finish(self.run, record, files, stage_dir=self.run_dir / "wandb" / f"run-record-{self.run.id}")
        else:
            self.run.finish(exit_code=exit_code)


def has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        hosts = netrc.netrc().hosts
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
    return any("wandb" in host for host in hosts)


def configure_environment(project: str, run_dir: Path) -> str:
    """Set W&B's environment before Trainer builds its callbacks; returns the mode in use."""
    if not os.environ.get("WANDB_MODE") and not has_api_key():
        os.environ["WANDB_MODE"] = "offline"
        log.info("W&B: no API key configured, logging offline to %s/wandb (upload later with `wandb sync`)", run_dir)
    os.environ.setdefault("WANDB_PROJECT", project)
    os.environ.setdefault("WANDB_DIR", str(run_dir))
    os.environ.setdefault("WANDB_LOG_MODEL", "false")  # the model is in the run directory already
    return os.environ["WANDB_MODE"] if os.environ.get("WANDB_MODE") else "online"


def start(record: RecordView, *, project: str, run_dir: Path):
    import wandb

    strategy = record.get("strategy", default={})
    offload = f"offload:{strategy['offload']}" if strategy.get("offload") not in (None, "none") else None
    tags = [t for t in (strategy.get("name"), strategy.get("method"), offload) if t]
    arguments = dict(
        project=os.environ.get("WANDB_PROJECT", project),
        name=record.get("run_name"),
        group=record.get("recipe"),
        tags=tags,
        dir=str(run_dir),
        config={
            "finetune": {
                "recipe": record.get("recipe"),
                "batch": record.get("batch"),
                "lr": record.get("lr"),
                "strategy": strategy,
                "parameters": record.get("parameters"),
                "precision": record.get("precision"),
            },
            "precision": record.get("precision", "policy"),  # live values: finish() updates finetune.precision
            "effective_batch_size": record.get("batch", "effective"),
            "lr_applied": record.get("lr", "applied"),
            "lr_scaling": record.get("lr", "rule"),
        },
    )
    if os.environ.get("WANDB_MODE", "online") != "online":  # offline or disabled, as configured
        return wandb.init(**arguments)
    try:
        timeout = float(os.environ.get("WANDB_INIT_TIMEOUT", INIT_TIMEOUT_S))
        return wandb.init(**arguments, settings=wandb.Settings(init_timeout=timeout))
    except wandb.errors.Error as e:  # no network, a proxy, the server down: train on, log offline
        os.environ["WANDB_MODE"] = "offline"
        run = wandb.init(**arguments, mode="offline")
        log.warning(
            f"W&B: the server could not be reached ({type(e).__name__}: {str(e).splitlines()[0][:200]}); logging "
            f"offline to {run.settings.sync_dir} instead. Upload it later with `wandb sync {run.settings.sync_dir}`"
        )
        return run


def run_summary(record: RecordView) -> dict:
    """The whole run's figures, under `run/` and the path they have in run.json (`run/throughput/
    trained_tokens_per_s`): never the name of a per-window key, which W&B also keeps in the summary
    (its last value; transformers logs them as `train/<key>`). docs/usage.md "W&B keys" lists both."""
    summary = {}
    for key, value in record.get("memory", "max", default={}).items():
        if value is not None:
            summary[f"run/memory/max/{key}"] = value
    for section in ("throughput", "eval"):
        for key, value in record.get(section, default={}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                summary[f"run/{section}/{key}"] = value
    summary["run/status"] = record.get("summary", "status")
    return summary


def finish(run, record: RecordView, files: list[Path], *, stage_dir: Path, exit_code: int = 0) -> None:
    """Summary (peaks, throughput, eval), the run-record artifact, then close the run. The artifact's
    files are copied into `stage_dir` (inside the run directory) and added from there unchanged: W&B
    would otherwise stage copies under ~/.local/share/wandb, outside the run directory, and a
    `wandb sync` of the run directory from another machine would lose them."""
    import shutil

    import wandb

    run.summary.update(run_summary(record))
    # The precision section as read from the live objects at on_train_begin (start() had the declared part).
    run.config.update(
        {"finetune": {**dict(run.config.get("finetune") or {}), "precision": record.get("precision")}},
        allow_val_change=True,
    )
    artifact = wandb.Artifact(
        f"run-record-{run.id}",
        type="run-record",
        description=f"run.json, resolved recipe and launch configs of {record.get('run_name')}",
    )
    stage_dir.mkdir(parents=True, exist_ok=True)
    for path in files:
        if path.is_file():
            staged = stage_dir / path.name
            shutil.copy2(path, staged)
            artifact.add_file(str(staged), name=path.name, policy="immutable")  # never changed after this
    run.log_artifact(artifact)
    run.finish(exit_code=exit_code)


def launch_config_files() -> list[Path]:
    """The accelerate config and DeepSpeed JSON this process was launched with, when known."""
    out = []
    # FINETUNE_ACCELERATE_CONFIG is set by `finetune train`; accelerate exports the DeepSpeed file.
    for var in ("FINETUNE_ACCELERATE_CONFIG", "ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        value = os.environ.get(var)
        if value and Path(value).is_file():
            out.append(Path(value))
    return out
