"""Which distributed strategy actually engaged, read from the live objects, and the refusal to train
anything else. Accelerate downgrades some launches without a word, so the run checks twice against
the recipe's run.strategy and run.offload: from Accelerate's state once Trainer exists (`engaged`),
and from the wrapped model itself before the first optimizer step (`live_section`: run.json
`strategy.evidence` and the live mesh, `strategy.parallel`; finetune/training/hooks.py).
"""

from __future__ import annotations

import math

from finetune.errors import UserError
from finetune.launch import cpu_rehearsal
from finetune.strategies import launch_line, name_of, offload_device, offload_name


def engaged(state, *, method: str, setup=None, expected: str = "any") -> dict:
    """The `strategy` section of run.json from Accelerate's state, before the engine exists.
    `live_section` later replaces the DeepSpeed/FSDP facts with what the wrapped model shows.
    `setup` (finetune/launch/strategy_setup.py): who set the strategy up, recorded as `set_up_by` / `setup`.
    `expected`: the recipe's run.strategy, the name recorded when its row has the engine that engaged."""
    dtype = state.distributed_type.value
    out = {
        "name": None,
        "distributed_type": dtype,
        "zero_stage": None,
        "offload_optimizer": None,
        "offload_params": None,
        "offload": "none",
        "fsdp_version": None,
        "world_size": state.num_processes,
        "method": method,  # precision: run.json `precision` (finetune/training/precision_evidence.py)
        "cpu_distributed": cpu_rehearsal.requested() if setup is None else setup.cpu_gloo is not None,
        "set_up_by": setup.set_up_by if setup is not None else None,
        "setup": setup.record() if setup is not None else None,
        "evidence": None,
        "parallel": None,  # the live mesh, read once the model is prepared (live_mesh)
    }
    if dtype == "DEEPSPEED":
        ds = state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
        stage = int(ds.get("stage", 0))
        opt = (ds.get("offload_optimizer") or {}).get("device", "none") or "none"
        par = (ds.get("offload_param") or {}).get("device", "none") or "none"
        out.update(
            zero_stage=stage,
            offload_optimizer=opt,
            offload_params=par,
            offload=offload_name(opt, par),
        )
    elif dtype == "FSDP":
        plugin = state.fsdp_plugin
        offload = _fsdp_offloads(plugin.cpu_offload)
        out.update(
            fsdp_version=getattr(plugin, "fsdp_version", 1),
            offload_optimizer="cpu" if offload else "none",
            offload_params="cpu" if offload else "none",
            offload="optimizer+params" if offload else "none",
        )
    # one data-parallel process is a single-process run (DDP resumed on one GPU, docs/faults.md)
    out["name"] = name_of(dtype, zero_stage=out["zero_stage"], num_processes=state.num_processes, expected=expected)
    return out


def check_expected(expected: str, engaged_strategy: dict, recipe: str, expected_offload: str = "any") -> None:
    """Refuse to run a strategy (or offload) other than the one the recipe names."""
    name, offload = engaged_strategy["name"], engaged_strategy.get("offload", "none")
    strategy_ok = expected == "any" or expected == name
    offload_ok = expected_offload == "any" or expected_offload == offload
    if strategy_ok and offload_ok:
        return
    want = expected if expected != "any" else name
    want_offload = expected_offload if expected_offload != "any" else "none"
    evidence = engaged_strategy.get("evidence")
    seen = f", live engine: {evidence['engine_class']}" if evidence else ""
    raise UserError(
        f"recipe {recipe!r} is meant for strategy {expected!r} with offload {expected_offload!r} (run.strategy, "
        f"run.offload) but this launch engaged {name!r} with offload {offload!r} (Accelerate distributed type "
        f"{engaged_strategy['distributed_type']}, world size {engaged_strategy['world_size']}{seen}). "
        f"Nothing was trained. Launch it with:\n{launch_line(want, want_offload, recipe)}\n"
        f"or set run.strategy: any (and run.offload: any) to accept whatever the launch gives."
    )


