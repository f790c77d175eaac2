"""The configuration a resumed run continues with: the one the run saved when it started (its config.yaml) with the
changes earlier resumes were allowed to make, not the recipe as it reads today (docs/faults.md "Resume"). Not
configuration changes: the run's name and directory (they find the run), and the per-device batch and accumulation,
which the resume plan sets (finetune/checkpointing/resume_plan.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from finetune.config.recipe import load_recipe, merge, parse_overrides
from finetune.config.validate import build_config
from finetune.errors import ConfigError, UserError

# keys that may differ on every resume without being a change of the run's configuration
NOT_CHANGES = tuple(
    "run.name run.output_dir run.overwrite training.per_device_train_batch_size training.gradient_accumulation_steps".split()
)


@dataclass
class ResumedConfig:
    cfg: object  # the Config this launch runs with
    saved: Path  # the configuration file it is based on
    changes: list[dict] = field(default_factory=list)  # [{key, was, now}] applied with --allow-config-change
    recipe_differs: list[str] = field(default_factory=list)  # keys where the recipe now reads otherwise (not used)
    allow_input_change: bool = False  # --allow-input-change (finetune/checkpointing/resume_plan.py compares inputs)


def of_command_line(argv: list[str] | None) -> tuple:
    """A run's command line read as the run reads it: (its options, its overrides, the configuration, the
    ResumedConfig of --resume or None). The recipe with its overrides, or with --resume the run's saved one."""
    from finetune.config import command_line

    args, overrides = command_line.parse_train_args(argv)
    if args.resume:  # the run's saved configuration, with any change the user allowed
        resumed = resolve(args.recipe, overrides, allow_change=args.allow_config_change, resume=args.resume)
        resumed.allow_input_change = args.allow_input_change
        return args, overrides, resumed.cfg, resumed
    if args.allow_config_change or args.allow_input_change:
        raise UserError("--allow-config-change and --allow-input-change apply to --resume only")
    cfg, _ = load_recipe(args.recipe, overrides)  # validated before anything heavy happens
    return args, overrides, cfg, None


def run_dir_of(recipe: str, overrides: list[str]) -> Path:
    """The run directory `--resume` continues: run.name / run.output_dir from the command line, else
    the recipe file's (resume_plan.locate finds the checkpoint in it). Nothing else of the recipe is
    read: the run's own configuration is what continues."""
    from finetune.config.recipe import find_recipe, read_recipe_file
    from finetune.launch import rundir

    given, _ = parse_overrides(list(overrides))
    run = {**(read_recipe_file(find_recipe(recipe)).get("run") or {}), **given.get("run", {})}
    if not run.get("name") and not run.get("output_dir"):
        raise UserError("--resume: name the run to continue with --run.name=NAME (runs/NAME) or --run.output_dir=DIR")
    return rundir.resolve_run_dir(run.get("name") or "", run.get("output_dir"))


def saved_values(run_dir: Path) -> tuple[dict, Path]:
    """The run's starting configuration with the changes earlier resumes recorded, and its file. With
    run.json damaged (those changes unknown), the newest resumed segment's config.resume<n>.yaml."""
    from finetune.checkpointing import resume
    from finetune.config.recipe import read_recipe_file

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise UserError(
            f"--resume: {run_dir} has no config.yaml, the configuration the run was started with; "
            f"is {run_dir} a run directory (run.name / run.output_dir)?"
        )
    record, damaged = resume.read_record(run_dir)
    if damaged:
        later = [p for p in run_dir.glob("config.resume*.yaml") if p.stem.removeprefix("config.resume").isdigit()]
        path = max(later, key=lambda p: int(p.stem.removeprefix("config.resume")), default=path)
        if os.environ.get("RANK", "0") == "0":
            print(
                f"warning: {damaged}. It is kept (renamed run.damaged<n>.json when the resumed run writes its record); "
                f"the run continues from its newest complete checkpoint with the configuration in {path}",
                file=sys.stderr,
                flush=True,
            )
    values = read_recipe_file(path)
    for segment in (record or {}).get("resumes") or []:
        for change in segment.get("config_changes") or []:
            section, key = change["key"].split(".", 1)
            values.setdefault(section, {})[key] = change["now"]
    return values, path


