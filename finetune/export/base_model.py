"""The base model `finetune export` pairs an adapter with (finetune/export/command.py): the folder on this machine that
holds the weights the run trained on (their fingerprints in run.json `inputs` or a checkpoint's marker): a local folder,
the bundled model, or a hub id's snapshot in the Hugging Face cache (docs/usage.md "Export").
"""

from __future__ import annotations

from pathlib import Path

from finetune.checkpointing import provenance
from finetune.errors import UserError


def folder(run_dir: Path, cfg, recorded: dict) -> Path:
    """The base model's folder on this machine, holding the weights the source was trained on (their fingerprints in
    `recorded`: run.json's `inputs`, or a checkpoint marker's run block), else a UserError naming what differs. A hub
    id's cached snapshot that no longer holds them (a newer revision fetched since): the cached snapshot that does
    (the one run.json `inputs.snapshot` names first), said."""
    from finetune.modeling.load import hub_cache, hub_id, model_folder, resolve_model_path

    name = cfg.model.name_or_path
    base = model_folder(resolve_model_path(name), cfg.model.revision)
    local = not hub_id(name)
    if base is None or not (base / "config.json").is_file():
        where = "no config.json in it" if base else "no such folder, nor a cached hub model"
        fix = "put it back there (a moved one: a symbolic link at that path to where it is now)"
        if not local:
            where, fix = (
                f"not in {hub_cache()}",
                f"download it (`hf download {name}`) or set HF_HOME to the cache it is in",
            )
        raise UserError(
            f"model.name_or_path {name!r} ({run_dir / 'config.yaml'}): the base model the run trained on is not on this "
            f"machine ({where}); {fix}"
        )
    inputs = recorded.get("inputs") or {}
    # an adapter is only right on its base
    changed = provenance.weight_changes(base, inputs) if cfg.method.name != "full" else []
    if changed and not local:
        held = provenance.trained_snapshot(base, inputs)
        if held:
            print(
                f"finetune export: {name}: the cached snapshot {base.name} holds other weights ({changed[0]['said']}); "
                f"the base is snapshot {held.name}, which holds those the source was trained on",
                flush=True,
            )
            return held
        raise UserError(
            f"model.name_or_path {name!r}: {changed[0]['said']} since the source was trained: "
            f"{provenance.no_trained_snapshot(name, base, inputs)}; the export would pair it with weights it was not "
            f"trained on"
        )
    if changed:
        raise UserError(
            f"model.name_or_path {name!r}: {changed[0]['said']} since the source was trained; the export would "
            f"pair it with weights it was not trained on. Put the base weights it was trained with back in {base}"
        )
    return base
