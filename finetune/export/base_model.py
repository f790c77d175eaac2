"""The base model `finetune export` pairs an adapter with (finetune/export/command.py): the folder on this machine that
holds the weights the run trained on (their fingerprints in run.json `inputs` or a checkpoint's marker): a local folder,
the bundled model, or a hub id's snapshot in the Hugging Face cache (docs/usage.md "Export").
"""

from __future__ import annotations

from pathlib import Path

from finetune import fingerprints
from finetune.config.sections import BUNDLED_MODEL
from finetune.errors import UserError


def folder(run_dir: Path, cfg, recorded: dict) -> Path:
    """The base model's folder on this machine, holding the weights the source was trained on (their fingerprints in
    `recorded`: run.json's `inputs`, or a checkpoint marker's run block), else a UserError naming what differs. A hub
    id's cached snapshot that no longer holds them (a newer revision fetched since): the cached snapshot that does,
    said."""
    from huggingface_hub import constants

    from finetune.modeling.load import model_folder, resolve_model_path

    name = cfg.model.name_or_path
    base = model_folder(resolve_model_path(name), cfg.model.revision)
    local = not hub_id(name)
    cache = f"the Hugging Face cache {constants.HF_HUB_CACHE}" + (", HF_HUB_OFFLINE=1" * constants.HF_HUB_OFFLINE)
    if base is None or not (base / "config.json").is_file():
        where = "no config.json in it" if base else "no such folder, nor a cached hub model"
        fix = "put it back there (a moved one: a symbolic link at that path to where it is now)"
        if not local:
            where, fix = f"not in {cache}", f"download it (`hf download {name}`) or set HF_HOME to the cache it is in"
        raise UserError(
            f"model.name_or_path {name!r} ({run_dir / 'config.yaml'}): the base model the run trained on is not on this "
            f"machine ({where}); {fix}"
        )
    inputs = recorded.get("inputs") or {}
    changed = changes(base, inputs) if cfg.method.name != "full" else []  # an adapter is only right on its base
    if changed and not local:
        held = [s for s in sorted(base.parent.iterdir()) if s != base and not changes(s, inputs)]
        if held:
            print(
                f"finetune export: {name}: the cached snapshot {base.name} holds other weights ({changed[0]['said']}); "
                f"the base is snapshot {held[0].name}, which holds those the source was trained on",
                flush=True,
            )
            return held[0]
        raise UserError(
            f"model.name_or_path {name!r}: {changed[0]['said']} since the source was trained: {cache} holds snapshot "
            f"{base.name} and no other with the weights it was trained on; the export would pair it with weights it was "
            f"not trained on. Download the revision it was trained on (`hf download {name} --revision COMMIT`)"
        )
    if changed:
        raise UserError(
            f"model.name_or_path {name!r}: {changed[0]['said']} since the source was trained; the export would "
            f"pair it with weights it was not trained on. Put the base weights it was trained with back in {base}"
        )
    return base


def hub_id(name: str) -> bool:
    """model.name_or_path names a hub model (its files in the Hugging Face cache), not a folder or the bundled one."""
    return name != BUNDLED_MODEL and name.count("/") == 1 and not Path(name).expanduser().exists()


def changes(folder: Path, inputs: dict) -> list[dict]:
    """How the weights in `folder` differ from the recorded `inputs` (none recorded: none)."""
    from finetune.checkpointing import provenance

    if not inputs.get("weights"):
        return []
    cache = fingerprints.Cache()
    now = provenance.weights_of(cache, folder)
    cache.save()
    return provenance.input_changes({k: inputs.get(k) for k in now}, now)
