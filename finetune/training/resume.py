"""`--resume`: continue a run in its own run directory, from a complete checkpoint.

    finetune train --recipe zero2 --run.name=exp1 --resume                  newest complete checkpoint of runs/exp1
    finetune train --recipe zero2 --run.name=exp1 --resume=runs/exp1/checkpoint-200

Trainer restores everything from the checkpoint (transformers 5.23 Trainer.train(
resume_from_checkpoint=...)): weights (DeepSpeed through deepspeed_load_checkpoint, FSDP2
through its sharded state dict), optimizer and scheduler, every rank's RNG state, and the data
position (accelerate.skip_first_batches over the same seeded sampler). Checkpoints are only
ever written at optimizer-step boundaries (Trainer saves from _maybe_log_save_evaluate, which
runs after the optimizer step of the last micro-batch of an accumulation cycle), so a resumed
run starts a fresh accumulation cycle exactly where the interrupted one would have.

What this module adds: choosing the checkpoint (finetune/training/checkpoints.py: complete ones only),
reusing the existing run directory without deleting anything, and continuing run.json:
steps[] up to the checkpoint's step are kept, later ones (trained after the checkpoint, and
about to be trained again) are dropped and counted, and summary.resumed_from / resumes say
where the run continued from and how many times.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

from finetune.errors import UserError
from finetune.telemetry.record import RecordView, load
from finetune.training import checkpoints


def prepare(run_dir: Path, resume: str, *, overwrite: bool) -> Path:
    """Rank 0: the checkpoint to resume from; the run directory is reused as it is."""
    if overwrite:
        raise UserError("--resume and --overwrite contradict each other: --overwrite deletes the run directory "
                        "that --resume continues; drop one of them")
    ckpt = checkpoints.resolve(resume, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)  # --resume=PATH into a new run directory
    return ckpt


def save_config(run_dir: Path, config: dict) -> Path:
    """The resumed run's resolved configuration, beside the original's config.yaml (kept)."""
    import yaml

    n = 1
    while (run_dir / f"config.resume{n}.yaml").exists():
        n += 1
    out = run_dir / f"config.resume{n}.yaml"
    out.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return out


def continue_record(rec, run_dir: Path, ckpt: Path) -> None:
    """Carry the earlier run.json into `rec` (a fresh RunRecord for this process)."""
    step = _checkpoint_step(ckpt)
    old_path = run_dir / "run.json"
    old = RecordView(load(old_path)) if old_path.is_file() else None
    entry = {"from": str(ckpt), "step": step, "at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
             "previous_status": None, "steps_discarded": 0}
    if old is not None:
        steps = old.get("steps", default=[])
        kept = [s for s in steps if s.get("step") is not None and s["step"] <= step]
        entry["previous_status"] = old.get("summary", "status")
        entry["steps_discarded"] = len(steps) - len(kept)
        rec.set("created", old.get("created", default=rec.view.get("created")))
        rec.set("steps", kept)
        history = list(old.get("summary", "resume_history", default=[]))
    else:
        history = []
    history.append(entry)
    rec.update("summary", resumed_from=str(ckpt), resumed_at_step=step, resumes=len(history),
               resume_history=history, steps=step)


def _checkpoint_step(ckpt: Path) -> int:
    state = Path(ckpt) / "trainer_state.json"
    if state.is_file():
        return int(json.loads(state.read_text(encoding="utf-8"))["global_step"])
    step = checkpoints.step_of(ckpt)
    if step is None:
        raise UserError(f"--resume: {ckpt} has no trainer_state.json and is not named checkpoint-<step>")
    return step


def resume_command(run_dir: Path) -> str:
    """The command that continues this run (the same arguments, plus --resume); absolute paths,
    so it works from any directory."""
    argv = [a for a in sys.argv[1:] if a != "--overwrite" and not a.startswith("--resume")
            and not a.startswith("--run.output_dir")]
    argv.append(f"--run.output_dir={run_dir.resolve()}")
    config = os.environ.get("FINETUNE_ACCELERATE_CONFIG")
    env = "FINETUNE_CPU_DISTRIBUTED=1 " if os.environ.get("FINETUNE_CPU_DISTRIBUTED") == "1" else ""
    launch = f"--config_file {config} " if config else "<the same accelerate launch options> "
    script = Path(sys.argv[0]).resolve()
    return f"{env}accelerate launch {launch}{script} {' '.join(argv)} --resume"