# --- the live engine, after Trainer wrapped the model ----------------------------------------


def live_evidence(wrapped) -> dict:
    """What the wrapped model itself shows: engine class, ZeRO stage and offload devices from
    the DeepSpeed engine, or FSDP2 DTensor parameters and the fraction of them this rank holds."""
    import torch

    ev = {
        "engine_class": type(wrapped).__name__,
        **dict.fromkeys(("zero_stage", "zero_optimizer_class", "basic_optimizer_class", "offload_optimizer_device")),
        **dict.fromkeys(("offload_param_device", "gradient_clipping")),
        **dict.fromkeys(("fsdp_modules", "dtensor_params", "params"), 0),
        **dict.fromkeys(("local_param_fraction", "fsdp_offload_policy")),
        "world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
    }
    if any(c.__name__ == "DeepSpeedEngine" for c in type(wrapped).__mro__):
        opt_cfg, par_cfg = wrapped.zero_offload_optimizer(), wrapped.zero_offload_param()
        zopt = wrapped.optimizer
        ev.update(
            zero_stage=int(wrapped.zero_optimization_stage()),
            zero_optimizer_class=type(zopt).__name__,
            basic_optimizer_class=type(getattr(wrapped, "basic_optimizer", None)).__name__,
            offload_optimizer_device=offload_device(opt_cfg),
            offload_param_device=offload_device(par_cfg),
            gradient_clipping=float(wrapped.gradient_clipping()),
        )
        # The optimizer's own flags, not only the config: ZeRO-1/2 `cpu_offload`, ZeRO-3 `offload_*`.
        ev["optimizer_offloaded"] = bool(
            getattr(zopt, "cpu_offload", False) or getattr(zopt, "offload_optimizer", False)
        )
        ev["params_offloaded"] = bool(getattr(zopt, "offload_param", False))
        params = list(wrapped.module.parameters())
        ev["params"] = len(params)
        if ev["zero_stage"] == 3:
            local, full, _ = held_elements(params)
            ev["local_param_fraction"] = round(local / max(full, 1), 4)
        return ev
    from torch.distributed.tensor import DTensor

    params = list(wrapped.parameters())
    ev["params"] = len(params)
    try:
        from torch.distributed.fsdp import FSDPModule

        fsdp_modules = [m for m in wrapped.modules() if isinstance(m, FSDPModule)]
    except ImportError:
        fsdp_modules = []
    ev["fsdp_modules"] = len(fsdp_modules)
    dtensors = [p for p in params if isinstance(p, DTensor)]
    ev["dtensor_params"] = len(dtensors)
    if dtensors:
        local, full, _ = held_elements(dtensors)
        ev["local_param_fraction"] = round(local / max(full, 1), 4)
        ev["placements"] = str(dtensors[0].placements)
    if fsdp_modules:
        try:  # the first module that holds parameters: under full fine-tuning Accelerate's root holds none
            groups = [m._get_fsdp_state()._fsdp_param_group for m in fsdp_modules]
            group = next((g for g in groups if g is not None), None)
            ev["fsdp_offload_policy"] = type(group.offload_policy).__name__ if group else None
        except AttributeError:  # private API; evidence only
            pass
    return ev


