"""The weights of a run, from `model/` or from any complete checkpoint of any strategy, as one stream of tensors under
the names a saved transformers/peft folder uses: safetensors files as Trainer writes them (model/, one device, DDP),
DeepSpeed ZeRO-2/3 partitions consolidated to their fp32 masters (deepspeed.utils.zero_to_fp32), FSDP2's sharded
torch.distributed.checkpoint (DCP) read key by key without a process group. Read one tensor at a time, so a whole
second copy of the model is never held. And the base an adapter is paired with (`base_folder`): the folder on this
machine that holds the weights the run trained on, a local folder, the bundled model, or a hub id's snapshot in the
Hugging Face cache (docs/usage.md "Export").
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from finetune.checkpointing import provenance
from finetune.errors import UserError
from finetune.export import figures

DCP_MODEL = "pytorch_model_fsdp_0"  # accelerate's folder of an FSDP model's sharded state dict
ADAPTER_PREFIX = "base_model.model."  # peft's saved names: base_model.model.<module>.lora_A.weight


@dataclass
class Source:
    """Where the weights are and in which layout: `format` safetensors | deepspeed | dcp; `adapter`: a LoRA/QLoRA
    adapter (else the full model)."""

    path: Path
    format: str
    adapter: bool
    shapes: dict[str, tuple[list[int], str]] = field(default_factory=dict)  # name -> (shape, dtype)
    _lazy: dict = field(default_factory=dict, repr=False)  # DeepSpeed: name -> its lazily gathered tensor

    def describe(self) -> str:
        return {
            "safetensors": f"{self.path} (safetensors)",
            "deepspeed": f"{self.path} (DeepSpeed ZeRO partitions, consolidated to their fp32 masters)",
            "dcp": f"{self.path / DCP_MODEL} (FSDP2 sharded checkpoint, consolidated)",
        }[self.format]

    def tensors(self, names=None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of `names` (default: all), one at a time, in the order given."""
        names = list(self.shapes) if names is None else list(names)
        if self.format == "safetensors":
            yield from _safetensors(self.path, names)
        elif self.format == "deepspeed":
            for name in names:
                yield name, self._lazy[name].contiguous()
        else:
            from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

            for name in names:  # torch's loader of chosen keys outside a process group (format_utils.py uses it)
                with warnings.catch_warnings():  # "torch.distributed is unavailable ...": here by design, per key
                    warnings.simplefilter("ignore", UserWarning)
                    loaded = _load_state_dict_from_keys({f"model.{name}"}, checkpoint_id=str(self.path / DCP_MODEL))
                yield name, loaded["model"][name]

    def bytes(self, dtype: torch.dtype | None = None) -> int:
        """What the tensors take, in `dtype` (default: as stored)."""
        size = (lambda d: torch.empty(0, dtype=dtype).element_size()) if dtype else _itemsize
        return sum(math.prod(shape) * size(d) for shape, d in self.shapes.values())


def open_source(path: Path, *, adapter: bool) -> Source:
    """The weights in `path` (model/ or checkpoint-N), in whichever layout the strategy wrote; UserError naming the
    path when it holds none this knows."""
    path = Path(path)
    if (path / "latest").is_file() and any(path.glob("global_step*")):
        return _deepspeed(path, adapter)
    if (path / DCP_MODEL / ".metadata").is_file():
        return _dcp(path, adapter)
    files, problems = figures.weight_files(path)
    if problems:
        raise UserError(f"{path}: no weights this can read ({'; '.join(problems)})")
    source = Source(path, "safetensors", adapter)
    from safetensors import safe_open

    for name, _ in files:
        try:
            with safe_open(str(path / name), "pt") as f:
                for key in f.keys():
                    s = f.get_slice(key)
                    source.shapes[key] = (list(s.get_shape()), dtype_name(s.get_dtype()))
        except Exception as e:  # noqa: BLE001 - a damaged file: named
            raise UserError(f"{path / name}: cannot be read ({type(e).__name__}: {e})") from None
    return source


def _deepspeed(path: Path, adapter: bool) -> Source:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its progress
        lazy = get_fp32_state_dict_from_zero_checkpoint(str(path), exclude_frozen_parameters=adapter, lazy_mode=True)
    source = Source(path, "deepspeed", adapter)
    for name, tensor in lazy.items():
        saved = saved_name(name) if adapter else name
        source._lazy[saved] = tensor
        source.shapes[saved] = (list(tensor.shape), dtype_name(tensor.dtype))
    return source


def _dcp(path: Path, adapter: bool) -> Source:
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(path / DCP_MODEL)).read_metadata()
    source = Source(path, "dcp", adapter)
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and hasattr(meta, "size"):
            source.shapes[key.removeprefix("model.")] = (list(meta.size), dtype_name(meta.properties.dtype))
    return source


def saved_name(live_name: str, adapter_name: str = "default") -> str:
    """A peft model's parameter name as its saved adapter names it (peft's get_peft_model_state_dict drops the adapter
    name): base_model.model.X.lora_A.default.weight -> base_model.model.X.lora_A.weight."""
    return live_name.replace(f".{adapter_name}.", ".")


def adapter_modules(names) -> dict[str, tuple[str, str]]:
    """module -> (its lora_A name, its lora_B name) from an adapter's saved names; UserError for any other tensor (DoRA
    magnitudes, embedding adapters, modules_to_save: not LoRA on a linear layer, which is all this merges)."""
    modules: dict[str, dict[str, str]] = {}
    other = []
    for name in names:
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if name.startswith(ADAPTER_PREFIX) and name.endswith(suffix):
                modules.setdefault(name[len(ADAPTER_PREFIX) : -len(suffix)], {})[part] = name
                break
        else:
            other.append(name)
    unpaired = [m for m, parts in modules.items() if len(parts) != 2]
    if other or unpaired:
        raise UserError(
            f"the adapter holds tensors that are not LoRA A/B pairs of linear layers "
            f"({', '.join((other + unpaired)[:3])}{' ...' if len(other) + len(unpaired) > 3 else ''}); "
            f"this merges plain LoRA only"
        )
    return {m: (parts["lora_A"], parts["lora_B"]) for m, parts in modules.items()}


def adapter_config(source: Source, method, base: str) -> dict:
    """The adapter's peft config: the one saved beside the weights (model/, and the checkpoints Trainer writes them
    into), else the run's method section as finetune/modeling/load.py add_lora built it, its target modules the ones
    the weights name (FSDP2 checkpoints hold the weights only)."""
    saved = source.path / "adapter_config.json"
    if saved.is_file():
        return json.loads(saved.read_text(encoding="utf-8")) | {"base_model_name_or_path": base}
    from peft import LoraConfig

    config = LoraConfig(
        r=method.lora_r,
        lora_alpha=method.lora_alpha,
        lora_dropout=method.lora_dropout,
        target_modules=sorted(adapter_modules(source.shapes)),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
    )
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}  # as peft saves it


def _safetensors(folder: Path, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files, _ = figures.weight_files(folder)
    where = {}
    for name, listed in files:
        with safe_open(str(folder / name), "pt") as f:
            where.update(dict.fromkeys(listed or f.keys(), name))
    handles: dict = {}
    with contextlib.ExitStack() as stack:
        for key in names:
            file = where[key]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(folder / file), "pt"))
            yield key, handles[file].get_tensor(key)


def _itemsize(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def dtype_name(dtype) -> str:
    """'float32' from torch.float32 or safetensors' 'F32'."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64", "I64": "int64"}.get(
        dtype, str(dtype).lower()
    )


def base_folder(run_dir: Path, cfg, recorded: dict) -> Path:
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
