"""The run directory, `runs/<run_name>/` by default (its files: docs/usage.md "Outputs"): created once, never silently
replaced (a directory left by a run that failed before its first step is reused, and the console says so), and written
by one run at a time (finetune/launch/run_lock.py: rank 0 locks it before changing it). Only a run directory is ever
emptied (--overwrite), and only of what a run writes (owned()); a folder finetune did not make (no MARKER) is refused,
nothing in it touched.
"""

from __future__ import annotations

import fnmatch
import shlex
import shutil
from datetime import datetime
from pathlib import Path

from finetune.errors import UserError
from finetune.launch import run_lock


def default_run_name(recipe: str) -> str:
    return f"{recipe}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def resolve_run_dir(name: str, output_dir: str | None) -> Path:
    return Path(output_dir) if output_dir else Path("runs") / name


def create(cfg, locks: run_lock.Locks, resumed: tuple[str, Path] | None = None) -> tuple[str, str]:
    """Rank 0: the run's name and directory, created and locked. A resumed run's directory (`resumed`,
    from the resume plan) is reused as it is; --resume=PATH may name a new one. A directory that
    cannot be written (read-only, full, forbidden) is a UserError naming it."""
    from finetune import storage

    try:
        return _create(cfg, locks, resumed)
    except OSError as e:
        name = cfg.run.name or default_run_name(cfg.recipe)
        path = resumed[1] if resumed else resolve_run_dir(name, cfg.run.output_dir)
        failure = storage.error(e, path, f"creating run directory {path}")
        if failure is None:
            raise
        raise failure from None


def lock_to_resume(cfg, locks: run_lock.Locks) -> None:
    """Rank 0, --resume: lock the run directory to be continued before its checkpoints are read."""
    path = resolve_run_dir(cfg.run.name or default_run_name(cfg.recipe), cfg.run.output_dir)
    if path.is_dir():
        locks.acquire(path)


def _create(cfg, locks: run_lock.Locks, resumed: tuple[str, Path] | None) -> tuple[str, str]:
    if resumed is not None:
        name, path = resumed  # a run directory already (resume_config checked it); a refused resume adds nothing
        locks.acquire(path)
        return name, str(path)
    name = cfg.run.name or default_run_name(cfg.recipe)
    path = resolve_run_dir(name, cfg.run.output_dir)
    if path.exists() and not path.is_dir():
        raise UserError(f"run directory {path} is a file, not a directory; give another --run.name or --run.output_dir")
    given_by = "--run.output_dir" if cfg.run.output_dir else "--run.name"
    if not is_run_dir(path) and not run_lock.live_run(path):  # before the lock: none in the user's folder
        refusal = problem(path, overwrite=cfg.run.overwrite, name_given_by=given_by)
        if refusal:
            raise UserError(refusal)
    locks.acquire(path)  # created if missing; a live run's directory is refused here, untouched
    prepare_run_dir(path, overwrite=cfg.run.overwrite, name_given_by=given_by, inputs=inputs(cfg))
    return name, str(path)


def inputs(cfg) -> list[tuple[str, str]]:
    """(setting, path) of every file or folder the run reads, for the check that --overwrite deletes none."""
    from finetune.config.sections import PATH_KEYS

    values = [(f"{s}.{k}", getattr(getattr(cfg, s), k)) for s, k in PATH_KEYS if (s, k) != ("run", "output_dir")]
    return [(key, value) for key, value in values if isinstance(value, str) and value]


