"""Resuming under another launch: what wrote the checkpoint, what this launch sets up, what is refused, and how the
effective batch and the data position are kept (docs/faults.md "Resume on another number of GPUs").

    written = read(ckpt)                       the marker's `run` block (finetune/checkpointing/provenance.py)
    p = plan(written, launch_from(cfg, ...))   pure: every refusal at once (ConfigError, exit 2), or the plan
    cfg = applied(p, cfg)                      a new configuration: accumulation, per-device batch, run.strategy
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from finetune.batch import effective_batch
from finetune.checkpointing import checkpoints, provenance
from finetune.checkpointing.provenance import Written, data_order_settings, method_identity, model_identity, read
from finetune.config.sections import TrainingArgs
from finetune.errors import ConfigError, UserError
from finetune.launch.plan import LaunchPlan
from finetune.modeling.load import hub_id, model_folder
from finetune.strategies import by_name, by_recipe

log = logging.getLogger("finetune")

TRIVIAL_MESH = {"sp": 1, "tp": 1, "cp": 1}
# Data-loader settings under which the rows of a step depend on the layout: the value that breaks it.
ACCELERATOR_ORDER = {
    "split_batches": True,
    "dispatch_batches": True,
    "even_batches": False,
    "use_seedable_sampler": False,
}


@dataclass
class ResumeRequest:
    """What this launch asks of the checkpoint it resumes (`launch_from`)."""

    strategy: str
    offload: str
    world_size: int
    per_device: int
    grad_accum: int
    explicit: dict  # training fields given on this command line (per_device_train_batch_size, ...)
    method: dict
    model: dict
    data: dict  # data_order_settings()
    training: TrainingArgs  # cfg.training.typed
    lora_dropout: float = 0.0
    mesh: dict = field(default_factory=lambda: dict(TRIVIAL_MESH))  # {sp, tp, cp} (finetune/mesh.py)
    inputs: dict | None = None  # provenance.inputs() of this launch (None: not compared)
    allow_input_change: bool = False  # --allow-input-change
    revision: str | None = None  # a hub model's snapshot pinned: the one trained on (provenance.trained_revision)

    @property
    def data_parallel(self) -> int:
        """Ranks that take their own micro-batches: world / (sp x tp x cp)."""
        return max(1, self.world_size // math.prod(self.mesh.values()))


@dataclass
class ResumePlan:
    checkpoint: str
    step: int
    written: dict  # {world_size, strategy, offload, per_device, grad_accum, effective}
    world_size: int
    strategy: str
    offload: str
    per_device: int
    grad_accum: int
    effective: int | None
    reshard: str  # none | replicated | dcp | universal
    rng: str  # restored | partial | fresh
    rng_ranks: list[int]  # new ranks that continue the old rank's stream of the same number
    position: dict | None  # {epoch, samples_into_epoch, samples_per_epoch}
    data: dict | None  # the checkpoint's data block, checked once the data is built
    notes: list[str] = field(default_factory=list)
    data_parallel: int | None = None  # data-parallel ranks of this launch (None: the world size)
    input_changes: list[dict] = field(default_factory=list)  # provenance.input_changes, allowed by --allow-input-change
    inputs_compared: bool = False  # the checkpoint and this launch both recorded their inputs
    revision: str | None = None  # model.revision pinned to the cached snapshot trained on (refs/main moved since)

    @property
    def effective_now(self) -> int:
        """The effective batch under this launch (the checkpoint's, unless it did not record one)."""
        return effective_batch(self.per_device, self.grad_accum, self.data_parallel or self.world_size)

    @property
    def notable(self) -> bool:
        """Said as a warning: the layout changes (accumulation recomputed, states resharded), or the base's snapshot is
        pinned to the one trained on."""
        return self.reshard != "none" or self.layout_changed or bool(self.revision)

    @property
    def layout_changed(self) -> bool:
        keys = ("world_size", "per_device", "grad_accum")
        return tuple(getattr(self, k) for k in keys) != tuple(self.written[k] for k in keys)


def launch_from(
    cfg,
    *,
    strategy: str,
    offload: str,
    world_size: int,
    overrides: list[str],
    inputs: dict | None = None,
    allow_input_change: bool = False,
    revision: str | None = None,
) -> ResumeRequest:
    from finetune.config.recipe import parse_overrides

    par = cfg.parallel
    explicit = parse_overrides(list(overrides))[0].get("training", {})
    a = cfg.training.typed
    return ResumeRequest(
        strategy=strategy,
        offload=offload,
        world_size=world_size,
        per_device=a.per_device_train_batch_size,
        grad_accum=a.gradient_accumulation_steps,
        explicit=explicit,
        method=method_identity(cfg.method),
        model=model_identity(cfg.model),
        data=data_order_settings(cfg),
        training=a,
        lora_dropout=float(cfg.method.lora_dropout if cfg.method.name != "full" else 0.0),
        mesh={"sp": par.sp_size, "tp": par.tp_size, "cp": par.cp_size},
        inputs=inputs,
        allow_input_change=allow_input_change,
        revision=revision,
    )


# --- the plan ------------------------------------------------------------------------------------------


def allowed_world_sizes(effective: int, per_device: int) -> list[int]:
    """Process counts M with M x per_device dividing the effective batch."""
    if effective % per_device:
        return []
    return [m for m in range(1, effective // per_device + 1) if (effective // per_device) % m == 0]


def plan(w: Written, launch: ResumeRequest) -> ResumePlan:
    # M, N: processes now and then (states, RNG streams); D: data-parallel ranks now (the batch arithmetic)
    name, M, N, D = Path(w.checkpoint).name, launch.world_size, w.world_size, launch.data_parallel
    problems: list[str] = _mesh_problems(name, w, launch)
    old_family, new_family = _family(w.strategy), _family(launch.strategy)
    if w.strategy is not None and old_family != new_family:
        problems.append(
            f"{name} was written by {w.strategy} ({N} rank(s)); this launch sets up {launch.strategy} "
            f"({M} process(es)). A checkpoint resumes only under its own strategy family (single/ddp, "
            f"zero2, zero3, fsdp; offload may differ): launch with {_config_of(w.strategy)} "
            f"(any --num_processes)"
        )
    problems += _identity_problems(name, "method", w.method, launch.method)
    changes = provenance.input_changes(w.inputs, launch.inputs)
    refused = [c["said"] for c in changes if c["input"] != "settings"]  # settings: --allow-config-change's
    if refused and not launch.allow_input_change:
        fix = "Resume with the inputs it was trained with (put them back)"
        model = launch.model.get("name_or_path") or ""
        folder = model_folder(model, launch.model.get("revision")) if hub_id(model) else None
        if folder is not None and any(c["input"] == "weights" for c in changes):
            fix = f"{model}: {provenance.no_trained_snapshot(model, folder, w.inputs)}"
        problems.append(
            f"{name} was trained on other inputs: {'; '.join(refused)}. {fix}, or add --allow-input-change to "
            "continue on these (recorded in run.json resumes[])"
        )
    elif not ((w.inputs or {}).get("weights") and (launch.inputs or {}).get("weights")):
        # compared by content (config.json and weights) above: a moved copy of the same base is the same model; the
        # name and the config's SHA-256 only where the content was not fingerprinted on both sides
        problems += _identity_problems(name, "model", w.model, launch.model)
    per_device, grad_accum = _batch_layout(name, w, launch, problems)
    E = w.effective
    # (a checkpoint that does not record its per-device batch is taken to keep it: only M can tell)
    layout = (M, per_device, grad_accum) != (N, w.per_device or per_device, w.grad_accum or grad_accum)
    problems += _order_problems(name, w, launch, layout)
    position = None
    skips = not launch.training.ignore_data_skip  # otherwise Trainer starts the epoch over: no position
    if not problems and E is not None and w.data and w.data.get("train_rows") and skips:
        position, problem = _position(name, w, D, per_device, grad_accum)
        problems += [problem] if problem else []
    if problems:
        raise ConfigError(problems, f"--resume {w.checkpoint} (nothing was loaded)")
    ranks = [r for r in range(M) if rng_source_file(r, N) in w.files]
    state = "restored" if M == N and len(ranks) == M else "partial" if ranks else "fresh"
    notes = []
    if M != N and launch.lora_dropout > 0:
        notes.append(
            f"method.lora_dropout {launch.lora_dropout} > 0: across a world-size change the per-rank random "
            f"streams differ, so losses continue statistically, not bitwise"
        )
    return ResumePlan(
        checkpoint=w.checkpoint,
        step=w.step,
        written=dict(
            world_size=N,
            strategy=w.strategy,
            offload=w.offload,
            per_device=w.per_device,
            grad_accum=w.grad_accum,
            effective=E,
        ),
        world_size=M,
        strategy=launch.strategy,
        offload=launch.offload,
        per_device=per_device,
        grad_accum=grad_accum,
        effective=E,
        reshard=_reshard(launch.strategy, M != N, w.offload, launch.offload),
        rng=state,
        rng_ranks=ranks,
        position=position,
        data=w.data,
        notes=notes,
        data_parallel=D,
        input_changes=changes,
        inputs_compared=bool(w.inputs and launch.inputs),
        revision=launch.revision,
    )


def _batch_layout(name: str, w: Written, launch: ResumeRequest, problems: list[str]) -> tuple[int, int]:
    """(per-device batch, accumulation) that keep the checkpoint's effective batch under this launch;
    what makes that impossible is added to `problems`."""
    M, N, D = launch.world_size, w.world_size, launch.data_parallel
    per_device = launch.explicit.get("per_device_train_batch_size", w.per_device or launch.per_device)
    E = w.effective
    if E is None:  # an old checkpoint: only its own layout is known to work
        if M != N:
            problems.append(
                f"{name} does not record its batch layout ({w.source}), so it resumes only under the "
                f"world size that wrote it: --num_processes {N}"
            )
        return per_device, launch.explicit.get("gradient_accumulation_steps", launch.grad_accum)
    if E % (D * per_device):
        allowed = allowed_world_sizes(E, per_device)
        use = f"--num_processes {' or '.join(map(str, allowed))}, or set " if allowed else "set "
        problems.append(
            f"{name} trained at effective batch {E} = {N} rank(s) x {w.per_device} per device x "
            f"accumulation {w.grad_accum}; {_ranks(D, M)} x {per_device} per device cannot make {E} "
            f"({E}/{D * per_device} is not a whole accumulation). Use {use}"
            f"--training.per_device_train_batch_size so that processes x per-device divides {E}"
        )
        return per_device, launch.grad_accum
    grad_accum = E // (D * per_device)
    given = launch.explicit.get("gradient_accumulation_steps")
    if given is not None and given != grad_accum:
        problems.append(
            f"--training.gradient_accumulation_steps={given} contradicts {name}'s effective batch "
            f"{E}: {D} x {per_device} x {given} = {D * per_device * given}; leave it out (on resume it "
            f"is recomputed, here {grad_accum}) or make the product {E}"
        )
    return per_device, grad_accum


def _ranks(data_parallel: int, processes: int) -> str:
    if data_parallel == processes:
        return f"{processes} process(es)"
    return f"{data_parallel} data-parallel rank(s) ({processes} processes)"


def _mesh_problems(name: str, w: Written, launch: ResumeRequest) -> list[str]:
    """A checkpoint resumes under the mesh that wrote it, at the world size that wrote it when that
    mesh splits anything: its states are laid out per sequence/tensor-parallel rank, and no resharding
    of Ulysses or AutoTP states is known to work here (DeepSpeed's universal checkpoint is not shown to)."""
    old = {**TRIVIAL_MESH, **(w.mesh or {})}
    new = launch.mesh
    same = f"--num_processes {w.world_size} " + " ".join(f"--parallel.{k}_size={v}" for k, v in old.items())
    if old != new:
        return [
            f"{name} was written under the mesh sp {old['sp']} x tp {old['tp']} x cp {old['cp']} on {w.world_size} "
            f"rank(s); this launch asks for sp {new['sp']} x tp {new['tp']} x cp {new['cp']}. Its states are laid "
            f"out for its own mesh and are not resharded across meshes; resume with {same} (the effective batch "
            f"and data position are kept under it)"
        ]
    if old != TRIVIAL_MESH and launch.world_size != w.world_size:
        return [
            f"{name} was written under the mesh sp {old['sp']} x tp {old['tp']} x cp {old['cp']} on {w.world_size} "
            f"rank(s); this launch has {launch.world_size} process(es). Under a mesh a checkpoint resumes only at "
            f"its own world size (Ulysses/AutoTP states are not resharded here); resume with {same}"
        ]
    return []


def _family(strategy: str | None) -> str | None:
    """The strategy row's checkpoint family (finetune/strategies.py); None for a name no row has."""
    row = by_name(strategy)
    return row.checkpoint_family if row else None


def _reshard(strategy: str, world_changes: bool, old_offload: str | None, new_offload: str) -> str:
    """How the states reach this launch (the strategy row's `reshard`; whole states for a name no row has).
    DeepSpeed also goes through the universal checkpoint when only the offload changes: that is the path shown to
    work across offload (ZeRO-2 -> ZeRO-2 with the optimizer offloaded, measured on CPU); its own loader is not."""
    row = by_name(strategy)
    how = row.reshard if row else "replicated"
    if how == "universal" and old_offload not in (None, new_offload):
        return "universal"
    return how if world_changes else "none"


def _config_of(strategy: str) -> str:
    row = by_recipe(strategy, "none")
    return row.accelerate_config if row else f"the {strategy} accelerate config"


def _identity_problems(name: str, what: str, old: dict | None, new: dict) -> list[str]:
    if not old:
        return []
    keys = [k for k in old if k in new and old[k] is not None and new[k] is not None and old[k] != new[k]]
    if not keys:
        return []

    def short(v):  # a SHA-256 by its first 12 hex digits
        return v[:12] if isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v) else v

    diff = "; ".join(f"{k}: {short(old[k])!r} in the checkpoint, {short(new[k])!r} now" for k in keys)
    return [f"{name} was trained with another {what} ({diff}); resume with the {what} it was trained with"]


def _order_problems(name: str, w: Written, launch: ResumeRequest, layout: bool) -> list[str]:
    problems = []
    data = w.data or {}
    for key, flag in (("seed", "training.seed"), ("data_seed", "training.data_seed")):
        if key in data and data[key] != launch.data.get(key):
            problems.append(
                f"{flag} is {launch.data.get(key)!r} but {name} was trained with {data[key]!r}: the data "
                f"order, and so the position resumed at, depends on it; resume with --{flag}={data[key]}"
            )
    if not layout:
        return problems
    why = f"the layout changes ({w.world_size} -> {launch.world_size} process(es))"
    a = launch.training
    if a.dataloader_drop_last:
        problems.append(
            f"training.dataloader_drop_last: true and {why}: the number of steps per epoch depends on "
            f"the world size and per-device batch, so the data position cannot be kept"
        )
    if a.train_sampling_strategy not in ("random", "sequential"):
        problems.append(
            f"training.train_sampling_strategy: {a.train_sampling_strategy} and {why}: its order depends "
            f"on per-device batch x accumulation (LengthGroupedSampler) or on the ranks "
            f"(BatchRebalanceSampler); resume with the original layout or use random"
        )
    for key in ("auto_find_batch_size", "ignore_data_skip"):
        if getattr(a, key):
            problems.append(f"training.{key}: true and {why}: the data position would not be kept")
    acc = a.accelerator_config if isinstance(a.accelerator_config, dict) else {}
    for key, bad in ACCELERATOR_ORDER.items():
        if key in acc and bool(acc[key]) == bad:
            problems.append(
                f"training.accelerator_config.{key}: {acc[key]} and {why}: the rows of a step depend "
                f"on the layout; resume with the original layout"
            )
    shards = [f for f in w.files if "_rank" in Path(f).name and f.endswith(".bin") and "fsdp" in f]
    if w.world_size != launch.world_size and shards:
        problems.append(
            f"{name} holds per-rank FSDP state files ({shards[0]}, ...) rather than a torch distributed "
            f"checkpoint, which cannot be resharded; resume with --num_processes {w.world_size}"
        )
    written_by = by_name(w.strategy)
    if (
        w.world_size != launch.world_size
        and written_by
        and written_by.reshard == "universal"
        and "latest" not in w.files
    ):
        problems.append(f"{name} has no DeepSpeed `latest` file; it cannot be converted for another world size")
    return problems


def _position(name: str, w: Written, M: int, B: int, A: int) -> tuple[dict | None, str | None]:
    """The position in samples, and Trainer's own skip arithmetic at the new layout checked against it."""
    D, E = int(w.data["train_rows"]), w.effective
    per_epoch = math.ceil(D / E)
    into = (w.step % per_epoch) * E
    new_steps = math.ceil(math.ceil(math.ceil(D / B) / M) / A)  # Trainer: ceil(len(dataloader) / accumulation)
    skipped = (w.step % new_steps) * A * B * M  # Trainer: (global_step % steps) x accumulation batches per rank
    if new_steps != per_epoch or skipped != into:
        return None, (
            f"{name}: at {M} process(es) x {B} per device x accumulation {A} an epoch of {D} rows has "
            f"{new_steps} steps and Trainer would skip {skipped} samples, not {per_epoch} steps and "
            f"{into}: the data position would not be kept; resume with the original layout"
        )
    return {"epoch": w.step // per_epoch, "samples_into_epoch": into, "samples_per_epoch": D}, None


def applied(p: ResumePlan, cfg):
    """The configuration this launch runs with: the plan's per-device batch and accumulation (and
    strategy), a new configuration built before TrainingArguments exist; `cfg` is left as it was."""
    batch = {"per_device_train_batch_size": p.per_device, "gradient_accumulation_steps": p.grad_accum}
    cfg = cfg.replaced("training", args={**cfg.training.args, **batch})
    # DDP continued on one process is a single-process run (and one process continued on many, DDP)
    if _family(cfg.run.strategy) == "replicated" == _family(p.strategy):
        cfg = cfg.replaced("run", strategy=p.strategy)
    return cfg.replaced("model", revision=p.revision) if p.revision else cfg


def check_data(p: ResumePlan, *, rows: int, fingerprint: str) -> None:
    """Once the data is built, before the model loads: the rows must be the checkpoint's, unless --allow-input-change
    let inputs that change them differ (said). With the inputs unchanged, other rows mean other tokenizing code."""
    d = p.data or {}
    if d.get("train_rows") in (None, rows) and d.get("fingerprint") in (None, fingerprint):
        return
    was = (
        f"{d.get('train_rows')} rows, fingerprint {str(d.get('fingerprint'))[:12]}; now {rows} rows, {fingerprint[:12]}"
    )
    if any(c["input"] != "settings" for c in p.input_changes):  # allowed: the position may not be the same rows
        log.warning(f"--resume {p.checkpoint}: the training rows differ ({was}), as --allow-input-change allowed")
        return
    if any(c["input"] == "settings" for c in p.input_changes):
        cause = "the settings --allow-config-change applied change the training rows"
    elif p.inputs_compared:
        cause = (
            "its data files, tokenizer and chat template are the ones it was trained on, so the tokenizing itself "
            "changed (another transformers or tokenizers version, or finetune's rendering)"
        )
    else:
        cause = "the training data differs from the data it was trained on"
    raise UserError(
        f"--resume {p.checkpoint}: {cause} ({was}): the position resumed at would be meaningless. Resume with the same "
        f"data and data settings, or start a new run"
    )


def locate(cfg, resume: str) -> tuple[str, Path, Path]:
    """(run name, run directory, checkpoint) for `--resume[=PATH]`; read-only."""
    from finetune.launch import rundir

    name = cfg.run.name or rundir.default_run_name(cfg.recipe)
    run_dir = rundir.resolve_run_dir(name, cfg.run.output_dir)
    if cfg.run.overwrite:
        raise UserError(
            "--resume and --overwrite contradict each other: --overwrite deletes the run directory "
            "that --resume continues; drop one of them"
        )
    return name, run_dir, checkpoints.resolve(resume, run_dir)


def for_launch(
    cfg, launch: LaunchPlan, resume: str, overrides: list[str], *, allow_input_change: bool = False
) -> tuple[str, Path, ResumePlan]:
    """Locate the checkpoint and plan for `launch` (finetune/launch/plan.py), this launch's inputs compared with the
    checkpoint's (read once, then cached: finetune/fingerprints.py)."""
    from finetune.data import demo

    name, run_dir, ckpt = locate(cfg, resume)
    written = read(ckpt)
    # a hub model's newer revision fetched since: the snapshot trained on, unless asked to continue on other inputs
    revision = None if allow_input_change else provenance.trained_revision(cfg.model, written.inputs)
    cfg = cfg.replaced("model", revision=revision) if revision else cfg
    now = provenance.inputs(cfg, *demo.paths(cfg, run_dir)) if written.inputs else None
    sets_up = dict(strategy=launch.strategy, offload=launch.offload, world_size=launch.world_size)
    request = launch_from(
        cfg, **sets_up, overrides=overrides, inputs=now, allow_input_change=allow_input_change, revision=revision
    )
    return name, run_dir, plan(written, request)


def preflight_problems(
    cfg, launch: LaunchPlan, resume: str, overrides: list[str], *, allow_input_change: bool = False
) -> tuple[list[str], object]:
    """For `finetune train --resume` (finetune/preflight/checks.py check_launch): the refusals, as
    problems, before any process starts, and the configuration the other checks see (the plan applied)."""
    try:
        _, _, p = for_launch(cfg, launch, resume, overrides, allow_input_change=allow_input_change)
    except ConfigError as e:
        return [f"{e.source}: {problem}" for problem in e.problems], cfg
    except UserError as e:
        return [str(e)], cfg
    return [], applied(p, cfg)


RESHARD_WORDS = {
    "none": "states load as saved (same world size)",
    "replicated": "model and optimizer states are whole in the checkpoint (single/DDP): loaded as they are",
    "dcp": "FSDP2 sharded states (torch distributed checkpoint) resharded on load",
    "universal": "DeepSpeed states resharded through a universal checkpoint",
}


def describe(p: ResumePlan) -> str:
    """The console lines (rank 0, before the model loads)."""
    w = p.written
    old = f"{w['world_size']} rank(s) " + (
        f"x {w['per_device']} per device x accumulation {w['grad_accum']} = effective batch {w['effective']}"
        if w["effective"]
        else "(batch layout not recorded)"
    )
    dp = p.data_parallel or p.world_size
    lines = [
        f"resuming {p.checkpoint} (step {p.step}): written by {old} ({w['strategy'] or 'strategy not recorded'})",
        f"  now {p.world_size} process(es){f' ({dp} data-parallel)' if dp != p.world_size else ''} x {p.per_device} "
        f"per device x accumulation {p.grad_accum} = effective batch {p.effective_now} "
        f"({'kept' if p.effective else 'as configured'}), {p.strategy}",
        f"  states: {RESHARD_WORDS[p.reshard]}",
    ]
    if p.position:
        pos = p.position
        lines.append(
            f"  data position: epoch {pos['epoch']}, sample {pos['samples_into_epoch']} of "
            f"{pos['samples_per_epoch']} (kept in samples: the same rows per step as without the interruption)"
        )
    if p.rng == "restored":
        lines.append("  RNG: every rank continues its own stream")
    else:
        lost = [r for r in range(w["world_size"]) if r >= p.world_size]
        lines.append(
            f"  RNG ({p.rng}): rank(s) {p.rng_ranks or 'none'} continue the stream of the same old rank; "
            f"the others start from training.seed"
            + (f"; old rank(s) {lost} not continued" if lost else "")
            + " (per-rank streams cannot follow a world-size change)"
        )
    lines += [f"  note: {n}" for n in p.notes]
    if p.revision:
        lines.append(
            f"  base: the cached snapshot {p.revision} (model.revision), which holds the weights {Path(p.checkpoint).name} "
            "was trained on: the revision configured holds other weights (a newer one fetched since)"
        )
    changed = [c["said"] for c in p.input_changes if c["input"] != "settings"]
    if changed:
        lines.append(f"  inputs changed (--allow-input-change; run.json resumes[].input_changes): {'; '.join(changed)}")
    return "\n".join(lines)


# --- RNG streams under another world size: new rank r continues old rank r's stream where there was
# one, the others keep the seeded state of a fresh start (run.json `resumes[].rng`; docs/faults.md).
# Per-rank streams cannot follow a world-size change anyway: the micro-batches land on other ranks.


def rng_source_file(rank: int, old_world_size: int) -> str | None:
    """The RNG file of the old run whose stream new rank `rank` continues, or None."""
    if old_world_size == 1:
        return "rng_state.pth" if rank == 0 else None
    return f"rng_state_{rank}.pth" if rank < old_world_size else None


def restore_rng(checkpoint: Path, *, rank: int, old_world_size: int) -> str | None:
    """Load the stream new rank `rank` continues from `checkpoint`; the file used, or None."""
    import numpy as np
    import torch
    from transformers.trainer_pt_utils import safe_globals

    name = rng_source_file(rank, old_world_size)
    path = Path(checkpoint) / name if name else None
    if path is None or not path.is_file():
        log.info(
            f"rank {rank}: no RNG stream to continue in {checkpoint} (old world size {old_world_size}); keeps the seeded state"
        )
        return None
    with safe_globals():  # numpy's state objects allow-listed, as Trainer loads the file
        state = torch.load(path, weights_only=True)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if torch.cuda.is_available() and state.get("cuda") is not None:
        saved = state["cuda"]
        # A list (DDP: every visible device) or one state; the old rank used device rank % count.
        device_state = saved[rank % len(saved)] if isinstance(saved, (list, tuple)) else saved
        try:
            torch.cuda.set_rng_state(device_state, device=torch.cuda.current_device())
        except RuntimeError as e:  # never fatal: the losses do not depend on it without dropout
            log.warning("rank %d: CUDA RNG state from %s not restored: %s", rank, path, e)
    return name
