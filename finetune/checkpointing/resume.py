"""`--resume`: continue a run in its own run directory, from a complete checkpoint (docs/faults.md
"Resume"). Trainer restores the states; this module keeps the run directory (nothing deleted) and
continues run.json: steps[] up to the checkpoint's step, one `resumes` segment per launch, the
schema-1 summary fields, and the command that resumes a preempted run.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

from finetune.checkpointing import checkpoints, provenance
from finetune.errors import UserError
from finetune.telemetry.record import RecordView, load


def read_record(run_dir: Path) -> tuple[dict | None, str | None]:
    """(run.json of `run_dir`, None), (None, None) when it has none, or (None, what is wrong with it)
    when it is damaged: cut short by a crash, not JSON, not an object."""
    path = Path(run_dir) / "run.json"
    try:
        record = load(path)
    except FileNotFoundError:
        return None, None
    except UnicodeDecodeError as e:
        return None, f"{path} is not UTF-8 text (byte {e.start})"
    except json.JSONDecodeError as e:
        return None, f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}; half-written?)"
    if not isinstance(record, dict):
        return None, f"{path} is not a run record (a JSON {type(record).__name__})"
    return record, None


def finished(run_dir: Path, resume: str = "auto") -> str | None:
    """What `--resume` says of a run that completed, or None: a resume that would train nothing changes
    nothing and exits 0 (docs/faults.md "Resume")."""
    record, _ = read_record(run_dir)
    summary = (record or {}).get("summary")
    if not isinstance(summary, dict) or summary.get("status") != "completed":
        return None
    step = checkpoints.step_of(Path(resume)) if resume != "auto" else None
    if step is None:  # the newest complete one, as --resume picks it (sizes only: this reads no data)
        whole = [c for c in checkpoints.checkpoints(run_dir) if checkpoints.problem(c, verify=False) is None]
        step = checkpoints.step_of(whole[-1]) if whole else None
    if step is not None and step < (summary.get("steps") or 0):
        return None
    return (
        f"--resume: the run in {run_dir} completed (step {summary.get('steps')}); there is nothing to resume and "
        f"nothing was changed. To train further, start a new run (another --run.name); to train it again from "
        f"an earlier checkpoint, name that one: --resume={run_dir}/checkpoint-N"
    )


def first_segment(view) -> list[dict]:
    """run.json `resumes` of a run that starts from scratch: [segment 0], from its strategy and batch."""
    return [{"step": 0, "from": None, "at": view.get("created"), **_layout(view)}]


def _layout(view) -> dict:
    return provenance.layout(view.get("strategy", default={}), view.get("batch", default={}))


def set_aside_newer(state, run_dir: Path, step: int) -> list[str]:
    """Checkpoints newer than the one resumed from, moved aside on rank 0 (a resumed run would save
    into them; checkpoints.move_aside_newer); their new names, on every rank."""
    from finetune.launch.peers import run_on_main

    return [new for _, new in run_on_main(state, lambda: checkpoints.move_aside_newer(run_dir, step))]


def noted(view, **fields) -> list[dict]:
    """run.json `resumes` with facts added to the current (last) segment (the universal conversion's time, ...)."""
    segments = list(view.get("resumes", default=[]))
    segments[-1] = {**segments[-1], **fields}
    return segments


def save_config(run_dir: Path, config: dict) -> Path:
    """The resumed run's resolved configuration, beside the original's config.yaml (kept)."""
    from finetune.config.recipe import dump_yaml

    n = 1
    while (run_dir / f"config.resume{n}.yaml").exists():
        n += 1
    out = run_dir / f"config.resume{n}.yaml"
    out.write_text(dump_yaml(config), encoding="utf-8")
    return out


HISTORY_KEYS = ("from", "step", "at", "previous_status", "steps_discarded")  # summary.resume_history entries
LAYOUT_KEYS = ("world_size", "strategy", "offload", "per_device", "grad_accum", "effective", "mesh")


def continued(run_dir: Path, ckpt: Path, plan=None, *, created: str | None = None) -> tuple[dict, dict]:
    """(sections, summary fields) that carry the earlier run.json into this launch's record and open
    its segment; `created`: this record's, kept when there is no earlier one. `plan`: the ResumePlan
    (finetune/checkpointing/resume_plan.py)."""
    step = _checkpoint_step(ckpt)
    record, _ = read_record(run_dir)  # a damaged one is set aside by keep_previous_record
    old = RecordView(record) if record is not None else None
    entry = {
        "step": step,
        "from": str(ckpt),
        "at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **dict.fromkeys(LAYOUT_KEYS),
        "previous_status": None,
        "steps_discarded": 0,
        "superseded": [],
    }
    if plan is not None:
        entry.update(effective=plan.effective_now, from_world_size=plan.written["world_size"])
        entry.update({k: getattr(plan, k) for k in (*LAYOUT_KEYS[:5], "reshard", "rng", "rng_ranks", "position")})
        entry["input_changes"] = plan.input_changes
    sections, segments = {}, []
    if old is not None:
        steps = old.get("steps", default=[])
        kept = [s for s in steps if s.get("step") is not None and s["step"] <= step]
        entry["previous_status"] = old.get("summary", "status")
        entry["steps_discarded"] = len(steps) - len(kept)
        sections = {"created": old.get("created", default=created), "steps": kept}
        segments = list(old.get("resumes", default=[])) or _migrated_segments(old)
    segments.append(entry)
    history = [{k: s.get(k) for k in HISTORY_KEYS} for s in segments if s.get("from")]
    summary = dict(
        resumed_from=str(ckpt), resumed_at_step=step, resumes=len(history), resume_history=history, steps=step
    )
    return {**sections, "resumes": segments}, summary


def keep_previous_record(run_dir: Path) -> Path | None:
    """run.json as it was before this resume, kept as run.before-resume<n>.json (a damaged one renamed
    run.damaged<n>.json; docs/faults.md "Resume"): a resume that fails later must not have lost the
    steps after the checkpoint. Rank 0, before the continued record is written."""
    import logging
    import shutil

    record = Path(run_dir) / "run.json"
    if not record.is_file():
        return None
    _, damaged = read_record(run_dir)
    kind = "damaged" if damaged else "before-resume"
    n = 1
    while (record.parent / f"run.{kind}{n}.json").exists():
        n += 1
    out = record.parent / f"run.{kind}{n}.json"
    if damaged:
        record.rename(out)
        logging.getLogger("finetune").warning("%s: kept as %s; the resumed run writes a new run.json", damaged, out)
    else:
        shutil.copy2(record, out)
    return out


def _migrated_segments(old: RecordView) -> list[dict]:
    """`resumes` for a record written before it existed: segment 0 and one per summary.resume_history
    entry; the world size and batch are known only for the last segment (the record's sections)."""
    history = list(old.get("summary", "resume_history", default=[]))
    unknown = dict.fromkeys(LAYOUT_KEYS)
    segments = [{"step": 0, "from": None, "at": old.get("created"), **unknown}]
    segments += [{**unknown, **{k: h.get(k) for k in HISTORY_KEYS}} for h in history]
    segments[-1].update(_layout(old))
    return segments


def _checkpoint_step(ckpt: Path) -> int:
    state = Path(ckpt) / "trainer_state.json"
    if state.is_file():
        return int(json.loads(state.read_text(encoding="utf-8"))["global_step"])
    step = checkpoints.step_of(ckpt)
    if step is None:
        raise UserError(f"--resume: {ckpt} has no trainer_state.json and is not named checkpoint-<step>")
    return step


TYPED_ENV = "FINETUNE_TRAIN_ARGS"  # `finetune train`'s arguments as the user typed them (shell-quoted)


def resume_command(run_dir: Path, *, effective: int | None = None, per_device: int | None = None) -> str:
    """The command that continues this run (the same arguments, plus --resume); absolute paths,
    so it works from any directory: `finetune train ...` when the run was started so (TYPED_ENV),
    else the accelerate launch. With the effective batch and per-device batch, a second line
    says which other process counts keep the effective batch. An explicit accumulation is left
    out: on resume it is recomputed from the checkpoint for whatever count the launch has."""
    typed = os.environ.get(TYPED_ENV)
    words, argv = shlex.split(typed) if typed is not None else sys.argv[1:], []
    dropped = ("--resume", "--run.output_dir", "--training.gradient_accumulation_steps")
    while words:
        word, words = words[0], words[1:]
        if word.split("=")[0] in dropped:
            words = words[1:] if "=" not in word and words and not words[0].startswith("-") else words
        elif word != "--overwrite":
            argv.append(word)
    argv.append(f"--run.output_dir={run_dir.resolve()}")
    if typed is not None:  # as the user typed it
        command = shlex.join(["finetune", "train", *argv, "--resume"])
    else:
        config = os.environ.get("FINETUNE_ACCELERATE_CONFIG")
        env = "FINETUNE_CPU_DISTRIBUTED=1 " if os.environ.get("FINETUNE_CPU_DISTRIBUTED") == "1" else ""
        launch = f"--config_file {shlex.quote(config)} " if config else "<the same accelerate launch options> "
        script = shlex.quote(str(Path(sys.argv[0]).resolve()))
        command = f"{env}accelerate launch {launch}{script} {shlex.join(argv)} --resume"
    if effective and per_device:
        from finetune.checkpointing.resume_plan import allowed_world_sizes

        counts = ", ".join(map(str, allowed_world_sizes(effective, per_device)))
        flag = "--num_processes" if typed is None else "--num-processes"
        command += (
            f"\n  on another number of GPUs too: add {flag} M with M in {{{counts}}} (M x {per_device} "
            f"per device must divide the effective batch {effective}; gradient accumulation is recomputed), "
            f"or more with a smaller --training.per_device_train_batch_size"
        )
    return command
