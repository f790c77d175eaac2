"""The check of a run's final save (run.verify_export; docs/run_record.md `export.check`), run on every rank right
after model/ is written: the live model's loss and logits on the probe batch (a forward every rank joins: ZeRO-3 and
FSDP2 gather in it) and its tensors, gathered one at a time; then rank 0 either loads model/ in a fresh process the
way a user would (`reload`: reload.py) and compares figures and tensors, or, where the machine cannot hold a second
copy, reads the saved tensors one at a time against the live ones (`stream`). What it found is returned on rank 0;
a save that does not hold raises there (finetune/training/endings.py agrees it on every rank).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from finetune.export import figures, reload, sources

RELOAD_TIMEOUT_S = 1200  # the fresh process: loading the model and one forward of 128 positions


@dataclass(frozen=True)
class ExportCheck:
    """What the check needs from the run, worked out once before training ends."""

    mode: str  # run.verify_export: auto | reload | stream | off
    data: Any  # the data section, its path resolved (the demo's generated file)
    compute_dtype: str  # the precision policy's: the tolerance's dtype
    load_dtype: str  # what the fresh process loads in: an adapter's base as the run did; full weights as saved (auto)
    adapter: bool
    base: str  # the base model's folder (an adapter's base)
    quantization: dict | None  # QLoRA: the 4-bit base's BitsAndBytesConfig, as the run loaded it
    no_forward: str | None  # why the live model cannot take the whole probe rows (sequence or context shards)
    tensor_parallel: bool  # AutoTP splits the weights: the tensors are not gathered one at a time
    merged: bool  # run.export: merged

    @classmethod
    def for_run(cls, run) -> ExportCheck:
        """From a run's resolved configuration, its launch and its data file (finetune/training/run.py Run)."""
        from finetune.modeling import load
        from finetune.precision import torch_dtype

        cfg, launch = run.cfg, run.launch
        policy, method = launch.policy, cfg.method
        quantization = None
        if method.name == "qlora":
            quantization = load.quantization_config(method, torch_dtype(policy.compute_dtype)).to_dict()
        sharded = [f"{k} {v}" for k, v in (("sp", launch.mesh.sp), ("cp", launch.mesh.cp)) if v > 1]
        name = load.resolve_model_path(cfg.model.name_or_path)  # a hub id's: the snapshot at model.revision
        return cls(
            mode=cfg.run.verify_export,
            data=dataclasses.replace(cfg.data, path=run.data_path),
            compute_dtype=policy.compute_dtype,
            load_dtype="auto" if method.name == "full" else policy.load_dtype(method.name),
            adapter=method.name != "full",
            base=str(load.model_folder(name, cfg.model.revision) or name),
            quantization=quantization,
            no_forward=f"the live model takes sequence shards ({', '.join(sharded)})" if sharded else None,
            tensor_parallel=launch.mesh.tp > 1,
            merged=cfg.run.export == "merged",
        )


def probe(check: ExportCheck, tokenizer) -> dict | None:
    """The probe batch (every rank builds the same from the run's data file), before the save: a rank that cannot
    read it fails at that step's boundary, not inside the forward every rank joins. None when the check is off."""
    return None if check.mode == "off" else figures.probe_batch(check.data, tokenizer)


@contextlib.contextmanager
def started_ahead(check: ExportCheck, main: bool):
    """Rank 0 of a run that saves, from training's start to the run's end: the check's fresh process started ahead
    (finetune/export/reload.py `start`), importing while the run trains and saves, where the check will reload
    (run.verify_export reload, or auto where the free host memory holds twice the base's weights now); else None.
    verify() hands it the request; one left unused is ended on the way out. A process that cannot be started is not
    started ahead: the check starts its own when it runs, as it does without one."""
    warm = None
    if main and check.mode in ("reload", "auto") and not (check.mode == "auto" and check.no_forward):
        import psutil

        needed = 2 * _weights_bytes(Path(check.base)) * reload.HOST_MARGIN
        if check.mode == "reload" or psutil.virtual_memory().available >= needed:
            with contextlib.suppress(OSError):  # no process to spare now (fork refused): started when needed
                warm = reload.start(kept_out())
    try:
        yield warm
    finally:
        reload.stop(warm)


def kept_out() -> list[str]:
    """What the run kept out of this process (finetune/training/rank_imports.py): loading its save needs none."""
    return [name for name, module in sys.modules.items() if module is None and "." not in name]