def resolve(recipe: str, overrides: list[str], *, allow_change: bool, resume: str = "auto") -> ResumedConfig:
    """The configuration of `--resume` (module docstring); ConfigError (exit 2) for differences
    that were not allowed, each with the saved and the given value; NothingToDo (exit 0) for a
    completed run that it would train no step of, unchanged (resume: "auto" or the --resume=PATH given)."""
    from finetune.checkpointing import resume as resuming
    from finetune.errors import NothingToDo
    from finetune.launch import rundir

    run_dir = run_dir_of(recipe, overrides)
    if run_dir.is_dir() and rundir.contents(run_dir) and not rundir.is_run_dir(run_dir):
        raise UserError(
            f"--resume: {run_dir} is not a run directory finetune made (no {rundir.MARKER}, no run.json and "
            f"config.yaml); nothing was changed. Name the run to continue with --run.name / --run.output_dir"
        )
    values, path = saved_values(run_dir)
    values.setdefault("run", {})["overwrite"] = False  # a start's --overwrite is not the resume's
    name = values.pop("recipe", None) or Path(recipe).stem
    source = f"{path} (the run's saved configuration)"
    saved = build_config(values, recipe=name, source=source).to_dict()
    given, _ = parse_overrides(list(overrides))
    changes = [
        {"key": f"{section}.{key}", "was": saved.get(section, {}).get(key), "now": now}
        for section, body in given.items()
        for key, now in body.items()
        if f"{section}.{key}" not in NOT_CHANGES and saved.get(section, {}).get(key) != now
    ]
    if changes and not allow_change:
        lines = [f"{c['key']}: {c['was']!r} in the run, {c['now']!r} given" for c in changes]
        raise ConfigError(
            lines
            + [
                f"a resume continues the run with the configuration it saved ({path}); drop these overrides to "
                f"continue it as it is, or add --allow-config-change to apply them (recorded in run.json resumes[])"
            ],
            f"--resume {run_dir}",
        )
    done = None if changes else resuming.finished(run_dir, resume)  # a change (more steps, say) trains again
    if done:
        raise NothingToDo(done)
    cfg = build_config(merge(values, given), recipe=name, source=f"{source} + command-line overrides")
    drift = []
    try:
        now, _ = load_recipe(recipe, overrides)
        drift = [c["key"] for c in _differences(cfg.to_dict(), now.to_dict())]
    except ConfigError:  # the recipe as it reads today need not be valid with these overrides: not used
        drift = ["(the recipe with these overrides is no valid configuration today)"]
    return ResumedConfig(cfg, path, changes, drift)


def _differences(before: dict, after: dict) -> list[dict]:
    out = []
    for section, body in after.items():
        if not isinstance(body, dict):
            continue
        old = before.get(section) or {}
        for key in dict.fromkeys([*old, *body]):
            dotted = f"{section}.{key}"
            if dotted in NOT_CHANGES:
                continue
            was, now = old.get(key), body.get(key)
            if json.dumps(was, sort_keys=True, default=str) != json.dumps(now, sort_keys=True, default=str):
                out.append({"key": dotted, "was": was, "now": now})
    return out


def said(resumed: ResumedConfig | None) -> dict:
    """Rank 0: what the resumed segment runs with, said; returned as the facts of its `resumes` entry."""
    log = logging.getLogger("finetune")
    if resumed is None:
        return {}
    if resumed.changes:
        log.warning(
            "resuming with configuration changes (--allow-config-change; recorded in run.json resumes[]): %s",
            "; ".join(f"{c['key']} {c['was']!r} -> {c['now']!r}" for c in resumed.changes),
        )
    if resumed.recipe_differs:
        differs = ", ".join(resumed.recipe_differs)
        log.info(
            f"the recipe now reads otherwise in {differs}; the run continues with its saved values ({resumed.saved})"
        )
    return {"config_from": str(resumed.saved), "config_changes": resumed.changes}
