"""`finetune export RUN [--checkpoint N] [--merge] [--dtype bf16|fp16|fp32] [--out DIR] [--max-shard-size SIZE]`
(docs/usage.md "Export"): a folder a server loads, from a run's model/ or any complete checkpoint of any strategy;
LoRA folded into the base with --merge, shard by shard; checked like the run's own save (the exported model against
the source loaded as its format is loaded, on the probe batch; every tensor) with the figures in export.json. Every
input is checked before anything is written; the folder is built beside --out and put in place once it passed.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune import precision, storage, units
from finetune.checkpointing import checkpoints
from finetune.errors import UserError
from finetune.export import figures, merge, reload, sources
from finetune.modeling.load import hub_id

MARKER = ".finetune-export"  # in every folder this command made: the only folders it replaces
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype (finetune/cli/dispatch.py)
DEFAULT_SHARD = 5 * units.GB  # without --max-shard-size, when no base shard sets the size
CHECK_TIMEOUT_S = 1800
# What run.json summary.status says of a run without model/ (it is written when the run ends)
STATUS_WORDS = {
    "running": ": the run ended without recording its end, killed, or is still running",
    "interrupted": ": it was stopped before writing model/; `finetune train ... --resume` continues it",
    "failed": ": it failed before writing model/ (run.json summary.error)",
    "completed": ": model/ was moved or deleted since",
}


@dataclass(frozen=True)
class Request:
    """An export, every input checked."""

    run_dir: Path
    cfg: object  # the run's saved configuration
    record: dict  # its run.json
    source: sources.Source
    step: int | None
    merge: bool
    out: Path
    dtype: str
    max_shard_bytes: float
    base: Path  # the base model's folder

    @property
    def adapter(self) -> bool:
        return self.cfg.method.name != "full"


def run(args, damage=None, hold=None) -> int:
    """The command: check the inputs, export, say where and what the check found. `damage(folder)`, `hold()`: drills
    (finetune/training/fault_injection.py)."""
    request = checked(args)
    print(f"finetune export: {request.source.describe()} -> {request.out}", flush=True)
    found = export(request, damage, hold)
    check = found["check"]
    said = (
        f"check {check['kind']}: loss {check['saved_loss']:.6g} vs {check['reference_loss']:.6g} "
        f"({check['reference']}), largest logit difference {check['max_logit_diff']:.3g} "
        f"(tolerance {check['logit_tolerance']:.3g}), {check['tensors']} tensors"
        if check.get("max_logit_diff") is not None
        else f"check {check['kind']}: {check['tensors']} tensors"
    )
    if not check["passed"]:
        print(
            f"error: the export failed its check ({said}): {'; '.join(check['problems'][:5])}\n"
            f"it is kept for inspection in {found['kept']}; {request.out} was not changed",
            file=sys.stderr,
        )
        return 1
    print(f"finetune export: {request.out} written and verified ({said})", flush=True)
    return 0


def checked(args) -> Request:
    """The request, or a UserError naming what is wrong; reads only."""
    from finetune.checkpointing.resume_config import saved_values
    from finetune.config.validate import build_config

    run_dir = Path(args.run).expanduser().resolve()
    if not _a_run(run_dir):
        raise UserError(_not_a_run(args.run, run_dir))
    _refuse_a_live_run(run_dir, args)
    values, saved = saved_values(run_dir)  # with the changes resumes made
    cfg = build_config(values, recipe=values.pop("recipe", None) or "custom", source=str(saved))
    if args.merge and cfg.method.name == "full":
        raise UserError(
            f"--merge: {run_dir} is a full fine-tune (method.name: full): its weights are the whole model already; "
            f"export it without --merge"
        )
    record = json.loads((run_dir / "run.json").read_text(encoding="utf-8")) if (run_dir / "run.json").is_file() else {}
    path, step = _source_path(run_dir, args.checkpoint, record)
    source = sources.open_source(path, adapter=cfg.method.name != "full")
    base = sources.base_folder(
        run_dir, cfg, record if step is None else (checkpoints.read_marker(path) or {}).get("run") or {}
    )
    out = Path(args.out).expanduser().resolve() if args.out else run_dir / "export"
    if out.exists() and not (out.is_dir() and (out / MARKER).is_file()):
        raise UserError(
            f"--out {out}: exists and was not made by finetune export (no {MARKER} in it); nothing was changed"
        )
    owned = [run_dir / "model", run_dir / "data", *run_dir.glob("checkpoint-*")]  # the run writes, rotates these
    inside = next((o for o in owned if o == out or o in out.parents), None)
    if inside is not None:
        raise UserError(
            f"--out {out}: inside {inside}, which the run wrote and replaces or deletes (a resume, checkpoint "
            f"rotation); choose a folder outside it (the default is {run_dir / 'export'}); nothing was changed"
        )
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise UserError(f"--out {out}: {blocker} is a file, not a folder; nothing was changed")
    dtype = DTYPES[args.dtype] if args.dtype else _config_dtype(base)
    if args.max_shard_size:
        shard = units.parse_size(args.max_shard_size, "--max-shard-size")
    else:
        shard = max((p.stat().st_size for p in base.glob("*.safetensors")), default=DEFAULT_SHARD)
    request = Request(run_dir, cfg, record, source, step, args.merge, out, dtype, shard, base)
    _check_space(request)
    return request


def _a_run(path: Path) -> bool:
    from finetune.launch import rundir

    return path.is_dir() and rundir.is_run_dir(path) and (path / "config.yaml").is_file()


def _refuse_a_live_run(run_dir: Path, args) -> None:
    """A run a live process holds (finetune/launch/run_lock.py) has no model/ yet, rotates its checkpoints and, with
    run.export: merged, writes RUN/export at its end: only a complete checkpoint named with --checkpoint, to an --out
    outside the run, is exported from it; else a UserError naming the live run and that command."""
    from finetune.launch import run_lock

    if run_lock.live_run(run_dir) is None:
        return
    note = run_lock.holder(run_dir)
    if note.get("pid") == os.getppid() and note.get("host") == socket.gethostname():
        return  # the run's own merge at its end (merge_after_training)
    out = Path(args.out).expanduser().resolve() if args.out else run_dir
    if args.checkpoint is not None and run_dir != out and run_dir not in out.parents:
        return
    complete = ", ".join(c.name for c in checkpoints.checkpoints(run_dir) if checkpoints.problem(c) is None)
    raise UserError(
        f"{run_dir}: a live run is writing it (pid {note.get('pid', '?')} on host {note.get('host', '?')}, started "
        f"{note.get('started', '?')}); its model/ is written when it ends. Export a complete checkpoint (now: "
        f"{complete or 'none'}) to a folder outside the run: `finetune export {shlex.quote(str(run_dir))} "
        f"--checkpoint N --out DIR`, or the run's model/ once it has ended; nothing was changed"
    )


def _not_a_run(given: str, path: Path) -> str:
    """What RUN is instead of a run directory, and the command that exports what the user meant: a folder inside a
    run (a checkpoint, model/) names its run."""
    from finetune.launch import rundir

    run = next((p for p in path.parents if _a_run(p)), None)
    if run is None and not path.exists():
        return f"{given}: no such folder (RUN is the directory finetune train made, runs/NAME)"
    if run is None:
        return f"{given}: not a run directory (no {rundir.MARKER} and config.yaml from finetune train)"
    step = checkpoints.step_of(path) if path.parent == run else None
    if step is not None:
        return (
            f"{given}: checkpoint {step} of the run {run}, not a run directory; export it with "
            f"`finetune export {shlex.quote(str(run))} --checkpoint {step}`"
        )
    return (
        f"{given}: inside the run {run}, not a run directory; export the run's model/ with "
        f"`finetune export {shlex.quote(str(run))}` (a checkpoint: --checkpoint N)"
    )


def _source_path(run_dir: Path, number: int | None, record: dict) -> tuple[Path, int | None]:
    """checkpoint-N (complete: its marker, every file's checksum), or model/ (unless it failed its check in the run),
    else the newest complete checkpoint, said with why model/ is not exported (`record`: run.json)."""
    if number is not None:
        ckpt = run_dir / f"checkpoint-{number}"
        if not ckpt.is_dir():
            found = ", ".join(p.name for p in checkpoints.checkpoints(run_dir)) or "none"
            raise UserError(f"--checkpoint {number}: {ckpt} does not exist (checkpoints of this run: {found})")
        problem = checkpoints.problem(ckpt)
        if problem:
            raise UserError(f"--checkpoint {number}: {ckpt} is not complete: {problem}")
        return ckpt, number
    model = run_dir / "model"
    failed = ((record.get("export") or {}).get("check") or {}).get("passed") is False
    if not failed and not figures.weight_files(model)[1]:
        return model, None
    why = "failed its check in the run (run.json export.check)" if failed else "holds no weights"
    if not model.exists():
        status = (record.get("summary") or {}).get("status") or "not recorded"
        why = f"does not exist (run.json summary.status: {status}{STATUS_WORDS.get(status, '')})"
    found = checkpoints.checkpoints(run_dir)
    complete = [c for c in reversed(found) if checkpoints.problem(c) is None]
    if not complete:
        each = "; ".join(f"{c.name}: {checkpoints.problem(c)}" for c in found) or "there are none"
        raise UserError(f"{run_dir}: nothing to export: model/ {why} and no checkpoint is complete ({each})")
    steps = ", ".join(str(checkpoints.step_of(c)) for c in reversed(complete))  # oldest first
    print(
        f"finetune export: {model} {why}; exporting the newest complete checkpoint {complete[0]} (complete "
        f"checkpoints: {steps}; another: `finetune export {shlex.quote(str(run_dir))} --checkpoint N`)",
        flush=True,
    )
    return complete[0], checkpoints.step_of(complete[0])


def _config_dtype(base: Path) -> str:
    values = json.loads((base / "config.json").read_text(encoding="utf-8"))
    dtype = values.get("dtype") or values.get("torch_dtype")
    return dtype if dtype in DTYPES.values() else "float32"


def _check_space(request: Request) -> None:
    """Refuse before writing when the filesystem of --out cannot hold the export."""
    if request.merge:
        weights = sources.open_source(request.base, adapter=False).bytes(getattr(torch, request.dtype))
    else:
        weights = request.source.bytes(getattr(torch, request.dtype) if not request.adapter else None)
    needed = weights + 64 * units.MIB  # and the tokenizer, the configs, the card
    where = next(p for p in (request.out, *request.out.parents) if p.exists())
    free = shutil.disk_usage(where).free
    if free < needed:
        raise UserError(
            f"--out {request.out}: not enough space on its filesystem ({where}): the export needs "
            f"{needed / units.GIB:.2f} GiB, {free / units.GIB:.2f} GiB are free; nothing was written"
        )


def export(request: Request, damage=None, hold=None) -> dict:
    """Write the folder beside --out, check it, and put it in place when it passed (else keep it beside, named);
    returns export.json's content (and `kept`: where a failed export is). A checkpoint deleted under it (a live run's
    rotation) fails it with a UserError, nothing at --out."""
    request.out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{request.out.name}.partial-", dir=request.out.parent))
    storage.as_umask_allows(partial)
    try:
        if hold is not None:
            hold()
        with tempfile.TemporaryDirectory(prefix="finetune-export-") as work:
            adapter_dir = _consolidated_adapter(request, Path(work)) if request.adapter else None
            written = _write(request, partial, adapter_dir)
            tokenizer = _tokenizer(request)
            tokenizer.save_pretrained(str(partial))
            if damage is not None:
                damage(partial)
            started = time.perf_counter()
            check = _check(request, partial, adapter_dir, written["expected"], tokenizer, Path(work))
            check["seconds"] = round(time.perf_counter() - started, 2)
    except BaseException as e:
        shutil.rmtree(partial, ignore_errors=True)  # made by mkdtemp above: only what this export wrote
        if isinstance(e, Exception):
            _source_kept(request, e)
        raise
    if not check["passed"]:  # the source the check loads again may have been deleted since it was read
        try:
            _source_kept(request, None)
        except UserError:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    found = _export_json(request, written, check)
    (partial / "export.json").write_text(json.dumps(found, indent=1), encoding="utf-8")
    (partial / "README.md").write_text(model_card(request, found), encoding="utf-8")
    (partial / MARKER).write_text("made by finetune export; the whole folder is replaced by the next export\n")
    if not check["passed"]:
        kept = _beside(request.out, ".unverified")
        partial.rename(kept)
        return found | {"kept": str(kept)}
    if request.out.exists():  # an earlier export (its marker was checked): replaced as a whole
        shutil.rmtree(request.out)
    partial.rename(request.out)
    return found


def _source_kept(request: Request, error: Exception | None) -> None:
    """A UserError when the checkpoint exported is gone or incomplete now: a live run rotated it out under the export
    (training.save_total_limit), which then failed on its missing files (`error`) or could not check against it."""
    if request.step is None:
        return
    problem = checkpoints.problem(request.source.path, verify=False)
    if problem is None:
        return
    limit = request.cfg.training.typed.save_total_limit
    why = f"the run rotates its checkpoints (training.save_total_limit={limit})" if limit else "it was changed"
    complete = ", ".join(c.name for c in checkpoints.checkpoints(request.run_dir) if checkpoints.problem(c) is None)
    raise UserError(
        f"--checkpoint {request.step}: {request.source.path} was deleted while it was exported (now: {problem}): "
        f"{why}. Export one it keeps (complete now: {complete or 'none'}), or its model/ once it has ended; nothing "
        f"was written to {request.out}"
    ) from error


def _beside(out: Path, suffix: str) -> Path:
    """`out` + suffix for a failed export: a folder of that name this command made is replaced, another is kept (the
    next free `-<n>` name is taken)."""
    for n in range(1, 1000):
        path = out.with_name(out.name + suffix + (f"-{n}" if n > 1 else ""))
        if not path.exists():
            return path
        if (path / MARKER).is_file():
            shutil.rmtree(path)
            return path
    raise UserError(f"{out}: no free name beside it for the failed export")


def _consolidated_adapter(request: Request, work: Path) -> Path:
    """The adapter as a peft folder (weights + adapter_config.json), from whichever layout the source has."""
    from safetensors.torch import save_file

    folder = work / "adapter"
    folder.mkdir()
    tensors = {name: t.contiguous() for name, t in request.source.tensors()}
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = sources.adapter_config(request.source, request.cfg.method, str(request.base))
    if hub_id(request.cfg.model.name_or_path):  # named as a server finds it: the hub id at the snapshot's commit
        config.update(base_model_name_or_path=request.cfg.model.name_or_path, revision=request.base.name)
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, default=str), encoding="utf-8")
    return folder


def _write(request: Request, folder: Path, adapter_dir: Path | None) -> dict:
    """The weights and the configs; what was written (for the check) and the merge's time and host memory."""
    from transformers import AutoConfig, GenerationConfig

    from finetune.telemetry import meter

    reset = meter.reset_vmhwm()
    before, started = meter.host_rss(), time.perf_counter()
    dtype = getattr(torch, request.dtype)
    if adapter_dir is not None and not request.merge:  # an adapter is small: one file, as peft saves it
        shutil.copy(adapter_dir / "adapter_config.json", folder)
        tensors = _adapter_tensors(adapter_dir)
        layout = [(name, list(t.shape), sources.dtype_name(t.dtype)) for name, t in tensors.items()]
        writer = merge.ShardWriter(folder, float("inf"), dtype, layout)
        for name, tensor in tensors.items():
            writer.add(name, tensor)
        (folder / writer.close()[0]).rename(folder / "adapter_model.safetensors")
        files = ["adapter_model.safetensors"]
    else:
        writer = merge.ShardWriter(folder, request.max_shard_bytes, dtype, _layout(request))
        for name, tensor in _weights(request, adapter_dir):
            writer.add(name, tensor)
        files = writer.close()
        config = AutoConfig.from_pretrained(request.base)
        config.dtype = request.dtype
        config.save_pretrained(str(folder))
        generation = request.base / "generation_config.json"
        (
            GenerationConfig.from_pretrained(request.base)
            if generation.is_file()
            else GenerationConfig.from_model_config(config)
        ).save_pretrained(str(folder))
    peak = meter.vmhwm() if reset else None
    return {
        "expected": writer.expected,
        "files": files,
        "bytes": writer.total,
        "seconds": round(time.perf_counter() - started, 2),
        "rss_before_gib": units.gib(before),
        "peak_rss_gib": units.gib(peak) if peak else None,
        "largest_file_gib": units.gib(max((p.stat().st_size for p in folder.glob("*.safetensors")), default=0)),
    }