def verify(trainer, model_dir: Path, tokenizer, check: ExportCheck, batch: dict | None, warm=None) -> dict | None:
    """On every rank, after model/ is written: run.json `export.check` on rank 0 (None elsewhere); raises
    ExportCheckFailed on rank 0 when the save does not hold. `warm`: rank 0's started_ahead(), used or ended here."""
    if check.mode == "off":
        return {"kind": "off", "why": "run.verify_export: off", "passed": None} if _main(trainer) else None
    started = time.perf_counter()
    main = _main(trainer)
    live = None if check.no_forward else _live_forward(trainer, batch)
    kind, why = _kind(check, model_dir) if main else (None, None)
    expected, stream = {}, _Stream(model_dir) if kind == "stream" else None
    for name, tensor in _live_tensors(trainer.model, check):  # every rank: gathers
        if main:
            expected[name] = figures.summary(tensor)
            if stream:
                stream.compare(name, tensor)
    if not main:
        return None
    section = {"kind": kind, "why": why, "reference": "the live model", "compute_dtype": check.compute_dtype}
    section["probe"] = figures.describe_probe(batch, str(check.data.path))
    if kind == "reload":
        found = _reload(check, model_dir, batch, warm)
        section.update(_judged(found, live, batch, check, expected, tokenizer))
    else:
        reload.stop(warm)
        section.update(stream.result(live, len(expected)))
        if check.tensor_parallel:
            section["problems"].append(
                "stream: the weights are split by tensor parallelism; use run.verify_export: reload"
            )
    section.update(passed=not section["problems"], seconds=round(time.perf_counter() - started, 2))
    if section["problems"]:
        raise ExportCheckFailed(section)
    return section


class ExportCheckFailed(RuntimeError):
    """The saved model does not hold what trained: the message names each problem; `section` is run.json
    `export.check`."""

    def __init__(self, section: dict):
        shown = "; ".join(section["problems"][:5]) + (" ..." if len(section["problems"]) > 5 else "")
        super().__init__(f"the saved model failed its check ({section['kind']}): {shown}")
        self.section = section


def _main(trainer) -> bool:
    return trainer.accelerator.is_main_process


def _kind(check: ExportCheck, model_dir: Path) -> tuple[str, str]:
    """Which check runs, and why: run.verify_export, else (auto) `reload` when the host holds a second copy."""
    if check.mode in ("reload", "stream"):
        return check.mode, f"run.verify_export: {check.mode}"
    if check.no_forward:
        return "stream", check.no_forward
    import psutil

    needed = _weights_bytes(model_dir) + (_weights_bytes(Path(check.base)) if check.adapter else 0)
    free = psutil.virtual_memory().available
    enough = free >= needed * reload.HOST_MARGIN or check.tensor_parallel
    verdict = "holds" if enough else "cannot hold"
    why = (
        f"auto: {free / 2**30:.1f} GiB of free host memory {verdict} a second copy of the weights "
        f"({needed / 2**30:.2f} GiB x {reload.HOST_MARGIN})"
    )
    return ("reload" if enough else "stream"), why


def _weights_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))


def _live_forward(trainer, batch) -> tuple[float, torch.Tensor]:
    """The probe's loss and logits from the live model (every rank; the torch family autocasts as training did)."""
    model = trainer.model
    was_training = model.training
    model.eval()
    try:
        with trainer.accelerator.autocast():
            return figures.forward(model, batch, trainer.args.device, None, whole=_whole_vocabulary(model))
    finally:
        model.train(was_training)
        if hasattr(model, "reshard"):  # FSDP2 keeps the root's parameters unsharded after a forward: back to shards
            model.reshard()


