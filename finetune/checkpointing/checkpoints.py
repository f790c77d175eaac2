"""Checkpoint validity (a checkpoint counts only when it holds MARKER, written last by rank 0, with every file's size
and checksum), the choice of the checkpoint to resume from (checksums verified), and rotation (sizes only, after the new
checkpoint is complete): docs/faults.md "Torn or corrupt checkpoints".
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

from finetune import fingerprints
from finetune.errors import UserError
from finetune.storage import json_object

log = logging.getLogger("finetune")

MARKER = "finetune-checkpoint-complete.json"
CHECKSUM = fingerprints.ALGORITHM  # not cryptographic: finds damage, at ~3 GB/s on one core (docs/faults.md)
_NAME = re.compile(r"^checkpoint-(\d+)$")


def step_of(path: Path) -> int | None:
    m = _NAME.match(Path(path).name)
    return int(m.group(1)) if m else None


def _files(ckpt: Path) -> dict[str, int]:
    return {
        p.relative_to(ckpt).as_posix(): p.stat().st_size
        for p in sorted(ckpt.rglob("*"))
        if p.is_file() and p.name != MARKER
    }


def write_marker(ckpt: Path, *, step: int, world_size: int, run: dict | None = None) -> Path:
    """Rank 0 only, after every rank finished writing `ckpt`: the list of files and sizes, and
    what wrote it (`run`, finetune/checkpointing/provenance.py)."""
    ckpt = Path(ckpt)
    files = _files(ckpt)
    if not files:
        raise RuntimeError(f"checkpoint {ckpt} has no files; refusing to mark it complete")
    marker = ckpt / MARKER
    tmp = ckpt / (MARKER + ".tmp")
    started = time.perf_counter()
    sums = {name: fingerprints.checksum(ckpt / name) for name in files}
    seconds, mb = time.perf_counter() - started, sum(files.values()) / 1e6
    log.info(f"checkpoint {ckpt.name}: {len(files)} files, {mb:.1f} MB checksummed in {seconds:.2f} s")
    body = {
        "step": step,
        "world_size": world_size,
        "files": files,
        "checksums": {"algorithm": CHECKSUM, "files": sums},
        "completed": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if run is not None:
        body["run"] = run
    tmp.write_text(json.dumps(body, indent=1), encoding="utf-8")
    tmp.replace(marker)  # atomic: a reader sees no marker or a whole one
    return marker


def read_marker(ckpt: Path) -> dict | None:
    """The completion marker of `ckpt` as a dict, or None when it has none or it does not parse."""
    return json_object(Path(ckpt) / MARKER) or None


def problem(ckpt: Path, *, verify: bool = True) -> str | None:
    """Why `ckpt` cannot be resumed from, or None when it is complete. `verify`: also compare each
    file's checksum with the marker's (reads every byte; markers written before checksums have none)."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        return "not a directory"
    marker = ckpt / MARKER
    if not marker.is_file():
        return f"no {MARKER} (the save did not finish, or it was written by another tool)"
    try:
        body = json.loads(marker.read_text(encoding="utf-8"))
        listed = body["files"]
        sums = body.get("checksums", {}).get("files", {}) if verify else {}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable {MARKER}: {e}"
    for name, size in listed.items():
        f = ckpt / name
        if not f.is_file():
            return f"file {name} is missing"
        if f.stat().st_size != size:
            return f"file {name} is {f.stat().st_size} bytes, {size} when saved (truncated or changed)"
    for name, expected in sums.items():
        if fingerprints.checksum(ckpt / name) != expected:
            return f"file {name} does not match the {CHECKSUM} checksum recorded when saved (damaged on disk since)"
    return None


def checkpoints(run_dir: Path) -> list[Path]:
    """checkpoint-<step> directories in `run_dir`, oldest step first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=step_of)


def newest_valid(run_dir: Path) -> Path:
    """The checkpoint `--resume` (auto) continues from: the newest complete one. Each newer
    incomplete one is named in a warning; none complete -> UserError."""
    found = checkpoints(run_dir)
    skipped = []
    for ckpt in reversed(found):
        why = problem(ckpt)
        if why is None:
            return ckpt
        log.warning("skipping checkpoint %s: %s", ckpt, why)
        skipped.append(f"{ckpt.name} ({why})")
    if not found:
        raise UserError(
            f"--resume: no checkpoint-<step> directory in {run_dir}. Checkpoints are written "
            f"every training.save_steps steps (with --training.save_strategy=steps) and when "
            f"a run is preempted; start a new run instead."
        )
    raise UserError(
        f"--resume: no complete checkpoint in {run_dir}; every one is incomplete or damaged: " + "; ".join(skipped)
    )


def resolve(resume: str, run_dir: Path) -> Path:
    """`--resume` (auto) or `--resume=PATH` -> a complete checkpoint directory, or UserError."""
    if resume == "auto":
        if not Path(run_dir).is_dir():
            raise UserError(
                f"--resume: run directory {run_dir} does not exist; give --run.name or "
                f"--run.output_dir of the run to continue, or --resume=PATH/checkpoint-N"
            )
        return newest_valid(run_dir)
    path = Path(resume)
    if step_of(path) is None and path.is_dir() and checkpoints(path):  # a run directory was given
        return newest_valid(path)
    why = problem(path) if path.exists() else "does not exist"
    if why:
        raise UserError(f"--resume={resume}: cannot resume from this checkpoint: {why}")
    return path


def rotate(run_dir: Path, keep: int | None, newest: Path) -> list[Path]:
    """Delete the oldest checkpoints beyond `keep` complete ones; `newest` (just completed) is
    always kept, incomplete ones older than it are deleted (nothing can resume from them)."""
    if not keep or keep <= 0:
        return []
    newest_step = step_of(newest)
    older = [c for c in checkpoints(run_dir) if step_of(c) < newest_step]
    valid = [c for c in older if problem(c, verify=False) is None]  # at every save: sizes, not checksums
    doomed = [c for c in older if c not in valid] + valid[: max(len(valid) - (keep - 1), 0)]
    for c in doomed:
        log.info("rotating out %s (training.save_total_limit=%d)", c, keep)
        shutil.rmtree(c, ignore_errors=True)
        shutil.rmtree(c.with_name(c.name + UNIVERSAL_SUFFIX), ignore_errors=True)  # derived from c
    return doomed


UNIVERSAL_SUFFIX = ".universal"  # the DeepSpeed universal cache beside a checkpoint (universal.py)


def move_aside_newer(run_dir: Path, step: int) -> list[tuple[str, str]]:
    """Rank 0, before a resumed run from `step` trains: rename every checkpoint-K with K > step (and its
    universal cache) to checkpoint-K.superseded-<n>; returns [(old name, new name)], oldest first."""
    moved = []
    for ckpt in checkpoints(run_dir):
        if step_of(ckpt) <= step:
            continue
        n = 1
        while any(ckpt.with_name(f"{ckpt.name}{extra}.superseded-{n}").exists() for extra in ("", UNIVERSAL_SUFFIX)):
            n += 1
        new = ckpt.with_name(f"{ckpt.name}.superseded-{n}")
        ckpt.rename(new)
        cache = ckpt.with_name(ckpt.name + UNIVERSAL_SUFFIX)
        if cache.exists():
            cache.rename(cache.with_name(f"{cache.name}.superseded-{n}"))
        log.warning(
            f"set aside {ckpt} -> {new.name} (newer than the checkpoint resumed from, step {step}; kept, not deleted)"
        )
        moved.append((ckpt.name, new.name))
    return moved