def _adapter_tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(adapter_dir / "adapter_model.safetensors"))


def _weights(request: Request, adapter_dir: Path | None):
    """(name, tensor) of the model to write, one at a time: the base merged with the adapter, or the full source
    without the weights transformers ties (they are saved once)."""
    if request.merge:
        config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
        dequantize = None
        if request.cfg.method.name == "qlora":
            policy = _policy(request)
            dequantize = merge.requantizer(request.base, _quantization(request, policy), policy.load_dtype("qlora"))
        yield from merge.merged_tensors(
            request.base, _adapter_tensors(adapter_dir), merge.lora_config(config), dequantize
        )
        return
    tied = _tied(request.base)
    yield from request.source.tensors(name for name in request.source.shapes if name not in tied)


def _layout(request: Request) -> list[tuple[str, list, str]]:
    """(name, shape, dtype) of what _weights yields, in its order."""
    if request.merge:
        return merge.base_layout(request.base)
    tied = _tied(request.base)
    return [(name, shape, dtype) for name, (shape, dtype) in request.source.shapes.items() if name not in tied]


def _tied(base: Path) -> set[str]:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    return set(model.all_tied_weights_keys)


def _policy(request: Request) -> precision.Policy:
    """The precision policy the run trained under (run.json), else the CPU default."""
    return precision.get((request.record.get("precision") or {}).get("policy") or "32-true")


