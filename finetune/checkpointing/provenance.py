"""What wrote a checkpoint: the `run` block of its completion marker, and reading it back.

The block (finetune/checkpointing/checkpoints.py write_marker, rank 0, at every save) holds what a resume under another
launch must know and compare before loading any weights (finetune/checkpointing/resume_plan.py): world size, strategy,
per-device batch, accumulation and effective batch (from run.json's live `strategy` and `batch` sections), the method
and model identities, and the data: row count, a fingerprint of the rows, and the settings that decide their order.
Checkpoints written before the block existed are read from the run.json beside them when it describes the same world
size.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from finetune.checkpointing import checkpoints


@dataclass
class Written:
    """What wrote a checkpoint; None where the checkpoint does not say."""

    checkpoint: str
    step: int
    world_size: int
    source: str  # where the facts come from: the marker's run block, or run.json beside it
    files: list[str] = field(default_factory=list)
    strategy: str | None = None
    offload: str | None = None
    per_device: int | None = None
    grad_accum: int | None = None
    effective: int | None = None
    method: dict | None = None
    model: dict | None = None
    data: dict | None = None
    mesh: dict | None = None  # {sp, tp, cp} of the live mesh that wrote it (None: written before meshes)


# --- identities written into the marker and compared on resume ------------------------------------


def method_identity(method) -> dict:
    out = {"name": method.name}
    if method.name in ("lora", "qlora"):  # the adapter's shape
        out.update(lora_r=method.lora_r, lora_alpha=method.lora_alpha, target_modules=method.target_modules)
    if method.name == "qlora":
        out.update(quant_type=method.quant_type, double_quant=method.double_quant)
    return out


def model_identity(model) -> dict:
    """name_or_path, revision and the SHA-256 of its config.json where one is on this machine."""
    from finetune.config.sections import BUNDLED_MODEL

    name = model.name_or_path
    config = None
    if name == BUNDLED_MODEL:
        from finetune.modeling.bundled import model_dir

        config = model_dir() / "config.json"
    elif Path(name).expanduser().is_dir():
        config = Path(name).expanduser() / "config.json"
    else:
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(name, "config.json", revision=model.revision)
            config = Path(found) if isinstance(found, str) else None
        except ValueError:  # not a hub id; preflight names it
            config = None
    sha = hashlib.sha256(config.read_bytes()).hexdigest() if config is not None and config.is_file() else None
    return {"name_or_path": name, "revision": model.revision, "config_sha256": sha}


def data_order_settings(cfg) -> dict:
    a = cfg.training.typed
    return {
        "seed": a.seed,
        "data_seed": a.data_seed,
        "sampling": a.train_sampling_strategy,
        "drop_last": bool(a.dataloader_drop_last),
        "packing": bool(cfg.data.packing),
    }


def data_fingerprint(dataset) -> str:
    """SHA-256 over the train rows' input_ids in dataset order (the dataset as built, from a list;
    chunking of the Arrow column does not change it). Arrow's accessors only, no compute kernel
    (those would start Arrow's thread pool in every rank)."""
    import numpy as np

    lengths, values = hashlib.sha256(), hashlib.sha256()
    for chunk in dataset.data.column("input_ids").chunks:
        lengths.update(np.diff(np.asarray(chunk.offsets, dtype=np.int64)).tobytes())
        values.update(np.asarray(chunk.flatten(), dtype=np.int64).tobytes())
    return hashlib.sha256((lengths.hexdigest() + values.hexdigest()).encode()).hexdigest()


def layout(strategy: dict, batch: dict) -> dict:
    """How a run was laid out, from run.json's `strategy` and `batch` sections: the facts a
    checkpoint marker's `run` block and each `resumes` segment share (None where unknown)."""
    return {
        "world_size": strategy.get("world_size"),
        "strategy": strategy.get("name"),
        "offload": strategy.get("offload"),
        "per_device": batch.get("per_device"),
        "grad_accum": batch.get("grad_accum"),
        "effective": batch.get("effective"),
        "mesh": {k: (strategy.get("parallel") or {}).get(k, 1) for k in ("sp", "tp", "cp")},
    }


def run_block(strategy: dict, batch: dict, lr: dict, static: dict) -> dict:
    """The marker's `run` block: the live strategy and batch (run.json sections) + static facts."""
    return {
        **layout(strategy, batch),
        "zero_stage": strategy.get("zero_stage"),
        "fsdp_version": strategy.get("fsdp_version"),
        "lr_applied": lr["applied"],
        **static,
    }


def run_block_of(record, static: dict) -> dict:
    """The marker's `run` block from a run record's live sections (RecordView) and the static facts."""
    return run_block(record.get("strategy"), record.get("batch"), record.get("lr"), static)


def static_facts(cfg, *, train_rows: int, fingerprint: str) -> dict:
    return {
        "method": method_identity(cfg.method),
        "model": model_identity(cfg.model),
        "data": {"train_rows": train_rows, "fingerprint": fingerprint, **data_order_settings(cfg)},
    }


# --- reading a checkpoint ----------------------------------------------------------------------------


def read(ckpt: Path) -> Written:
    """Facts from the marker's `run` block; for checkpoints written before it existed, from the
    run.json beside them when that describes the same world size."""
    ckpt = Path(ckpt)
    marker = checkpoints.read_marker(ckpt) or {}
    step = int(marker.get("step", checkpoints.step_of(ckpt) or 0))
    world = int(marker.get("world_size", 1))
    written = Written(
        str(ckpt), step, world, source=f"{ckpt.name}/{checkpoints.MARKER}", files=sorted(marker.get("files", {}))
    )
    run = marker.get("run")
    if run is None:
        run = _from_run_json(ckpt.parent / "run.json", world)
        written.source = (
            f"{ckpt.parent / 'run.json'} (the checkpoint predates the marker's run block)"
            if run
            else f"{ckpt.name}/{checkpoints.MARKER} (world size only: written before the marker recorded more)"
        )
    for key in ("strategy", "offload", "per_device", "grad_accum", "effective", "method", "model", "data", "mesh"):
        setattr(written, key, (run or {}).get(key))
    return written


def _from_run_json(path: Path, world: int) -> dict | None:
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
        s, b, c = rec["strategy"], rec["batch"], rec["config"]
        if b["data_parallel_size"] != world:
            return None
        return {
            "strategy": s["name"],
            "offload": s.get("offload"),
            "per_device": b["per_device"],
            "grad_accum": b["grad_accum"],
            "effective": b["effective"],
            "method": {"name": c["method"]["name"]},
            "model": {"name_or_path": c["model"]["name_or_path"]},
        }
    except (OSError, ValueError, KeyError, TypeError):
        return None