# What a run that failed before its first step leaves behind (run.json, the resolved config, the
# demo data it generated, an interrupted atomic write): nothing a retry would lose.
LOG_FILE = "third_party.log"  # the ranks' third-party warnings (finetune/held_back.py to_log_file)
LEFT_BEFORE_FIRST_STEP = {"run.json", "config.yaml", "data", LOG_FILE}
ENDED = {"failed": "failed", "interrupted": "was interrupted", "running": "died"}
MARKER = ".finetune-run"  # written into every run directory finetune makes
# What a run writes at the top of its directory; --overwrite removes these and nothing else. `runs`
# is TensorBoard's (transformers: output_dir/runs/<date>_<host>), `wandb` W&B's (WANDB_DIR).
OWNED = (
    "run.json",
    "run.*.json",  # run.before-resume<n>.json, run.damaged<n>.json
    ".run.json.*",  # an interrupted atomic write (finetune/telemetry/sinks.py RunJson)
    "config.yaml",
    "config.resume*.yaml",
    "trainer_state.json",
    LOG_FILE,
    "checkpoint-*",
    "model",
    "export",  # `finetune export` (its default --out) and a failed one kept beside it
    "export.unverified*",
    ".export.partial-*",
    "data",
    "runs",
    "wandb",
)
DEMO_FILES = {"train.jsonl", "heldout.jsonl"}  # finetune/data/demo.py write_demo


def prepare_run_dir(
    path: Path, *, overwrite: bool, name_given_by: str = "--run.name", inputs: list[tuple[str, str]] = ()
) -> None:
    """Make the (locked) run directory ready and mark it. An existing non-empty one is an error unless
    overwrite, or unless it is what a run that failed before its first step left (reusable(): reused,
    said so); either way only what a run wrote is removed (owned()), anything else is kept and named."""
    refusal = problem(path, overwrite=overwrite, inputs=inputs, name_given_by=name_given_by)
    if refusal:
        raise UserError(refusal)
    if contents(path):
        why = None if overwrite else reusable(path)
        if why is not None:
            print(f"reusing run directory {path}: {why}", flush=True)
        kept = []
        for entry in contents(path):
            if not owned(entry):
                kept.append(entry.name)
            elif entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        if kept:
            print(f"kept in {path} (not written by finetune): {', '.join(sorted(kept))}", flush=True)
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER).touch()  # empty: it takes no space on a disk that is full


def contents(path: Path) -> list[Path]:
    """What a run directory holds besides its lock file and marker ([] when it does not exist)."""
    if not path.is_dir():
        return []
    return [p for p in path.iterdir() if p.name not in (run_lock.LOCK, MARKER)]


def is_run_dir(path: Path) -> bool:
    """Made by finetune: its marker, or (made before the marker existed) run.json and config.yaml."""
    return (path / MARKER).is_file() or ((path / "run.json").is_file() and (path / "config.yaml").is_file())


def owned(entry: Path) -> bool:
    """Whether a run wrote `entry` (a top-level entry of a run directory): its name is one a run
    writes, and data/ holds only the demo files, runs/ only TensorBoard event files."""
    if entry.is_symlink() or not any(fnmatch.fnmatchcase(entry.name, pattern) for pattern in OWNED):
        return False
    if entry.name == "data" and entry.is_dir():
        return {p.name for p in entry.iterdir()} <= DEMO_FILES
    if entry.name == "runs" and entry.is_dir():
        return all(p.is_dir() or p.name.startswith("events.out.tfevents.") for p in entry.rglob("*"))
    return True


def problem(
    path: Path, *, overwrite: bool, inputs: list[tuple[str, str]] = (), name_given_by: str = "--run.name"
) -> str | None:
    """Why `path` cannot be this new run's directory, or None; reads only. A folder finetune did not
    make is never one (nothing in it is touched); an existing run's is one with --overwrite (or when
    reusable()), unless --overwrite would delete a file this run reads."""
    held = contents(path)
    if not held:
        return None
    if not is_run_dir(path):
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in held)
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        return (
            f"run directory {path} ({path.resolve()}) already exists and is not one finetune made (no {MARKER}, "
            f"no run.json and config.yaml): it holds {shown}; nothing was changed, and --overwrite would not "
            f"empty it. A run needs a folder of its own: give --run.name=NAME (runs/NAME) or "
            f"--run.output_dir=<a new or empty folder>"
        )
    if not overwrite:
        return None if reusable(path) else exists_message(path, name_given_by)
    doomed = [entry.absolute() for entry in held if owned(entry)]
    for key, value in inputs:
        target = Path(value).expanduser().absolute()
        hit = next((d for d in doomed if target == d or d in target.parents), None)
        if hit is not None:
            return (
                f"--overwrite would delete {hit}, which holds {key} ({value}) that this run reads; nothing was "
                f"changed. Copy it elsewhere and point {key} there, or give another --run.name / --run.output_dir"
            )
    return None