def _quantization(request: Request, policy: precision.Policy) -> dict:
    from finetune.modeling.load import quantization_config

    return quantization_config(request.cfg.method, getattr(torch, policy.compute_dtype)).to_dict()


def _tokenizer(request: Request):
    """The tokenizer the run trained with: model/'s (saved by the run, its pad token set), else loaded as the run
    loaded it (finetune/modeling/load.py)."""
    from transformers import AutoTokenizer

    from finetune.modeling.load import load_tokenizer

    saved = request.run_dir / "model"
    if (saved / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(saved))
    return load_tokenizer(request.cfg.model)


def _check(request: Request, folder: Path, adapter_dir: Path | None, expected: dict, tokenizer, work: Path) -> dict:
    """The exported folder in a fresh process (peft unimportable when it must load without it; an adapter on the base
    the reference loads, QLoRA's 4-bit) against the source loaded as its format is loaded in another; QLoRA merges:
    against the 4-bit base + adapter it trained as, and the difference from the original base + adapter reported."""
    import dataclasses

    from safetensors.torch import save_file

    from finetune.data import demo

    data = dataclasses.replace(request.cfg.data, path=demo.paths(request.cfg, request.run_dir)[0])
    batch = figures.probe_batch(data, tokenizer)
    save_file({k: v.contiguous() for k, v in batch.items()}, str(work / "probe.safetensors"))
    common = {"probe": str(work / "probe.safetensors"), "bytes": _bytes(request)}
    reference, what = _reference(request, adapter_dir)
    adapter_only = request.adapter and not request.merge  # loads on the base as the reference does (QLoRA: 4-bit)
    saved = (reference if adapter_only else {"dtype": request.dtype}) | {"folder": str(folder)}
    saved.update(stats=True, tokenizer=True, block_peft=not adapter_only)
    ref = reload.fresh(common | reference, work / "reference", CHECK_TIMEOUT_S)
    got = reload.fresh(common | saved, work / "saved", CHECK_TIMEOUT_S)
    tensor_problems, worst = figures.tensor_problems(expected, got.get("stats", {}))
    problems = list(got["problems"]) + tensor_problems
    for who, found in (("the source", ref), ("the export", got)):
        if found.get("load_error"):
            problems.append(f"{who} does not load: {found['load_error']}")
    if saved["block_peft"] and "peft" in got.get("loaded", []):
        problems.append("the export loaded with peft imported; it must load without")
    dtype = request.dtype
    section = {"kind": "reload", "why": "finetune export", "reference": what, "compute_dtype": dtype}
    section.update(probe=figures.describe_probe(batch, str(data.path)), tensors=len(expected))
    section.update(max_tensor_rel_diff=worst, device=got.get("device"))
    if "logits" in ref and "logits" in got:
        figs = figures.compare(
            (ref["loss"], ref["logits"]), (got["loss"], got["logits"]), batch["attention_mask"], dtype
        )
        if not figs.pop("within"):
            problems.append(
                f"the export computes other figures than {what}: largest logit difference "
                f"{figs['max_logit_diff']:.3g} (tolerance {figs['logit_tolerance']:.3g})"
            )
        section.update(figs)
        if request.merge and request.cfg.method.name == "qlora":
            original = reload.fresh(
                common | reference | {"quantization": None, "dtype": "float32"}, work / "original", CHECK_TIMEOUT_S
            )
            if "logits" in original:
                section["vs_original_base"] = figures.compare(  # reported, not judged: the quantization error
                    (original["loss"], original["logits"]),
                    (got["loss"], got["logits"]),
                    batch["attention_mask"],
                    dtype,
                )
                section["vs_original_base"].pop("within")
    if got.get("chat_template") != getattr(tokenizer, "chat_template", None):
        problems.append("the exported tokenizer's chat template is not the one the run trained with")
    return section | {"problems": problems, "passed": not problems}