def live_mesh(wrapped, accelerator) -> dict:
    """run.json `strategy.parallel`: the mesh as the live process groups show it, after Trainer
    prepared the model. DeepSpeed: its engine's groups (Ulysses' sequence-parallel group, AutoTP's
    tensor-parallel group, the data-parallel group ZeRO reduces over); torch: Accelerate's device
    mesh, else the world as data-parallel ranks (DDP replicates, FSDP2 shards)."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    out = {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "sp": 1, "cp": 1, "world_size": world, "source": None}
    if any(c.__name__ == "DeepSpeedEngine" for c in type(wrapped).__mro__):
        from deepspeed.utils import groups

        tp = 1
        if wrapped.autotp_size() > 1:
            tp = dist.get_world_size(group=groups.get_tensor_model_parallel_group())
        sp, zero_ranks = int(wrapped.sequence_parallel_size), int(wrapped.seq_dp_world_size)
        # DeepSpeed has no data-parallel group of its own under Ulysses (groups.py returns None):
        # the ZeRO group is sequence x data parallel
        dp = int(wrapped.dp_world_size) if wrapped.dp_world_size is not None else zero_ranks // sp
        stage = int(wrapped.zero_optimization_stage())
        out.update(_sharded_layers(wrapped.module) if tp > 1 else {})
        out.update(ulysses_attention=_ulysses_registered(wrapped.module) if sp > 1 else None)
        out.update(
            tp=tp,
            sp=sp,
            dp_shard=dp if stage >= 1 else 1,
            dp_replicate=1 if stage >= 1 else dp,
            zero_partition_ranks=zero_ranks,
            source="DeepSpeed engine groups: sequence_parallel_size, dp_world_size, seq_dp_world_size"
            + (", the tensor-parallel group" if tp > 1 else ""),
        )
        return out
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is not None and mesh.mesh_dim_names:
        names = mesh.mesh_dim_names
        for dim in ("dp_replicate", "dp_shard", "tp", "cp", "sp"):
            if dim in names:
                out[dim] = int(mesh[dim].size())
        out["source"] = f"Accelerate's device mesh {dict(zip(names, mesh.mesh.shape))}"
        return out
    fsdp = any(type(m).__name__.startswith("FSDP") for m in wrapped.modules())
    out["dp_shard" if fsdp else "dp_replicate"] = world
    out["source"] = "the world process group (no model-parallel group)"
    return out


def _sharded_layers(module) -> dict:
    """AutoTP's replacements of nn.Linear (deepspeed/module_inject/layers.py) and the fraction of
    their weights this rank holds: the tensor-parallel split itself, not its configuration."""
    layers = [m for m in module.modules() if type(m).__name__ in ("LinearLayer", "LinearAllreduce")]
    # the weight's shape before the split (AutoTP keeps it; private: evidence only)
    full = sum(math.prod(getattr(m, "_orig_weight_shape", None) or m.weight.shape) for m in layers)
    local = sum(int(m.weight.numel()) for m in layers)
    return {"tp_layers": len(layers), "tp_local_weight_fraction": round(local / full, 4) if full else None}


def _ulysses_registered(module) -> bool:
    """Whether the model's attention implementation is DeepSpeed's Ulysses wrapper (registered under
    the implementation's own name: deepspeed/runtime/sequence_parallel/ulysses_sp.py)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
    return impl in ALL_ATTENTION_FUNCTIONS and ALL_ATTENTION_FUNCTIONS[impl].__name__ == "uattn_wrapper"


def check_mesh(live: dict, planned, recipe: str) -> None:
    """Refuse a live mesh other than the planned one (finetune/mesh.py): nothing was trained yet."""
    got = {"sp": live["sp"], "tp": live["tp"], "cp": live["cp"], "dp": live["dp_replicate"] * live["dp_shard"]}
    want = {**planned.sizes(), "dp": planned.dp}
    if got == want:
        return
    raise UserError(
        f"recipe {recipe!r} asks for the mesh {want} (parallel.sp_size, tp_size, cp_size over {planned.world} "
        f"processes) but the live process groups show {got} ({live['source']}). Nothing was trained; check "
        f"the launch's accelerate/DeepSpeed config for its own parallelism settings (docs/parallelism.md)"
    )


def held_elements(params) -> tuple[int, int, str]:
    """(parameter elements this rank holds, elements of the whole model, how they are split), from
    the live parameters: ZeRO-3 partitions (ds_tensor of ds_numel), FSDP2 DTensor shards (local of
    global), else every parameter whole. The live evidence and run.json `nodes` both count with it."""
    from torch.distributed.tensor import DTensor

    params = list(params)
    if any(hasattr(p, "ds_numel") for p in params):
        local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)
        return local, sum(getattr(p, "ds_numel", p.numel()) for p in params), "zero3 partitions (ds_tensor of ds_numel)"
    if any(isinstance(p, DTensor) for p in params):
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
        return local, sum(p.numel() for p in params), "fsdp2 shards (DTensor local of global)"
    split = [_autotp_shape(p) for p in params]
    if any(split):  # AutoTP: the split linears' weights are their rank's share of the original shape
        full = sum(math.prod(shape) if shape else p.numel() for p, shape in zip(params, split))
        return sum(p.numel() for p in params), full, "autotp splits (local of each split layer's original shape)"
    whole = sum(p.numel() for p in params)
    return whole, whole, "replicated (every rank holds every parameter)"