def reusable(path: Path) -> str | None:
    """Why `path` can be reused by a new run, or None: it holds nothing but what a run that ended
    before its first step writes (no checkpoint, no model), and its run.json says so: failed or
    interrupted with no step, or `running` with no step, which only a run that died before it could
    record its end leaves (a live one holds the directory's lock and is refused before this)."""
    from finetune.storage import json_object

    names = {p.name for p in contents(path) if not p.name.startswith(".run.json.")}  # + interrupted writes
    if "run.json" not in names or not names <= LEFT_BEFORE_FIRST_STEP:
        return None
    record = json_object(path / "run.json")
    summary = record.get("summary")
    if (
        not isinstance(summary, dict)
        or summary.get("status") not in ("failed", "interrupted", "running")
        or summary.get("steps")
        or record.get("steps")
    ):
        return None
    return (
        f"its run {ENDED[summary['status']]} before its first step "
        f"({summary.get('error') or 'no error recorded'}) and left no checkpoint; its run.json, config.yaml and "
        f"data/ are replaced"
    )


def directory_problems(cfg) -> list[str]:
    """`finetune train` preflight: a named run directory a live run holds (finetune/launch/run_lock.py),
    or one that cannot be written (a read-only filesystem, no permission). A default name carries
    the time, so it is new, under runs/."""
    from finetune import storage

    path = resolve_run_dir(cfg.run.name or default_run_name(cfg.recipe), cfg.run.output_dir)
    live = run_lock.live_run(path) if (cfg.run.name or cfg.run.output_dir) else None
    if live:
        return [live]
    unwritable = storage.unwritable(path, "run directory")
    return [unwritable] if unwritable else []


def exists_message(path: Path, name_given_by: str = "--run.name") -> str:
    """The refusal for an existing run directory, with the commands that retry."""
    steps = [
        int(p.name.split("-", 1)[1])
        for p in (path.glob("checkpoint-*") if path.is_dir() else [])
        if p.is_dir() and p.name.split("-", 1)[1].isdigit()
    ]
    fresh = next(f"{path.name}-{n}" for n in range(2, 10_000) if not (path.parent / f"{path.name}-{n}").exists())
    other = shlex.quote(
        f"--run.name={fresh}" if name_given_by == "--run.name" else f"--run.output_dir={path.parent / fresh}"
    )
    lines = [
        f"run directory {path} already exists; nothing was changed. Retry with the same command and one of:",
        f"    {other}   (a new run directory)",
        f"    --overwrite   (deletes what the run wrote in {path} first: run.json, config.yaml, checkpoints, "
        f"model/, its demo data; nothing else)",
    ]
    if steps:  # --resume picks the newest complete one (finetune/checkpointing/checkpoints.py)
        lines.append(
            f"    --resume   (continues this run from its newest complete checkpoint, up to checkpoint-{max(steps)})"
        )
    return "\n".join(lines)


def save_resolved_config(path: Path, config: dict) -> Path:
    from finetune.config.recipe import dump_yaml

    out = path / "config.yaml"
    out.write_text(dump_yaml(config), encoding="utf-8")
    return out


def write_on_main(state, run_dir: Path, what: str, write) -> None:
    """Rank 0 writes a run file (`write()`); a full, read-only or forbidden disk is a StorageError on
    every rank (finetune/storage.py), so none waits for rank 0 in a later collective."""
    from finetune import storage
    from finetune.launch.peers import run_on_main

    def attempt():
        try:
            write()
        except OSError as e:
            failure = storage.error(e, run_dir, f"writing {what} in {run_dir}")
            if failure is None:
                raise
            raise failure from None

    run_on_main(state, attempt)