def _reference(request: Request, adapter_dir: Path | None) -> tuple[dict, str]:
    """What the export is compared with, loaded as its format loads and in --dtype (so the two differ by the export's
    own roundings only; the 4-bit base in the dtype the run loaded it in), and its name in export.json."""
    if request.adapter:
        quantized = request.cfg.method.name == "qlora"
        policy = _policy(request)
        ask = {"folder": str(adapter_dir), "base": str(request.base), "dtype": request.dtype}
        if quantized:
            ask.update(quantization=_quantization(request, policy), dtype=policy.load_dtype("qlora"))
        return ask, "the 4-bit base + adapter (peft), as trained" if quantized else "the base + adapter (peft)"
    source = request.source
    if source.format == "safetensors" and (source.path / "config.json").is_file():
        return {"folder": str(source.path), "dtype": request.dtype}, f"{source.path.name} (transformers)"
    return {"folder": str(request.base), "consolidated": str(source.path), "dtype": request.dtype}, source.describe()


def _bytes(request: Request) -> int:
    return sources.open_source(request.base, adapter=False).bytes(torch.float32 if request.adapter else None)


def _export_json(request: Request, written: dict, check: dict) -> dict:
    merged = request.merge
    qlora = merged and request.cfg.method.name == "qlora"
    return {
        "made_by": "finetune export",
        "run": str(request.run_dir),
        "source": request.source.describe(),
        "step": request.step if request.step is not None else request.record.get("summary", {}).get("steps"),
        "method": request.cfg.method.name,
        "merged": merged,
        "dequantized_base": qlora,
        "dtype": request.dtype,
        "files": written["files"],
        "bytes": written["bytes"],
        "max_shard_bytes": int(request.max_shard_bytes),
        "write": {k: written[k] for k in ("seconds", "rss_before_gib", "peak_rss_gib", "largest_file_gib")},
        "check": check,
    }