def _autotp_shape(param) -> tuple | None:
    """A weight's shape before AutoTP split it, from the restore metadata DeepSpeed 0.19 keeps on it
    (deepspeed/module_inject/layers.py _set_param_uc_meta); None for a parameter it did not split."""
    meta = getattr(param, "ds_autotp_universal_checkpoint_meta", None)
    if not meta or meta.get("replicated") or not meta.get("original_shape"):
        return None
    return tuple(meta["original_shape"])


def strategy_from_evidence(ev: dict, expected: str = "any") -> tuple[str, str]:
    """(strategy name, offload) that the live evidence proves: the strategy table's name for the engine shown,
    `expected` when its row has that engine (finetune/strategies.py name_of)."""
    if ev["zero_stage"] is not None:
        opt = ev["offload_optimizer_device"] if ev.get("optimizer_offloaded") else "none"
        par = ev["offload_param_device"] if ev.get("params_offloaded") else "none"
        return name_of("DEEPSPEED", zero_stage=ev["zero_stage"], expected=expected), offload_name(opt, par)
    # Not "every parameter": Accelerate leaves non-float (uint8-stored 4-bit) weights out of FSDP2 sharding.
    if ev["fsdp_modules"] and ev["dtensor_params"]:
        offloaded = ev.get("fsdp_offload_policy") == "CPUOffloadPolicy"
        return name_of("FSDP", expected=expected), "optimizer+params" if offloaded else "none"
    if ev["engine_class"] == "DistributedDataParallel":
        # On CPU rehearsal Accelerate wraps even one MULTI_CPU process in DDP (accelerator.py
        # prepare_model; MULTI_GPU with one process is not wrapped): one process is the one-device row.
        return name_of("MULTI_GPU", num_processes=ev["world_size"], expected=expected), "none"
    return (name_of("NO", expected=expected) if ev["world_size"] == 1 else ev["engine_class"]), "none"


def live_section(wrapped, accelerator, declared: dict) -> dict:
    """run.json `strategy` once Trainer has wrapped the model: the declared section with what the live
    engine and process groups show (`evidence`, `parallel`)."""
    ev = live_evidence(wrapped)
    name, offload = strategy_from_evidence(ev, expected=declared["name"])
    ev["set_up_by"] = declared.get("set_up_by")  # the evidence says which way it was set up too
    live = {
        "name": name,
        "offload": offload,
        "evidence": ev,
        "world_size": ev["world_size"],
        "distributed_type": accelerator.distributed_type.value,
        "parallel": live_mesh(wrapped, accelerator),
    }
    if ev["zero_stage"] is not None:
        live.update(
            zero_stage=ev["zero_stage"],
            offload_optimizer=ev["offload_optimizer_device"],
            offload_params=ev["offload_param_device"],
        )
    return {**declared, **live}


def _fsdp_offloads(cpu_offload) -> bool:
    if cpu_offload is None:
        return False
    if type(cpu_offload).__name__ == "CPUOffloadPolicy":
        return True
    return bool(getattr(cpu_offload, "offload_params", False))