def _whole_vocabulary(model):
    """AutoTP's vocabulary-parallel output head (DeepSpeed's VocabParallelLinear, which tensor parallelism puts in
    training mode) leaves each rank the logits of its share of the vocabulary, in rank order: a function gathering
    them over the head's group (every rank calls it), or None for any other head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not getattr(head, "is_vocab_parallel_lm_head", False):
        return None
    import torch.distributed as dist

    def whole(logits: torch.Tensor) -> torch.Tensor:
        group, ranks = head.mp_group, head.tp_world_size
        widths = [torch.zeros(1, dtype=torch.long, device=logits.device) for _ in range(ranks)]  # NCCL: on the device
        dist.all_gather(widths, torch.tensor([logits.shape[-1]], device=logits.device), group=group)
        widest = max(int(w) for w in widths)
        padded = torch.nn.functional.pad(logits, (0, widest - logits.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(ranks)]
        dist.all_gather(parts, padded, group=group)
        out = torch.cat([part[..., : int(w)] for part, w in zip(parts, widths, strict=True)], dim=-1)
        if out.shape[-1] != head.vocab_size:
            raise RuntimeError(f"the gathered logits have {out.shape[-1]} columns, the vocabulary {head.vocab_size}")
        return out

    return whole


def _live_tensors(model, check: ExportCheck):
    """(saved name, the whole tensor on the CPU) of each parameter the save holds, gathered one at a time on every
    rank: ZeRO-3 partitions (GatheredParameters), FSDP2 DTensor shards (full_tensor); none under tensor parallelism."""
    if check.tensor_parallel:
        return
    for name, p in model.named_parameters():
        if check.adapter and not p.requires_grad:
            continue  # the frozen base: not in the adapter
        saved = sources.saved_name(name) if check.adapter else name
        if hasattr(p, "ds_id"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                yield saved, p.data.detach().cpu().clone()
        elif hasattr(p, "full_tensor"):
            yield saved, p.full_tensor().detach().cpu()
        else:
            yield saved, p.detach().cpu()


def _reload(check: ExportCheck, model_dir: Path, batch, warm=None) -> dict:
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="finetune-export-check-") as tmp:
        save_file({k: v.contiguous() for k, v in batch.items()}, str(Path(tmp) / "probe.safetensors"))
        request = {
            "folder": str(model_dir),
            "base": check.base if check.adapter else None,
            "quantization": check.quantization,
            "dtype": check.load_dtype,
            "autocast": None if check.compute_dtype == "float32" else check.compute_dtype,
            "probe": str(Path(tmp) / "probe.safetensors"),
            "stats": True,
            "tokenizer": True,
            "bytes": _weights_bytes(model_dir) + (_weights_bytes(Path(check.base)) if check.adapter else 0),
            "keep_out": kept_out(),
        }
        return reload.fresh(request, Path(tmp) / "out", RELOAD_TIMEOUT_S, warm)


def _judged(found: dict, live, batch, check: ExportCheck, expected: dict, tokenizer) -> dict:
    """The fresh process's findings against the live model: figures, tensors, the tokenizer."""
    tensor_problems, worst = figures.tensor_problems(expected, found.get("stats", {}))
    problems = list(found["problems"]) + tensor_problems
    if found.get("load_error"):
        problems.append(f"model/ does not load: {found['load_error']}")
    out = {"tensors": len(expected), "max_tensor_rel_diff": worst, "device": found.get("device")}
    if "logits" in found and live is not None:
        figs = figures.compare(live, (found["loss"], found["logits"]), batch["attention_mask"], check.compute_dtype)
        if not figs.pop("within"):
            problems.append(
                f"the reloaded model computes other figures: loss {figs['saved_loss']:.6g} vs {figs['reference_loss']:.6g}"
                f" live, largest logit difference {figs['max_logit_diff']:.3g} (tolerance {figs['logit_tolerance']:.3g})"
            )
        out.update(figs)
    else:
        out.update(dict.fromkeys(("saved_loss", "max_logit_diff", "logit_tolerance", "loss_tolerance")))
        out.update(reference_loss=live[0] if live else None, saved_loss=found.get("loss"))
    if "chat_template" in found and found["chat_template"] != getattr(tokenizer, "chat_template", None):
        problems.append("the saved tokenizer's chat template is not the one the run trained with")
    return out | {"problems": problems}


class _Stream:
    """Rank 0's reading of the saved tensors against the live ones, one at a time (the `stream` check)."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        self.stack = contextlib.ExitStack()
        self.where: dict[str, Any] = {}
        self.problems: list[str] = []
        self.worst = 0.0
        files, self.problems = figures.weight_files(model_dir)
        for name, _ in files:
            try:
                handle = self.stack.enter_context(safe_open(str(Path(model_dir) / name), "pt"))
                self.where.update(dict.fromkeys(handle.keys(), handle))
            except Exception as e:  # noqa: BLE001 - a damaged file is a finding
                self.problems.append(f"{name}: cannot be read ({type(e).__name__}: {e})")

    def compare(self, name: str, live: torch.Tensor) -> None:
        handle = self.where.get(name)
        if handle is None:
            self.problems.append(f"missing tensor {name} (the trained model has one of shape {list(live.shape)})")
            return
        try:
            saved = handle.get_tensor(name)
        except Exception as e:  # noqa: BLE001 - a damaged tensor is a finding
            self.problems.append(f"tensor {name} cannot be read ({type(e).__name__}: {e})")
            return
        if saved.shape != live.shape:
            what = "empty tensor" if saved.numel() == 0 else "tensor"
            self.problems.append(f"{what} {name}: shape {list(saved.shape)}, the trained one is {list(live.shape)}")
            return
        diff, largest = figures.largest_difference(saved, live)
        self.worst = max(self.worst, diff / max(largest, 1e-30))
        bound = figures.rounding(_dtype(saved), _dtype(live))
        if diff > bound * largest:
            self.problems.append(
                f"tensor {name} differs from the trained one by up to {diff:.3g} (largest |w| {largest:.3g})"
            )

    def result(self, live, compared: int) -> dict:
        """export.check's fields of a stream check: the problems and the largest relative difference; the live loss."""
        self.stack.close()
        none = dict.fromkeys(("saved_loss", "max_logit_diff", "logit_tolerance", "loss_tolerance", "device"))
        return none | {
            "problems": self.problems,
            "tensors": compared,
            "max_tensor_rel_diff": self.worst,
            "reference_loss": live[0] if live else None,
        }


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")