def model_card(request: Request, found: dict) -> str:
    """README.md: what the folder is, drawn from run.json and the check."""
    cfg, summary, check = request.cfg, request.record.get("summary", {}), found["check"]
    steps = [s for s in request.record.get("steps", []) if s.get("loss") is not None]
    loss = summary.get("train_loss") or (steps[-1]["loss"] if steps else None)
    method = cfg.method.name + (f" (r {cfg.method.lora_r}, alpha {cfg.method.lora_alpha})" if request.adapter else "")
    if request.merge:
        method += ", merged into the " + ("dequantized 4-bit base" if found["dequantized_base"] else "base")
    figs = (
        f"loss {check['saved_loss']:.6g} vs {check['reference_loss']:.6g}, largest logit difference "
        f"{check['max_logit_diff']:.3g} (tolerance {check['logit_tolerance']:.3g})"
        if check.get("max_logit_diff") is not None
        else ""
    )
    lines = [
        "---",
        f"base_model: {cfg.model.name_or_path}",
        "library_name: " + ("peft" if request.adapter and not request.merge else "transformers"),
        "---",
        f"# {request.run_dir.name}",
        "",
        f"- base model: {cfg.model.name_or_path}",
        f"- method: {method}",
        f"- data: {cfg.data.path}",
        f"- steps: {found['step']}, final train loss {loss if loss is not None else 'n/a'}",
        f"- exported from: {found['source']}, weights in {found['dtype']}",
        f"- check ({check['kind']}, against {check['reference']}): {'passed' if check['passed'] else 'FAILED'}; {figs}",
        *(
            [
                f"- load it on the base quantized as it trained: BitsAndBytesConfig(load_in_4bit=True, "
                f"bnb_4bit_quant_type={cfg.method.quant_type!r}, bnb_4bit_use_double_quant={cfg.method.double_quant})"
            ]
            if cfg.method.name == "qlora" and not request.merge
            else []
        ),
        "",
        "Written by `finetune export` from the run's run.json; the check's figures are in export.json.",
    ]
    return "\n".join(lines) + "\n"


def earlier_export(run_dir: Path) -> str | None:
    """What a run that wrote a new model/ says of RUN/export when this command made it (its default --out): it holds
    the model/ before, a resumed run's, not this one; None when there is none, or the folder is not this command's."""
    folder = run_dir / "export"
    if not (folder / MARKER).is_file():
        return None
    return f"{folder} holds an export of the model/ before this run's; `finetune export {shlex.quote(str(run_dir))}` renews it"


def merge_after_training(run_dir: Path) -> dict:
    """run.export: merged, at the end of a run (rank 0): `finetune export RUN --merge` in its own process (its memory
    is not the training process's); export.json's content, or RuntimeError with what it said."""
    env = reload.clean_environment()
    cmd = [sys.executable, "-m", "finetune.cli", "export", str(run_dir), "--merge"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the merged export failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads((run_dir / "export" / "export.json").read_text(encoding="utf-8")) | {
        "folder": str(run_dir / "export")
    }
