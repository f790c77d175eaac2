"""A DeepSpeed checkpoint resumed under another world size: its universal checkpoint, converted once
and cached beside the original (docs/faults.md "Resume on another number of GPUs"). For big models
convert beforehand: python -m finetune.checkpointing.universal runs/exp1/checkpoint-200
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import sys
import time
from pathlib import Path

from finetune.checkpointing import checkpoints
from finetune.errors import UserError

log = logging.getLogger("finetune")

MARKER = "finetune-universal-complete.json"
TRAINER_FILES = ("trainer_state.json", "scheduler.pt", "scaler.pt", "rng_state.pth", "rng_state_*.pth")


def cache_dir(ckpt: Path) -> Path:
    return Path(ckpt).with_name(Path(ckpt).name + checkpoints.UNIVERSAL_SUFFIX)


def _source_stamp(ckpt: Path) -> str | None:
    marker = checkpoints.read_marker(ckpt)
    return marker.get("completed") if marker else None


def current(ckpt: Path) -> Path | None:
    """The cache of `ckpt` when it is complete and was built from this very checkpoint."""
    out = cache_dir(ckpt)
    try:
        info = json.loads((out / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return out if info.get("source_completed") == _source_stamp(ckpt) else None


def for_resume(state, plan) -> tuple[str, float | None] | None:
    """DeepSpeed under another world size: rank 0 builds (or reuses) the universal checkpoint beside the original while
    the others wait; (its directory, the seconds the conversion took, None when reused), on every rank; None when the
    resume plan needs no resharding through it (finetune/checkpointing/resume_plan.py)."""
    if plan is None or plan.reshard != "universal":
        return None
    from finetune.launch.peers import run_on_main

    def build():
        out, seconds = convert(Path(plan.checkpoint))
        return str(out), seconds

    out, seconds = run_on_main(state, build)
    if state.is_main_process:
        how = "reused" if seconds is None else f"converted in {seconds:.2f} s"
        log.warning(f"  DeepSpeed states resharded through {out} ({how}; {Path(plan.checkpoint).name} unchanged)")
    return out, seconds


def convert(ckpt: Path) -> tuple[Path, float | None]:
    """Rank 0 only: (the cache directory, seconds the conversion took; None when reused)."""
    ckpt = Path(ckpt)
    if current(ckpt):
        log.info("DeepSpeed universal checkpoint %s reused (built before from %s)", cache_dir(ckpt), ckpt.name)
        return cache_dir(ckpt), None
    latest = ckpt / "latest"
    if not latest.is_file():
        raise UserError(
            f"--resume: {ckpt} has no `latest` file naming its DeepSpeed tag (global_stepN), so it "
            f"cannot be converted to a universal checkpoint for another world size"
        )
    tag = latest.read_text(encoding="utf-8").strip()
    out, tmp = cache_dir(ckpt), ckpt.with_name(ckpt.name + checkpoints.UNIVERSAL_SUFFIX + ".tmp")
    if out.exists() and not (out / MARKER).is_file():  # rebuilt below; only a cache this module built
        raise UserError(
            f"--resume: {out} exists but is no universal checkpoint finetune built (no {MARKER}); nothing was "
            f"changed. Move it away, then resume again"
        )
    shutil.rmtree(tmp, ignore_errors=True)  # a conversion cut short: ours, rebuilt
    tmp.mkdir()
    t0 = time.perf_counter()
    from deepspeed.checkpoint import ds_to_universal

    # ds_to_universal prints its progress; keep it in a log beside the result instead of the console.
    with open(tmp / "conversion.log", "w", encoding="utf-8") as out_log, contextlib.redirect_stdout(out_log):
        ds_to_universal.main(
            argparse.Namespace(
                input_folder=str(ckpt / tag),
                output_folder=str(tmp / f"{tag}_universal"),  # latest_universal -> tmp/
                num_extract_workers=1,
                num_merge_workers=1,
                keep_temp_folder=False,
                strict=True,
                inject_missing_state=True,
            )
        )
    for pattern in TRAINER_FILES:
        for f in ckpt.glob(pattern):
            shutil.copy2(f, tmp / f.name)
    seconds = round(time.perf_counter() - t0, 2)
    (tmp / MARKER).write_text(
        json.dumps(
            {"source": str(ckpt), "source_completed": _source_stamp(ckpt), "tag": tag, "seconds": seconds}, indent=1
        ),
        encoding="utf-8",
    )
    if out.exists():  # stale: built from an older checkpoint of the same name; derived data, rebuilt
        log.warning("DeepSpeed universal checkpoint %s was built from an older %s; rebuilt", out, ckpt.name)
        shutil.rmtree(out)
    tmp.rename(out)
    log.info("DeepSpeed universal checkpoint %s built from %s in %.2f s", out, ckpt.name, seconds)
    return out, seconds


def enable_loading(trainer) -> None:
    """Make the DeepSpeed engine Trainer is about to build load a universal checkpoint: the key must be in the config
    dict before `trainer.train()` prepares the engine (a callback is too late: Trainer loads the checkpoint in
    _prepare_for_training, before on_train_begin). This is the dict HfTrainerDeepSpeedConfig keeps (transformers
    integrations/deepspeed.py) and accelerate.prepare hands to deepspeed.initialize."""
    plugin = trainer.accelerator.state.deepspeed_plugin
    plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m finetune.checkpointing.universal",
        description="Convert a DeepSpeed checkpoint to its universal cache beforehand.",
    )
    parser.add_argument("checkpoint", help="a complete checkpoint-N directory written under DeepSpeed")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ckpt = Path(args.checkpoint)
    why = checkpoints.problem(ckpt)
    if why:
        print(f"error: {ckpt}: {why}", file=sys.stderr)
        return 2
    out, seconds = convert(ckpt)
    print(f"{out} ({'reused' if seconds is None else f'converted in {seconds} s'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
