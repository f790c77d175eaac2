"""What wrote a checkpoint: the `run` block of its completion marker, and reading it back; and what a run is made from:
the content fingerprints of its inputs (run.json `inputs`, kept in the block too, compared on --resume).

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
import time
from dataclasses import dataclass, field
from pathlib import Path

from finetune import fingerprints
from finetune.checkpointing import checkpoints
from finetune.data.prepare import source_files
from finetune.modeling.load import hub_cache, hub_id, model_folder
from finetune.storage import json_object


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
    inputs: dict | None = None  # run.json `inputs` of the segment that wrote it (None: written before they were kept)


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
    folder = model_folder(model.name_or_path, model.revision)
    config = folder / "config.json" if folder else None
    sha = hashlib.sha256(config.read_bytes()).hexdigest() if config is not None and config.is_file() else None
    return {"name_or_path": model.name_or_path, "revision": model.revision, "config_sha256": sha}


# --- what a run is made from: the content fingerprints of its inputs (run.json `inputs`, the marker's run block) -----

# The files of a model folder that are its weights (with its config), its tokenizer, and its chat template.
WEIGHT_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "*.bin.index.json")
TOKENIZER_FILES = (
    *("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"),
    *("vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model"),
)
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "additional_chat_templates/*")
# Not settings of what is trained: the run's name and place, how it is launched and logged, the batch layout a resume
# recomputes, and the paths whose content is fingerprinted itself (a moved copy of the same data is the same input; a
# hub model's revision names its snapshot, which a resume pins to the one it trained on: trained_revision).
NOT_SETTINGS = ("run", "logging")
NOT_SETTING_KEYS = (
    *("training.per_device_train_batch_size", "training.gradient_accumulation_steps"),
    *("model.name_or_path", "model.revision", "model.tokenizer_name_or_path", "data.path"),
)
# (input, its name in words, its files' key): compared on --resume in this order
INPUTS = (
    ("weights", "the base weights", "weight_files"),
    ("tokenizer", "the tokenizer", "tokenizer_files"),
    ("chat_template", "the chat template", "chat_template_files"),
    ("data", "the training data", "data_files"),
    ("heldout", "the held-out evaluation data", "heldout_files"),
    ("settings", "the settings", None),
)


def inputs(cfg, data_path: str, heldout_path: str | None) -> dict:
    """run.json `inputs`: a content fingerprint of each input (finetune/fingerprints.py; files read once, then cached
    by path and stat) and of each of its files. None where an input is not on this machine (a hub model not cached,
    a Hub dataset) or not read (no exact-match evaluation); the chat template is None when data.chat_template is false (it
    renders nothing then). `data_path`, `heldout_path`: as the run reads them (finetune/data/demo.py paths)."""
    cache, started = fingerprints.Cache(), time.perf_counter()
    model = model_folder(cfg.model.name_or_path, cfg.model.revision)
    tokenizer = model_folder(cfg.model.tokenizer_name_or_path or cfg.model.name_or_path, cfg.model.revision)
    weights = weights_of(cache, model)
    tokens = _folder_files(cache, tokenizer, TOKENIZER_FILES)
    config = tokenizer / "tokenizer_config.json" if tokenizer else None
    template = _template(cache, tokenizer, config) if cfg.data.chat_template else {}
    if config is not None and config.is_file():  # its chat_template is the template's, not the tokenizer's
        values = json_object(config)
        values.pop("chat_template", None)
        tokens["tokenizer_config.json"] = fingerprints.of_text(json.dumps(values, sort_keys=True))
    data = {name: cache.of(f) for name, f in source_files(data_path, cfg.data.split).items()}
    evaluated = heldout_path if cfg.eval.exact_match else None  # the held-out rows are read by that evaluation only
    heldout = {name: cache.of(f) for name, f in source_files(evaluated, "train").items()} if evaluated else {}
    cache.save()
    return {
        "algorithm": fingerprints.ALGORITHM,
        **weights,
        "snapshot": model.name if model is not None and hub_id(cfg.model.name_or_path) else None,
        "tokenizer": fingerprints.of_parts(tokens) if tokens else None,
        "tokenizer_files": tokens,
        "chat_template": fingerprints.of_parts(template) if template else None,
        "chat_template_files": template,
        "data": fingerprints.of_parts(data) if data else None,
        "data_files": data,
        "heldout": fingerprints.of_parts(heldout) if heldout else None,
        "heldout_files": heldout,
        "settings": fingerprints.of_text(json.dumps(settings(cfg), sort_keys=True, default=str)),
        "read_bytes": cache.bytes_read,
        "seconds": round(time.perf_counter() - started, 3),
    }


def settings(cfg) -> dict:
    """The configuration that decides what is trained (NOT_SETTINGS left out), as section.key -> value."""
    return {
        f"{section}.{key}": value
        for section, body in cfg.to_dict().items()
        if isinstance(body, dict) and section not in NOT_SETTINGS
        for key, value in body.items()
        if f"{section}.{key}" not in NOT_SETTING_KEYS
    }


def weights_of(cache, folder: Path | None) -> dict:
    """run.json `inputs`' `weights` and `weight_files` of a model folder (None and {} for none)."""
    files = _folder_files(cache, folder, WEIGHT_FILES)
    return {"weights": fingerprints.of_parts(files) if files else None, "weight_files": files}


def weight_changes(folder: Path, inputs: dict) -> list[dict]:
    """How the weights in `folder` differ from the recorded `inputs` (none recorded: none): input_changes' entries."""
    if not inputs.get("weights"):
        return []
    cache = fingerprints.Cache()
    now = weights_of(cache, folder)
    cache.save()
    return input_changes({k: inputs.get(k) for k in now}, now)


# --- a hub model's snapshot: the one a run trained on, when the cache's refs/main moved to another since ----------


def trained_snapshot(folder: Path, inputs: dict) -> Path | None:
    """Of a hub model's cached snapshots (`folder`: the one its revision names now), the other one holding the weights
    `inputs` records: the recorded commit's (`snapshot`) first, else any; None when none does."""
    recorded = inputs.get("snapshot")
    others = sorted(
        (s for s in folder.parent.iterdir() if s != folder and s.is_dir()), key=lambda s: s.name != recorded
    )
    return next((s for s in others if not weight_changes(s, inputs)), None)


def trained_revision(model, inputs: dict | None) -> str | None:
    """The commit to load a hub model at (model.revision) when the revision configured holds other weights than
    `inputs` records (a newer one fetched since) and a cached snapshot holds those; else None."""
    folder = model_folder(model.name_or_path, model.revision)
    if not inputs or folder is None or not hub_id(model.name_or_path) or not weight_changes(folder, inputs):
        return None
    held = trained_snapshot(folder, inputs)
    return held.name if held else None


def no_trained_snapshot(name: str, folder: Path, inputs: dict) -> str:
    """Why a hub model's cache lacks the weights a run trained on, and the command that fetches them, in words."""
    commit = inputs.get("snapshot") or "COMMIT"
    return (
        f"{hub_cache()} holds snapshot {folder.name} and no other with the weights it was trained on; download the "
        f"revision it was trained on (`hf download {name} --revision {commit}`)"
    )


def _folder_files(cache, folder: Path | None, patterns: tuple[str, ...]) -> dict[str, str]:
    if folder is None:
        return {}
    found = {p for pattern in patterns for p in folder.glob(pattern) if p.is_file()}
    return {str(p.relative_to(folder)): cache.of(p) for p in sorted(found)}


def _template(cache, folder: Path | None, config: Path | None) -> dict[str, str]:
    """The chat template's sources: its own files, and tokenizer_config.json's chat_template."""
    found = _folder_files(cache, folder, TEMPLATE_FILES)
    inline = json_object(config).get("chat_template") if config is not None and config.is_file() else None
    if inline is not None:
        found["tokenizer_config.json:chat_template"] = fingerprints.of_text(json.dumps(inline, sort_keys=True))
    return found


def input_changes(old: dict | None, new: dict | None) -> list[dict]:
    """What differs between two `inputs` records, input by input: [{input, said}], `said` naming the files that
    differ, appeared or went; an input unknown on either side (not on this machine, an older record) is not compared."""
    out = []
    for key, words, files in INPUTS:
        before, now = (old or {}).get(key), (new or {}).get(key)
        if before is None or now is None or before == now:
            continue
        detail = _file_changes((old or {}).get(files) or {}, (new or {}).get(files) or {}) if files else []
        shown = f"; {', '.join(detail)}" if detail else ""
        out.append({"input": key, "said": f"{words} changed (fingerprint {before[:12]} -> {now[:12]}{shown})"})
    return out


def _file_changes(old: dict, new: dict) -> list[str]:
    names = sorted(set(old) | set(new))
    if names == [""]:  # one data file: its content is the data (its name is not)
        return []
    said = [f"{n} differs" for n in names if n in old and n in new and old[n] != new[n]]
    said += [f"{n} is new" for n in names if n not in old] + [f"{n} is gone" for n in names if n not in new]
    return said[:6] + ([f"{len(said) - 6} more"] if len(said) > 6 else [])


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


def static_facts(cfg, *, train_rows: int, fingerprint: str, inputs: dict | None = None) -> dict:
    return {
        "method": method_identity(cfg.method),
        "model": model_identity(cfg.model),
        "data": {"train_rows": train_rows, "fingerprint": fingerprint, **data_order_settings(cfg)},
        "inputs": inputs,
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
    for key in (
        "strategy",
        "offload",
        "per_device",
        "grad_accum",
        "effective",
        "method",
        "model",
        "data",
        "mesh",
        "inputs",
    ):
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
