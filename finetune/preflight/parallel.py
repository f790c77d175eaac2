"""The parallel mesh against the launch, before any weights load: the world size it must divide, the
strategy each dimension needs, the device, the model's heads and tp plan, and what the launch's own
configs say about the mesh (docs/parallelism.md; the recipe-only rules: finetune/config/validate.py).
"""

from __future__ import annotations

import os

from finetune import mesh as meshes
from finetune import strategies
from finetune.launch.plan import LaunchPlan

# Accelerate's launcher exports an accelerate config's `parallelism_config` keys as these
# (accelerate/commands/launch.py); the recipe's `parallel` section is this project's one source.
ENV_SIZES = {
    "PARALLELISM_CONFIG_SP_SIZE": "sp_size",
    "PARALLELISM_CONFIG_TP_SIZE": "tp_size",
    "PARALLELISM_CONFIG_CP_SIZE": "cp_size",
}


def problems(cfg, launch: LaunchPlan, *, in_process: bool) -> list[str]:
    m, strategy = launch.mesh, launch.strategy
    out = _launch_config_problems(cfg, launch)
    if m.trivial:
        return out
    sizes = f"parallel.sp_size {m.sp} x tp_size {m.tp} x cp_size {m.cp} = {m.model_parallel}"
    if not m.divides:
        ok = [k * m.model_parallel for k in (1, 2, 4)]
        out.append(
            f"{sizes} does not divide the world size {m.world} ({launch.facts.source}): the ranks of one "
            f"sequence/tensor/context group share a micro-batch, so the world must be a multiple of it; launch "
            f"{' or '.join(map(str, ok))} processes (--num_processes), or change the sizes"
        )
    rules = (
        (m.sp, "sp", meshes.SP_ENGINE, "Ulysses uses DeepSpeed's sequence-parallel groups"),
        (m.tp, "tp", meshes.TP_ENGINE, "AutoTP composes with ZeRO up to stage 2"),
        (m.cp, "cp", meshes.CP_ENGINE, "the ring runs on FSDP2's device mesh"),
    )
    for size, dim, engine, why in rules:
        key, allowed = f"{dim}_size", strategies.names(lambda s, dim=dim: s.runs(dim))
        if size > 1 and strategy not in allowed:
            hint = {
                "sp_size": "recipe zero3_sp, or any zero1/zero2/zero3 recipe with --parallel.sp_size",
                "tp_size": "recipe zero2_tp, or a zero2 recipe with --parallel.tp_size and method full",
                "cp_size": "an fsdp recipe with --parallel.cp_size on CUDA GPUs, or parallel.sp_size under DeepSpeed",
            }[key]
            out.append(
                f"parallel.{key} {size} needs strategy {' or '.join(allowed)} ({engine}: {why}); this launch sets "
                f"up {strategy} ({launch.facts.source}). Use {hint}"
            )
    if m.cp > 1 and not launch.cuda:
        out.append(
            f"parallel.cp_size {m.cp}: torch's context parallelism (ring attention over SDPA's flash/efficient "
            f"kernels, torch.distributed.tensor.experimental.context_parallel) runs on CUDA devices only and "
            f"this launch computes on CPU; on CPU use parallel.sp_size {m.cp} instead (Ulysses, DeepSpeed ZeRO, "
            f"runs over gloo), or run cp_size on GPUs (docs/parallelism.md)"
        )
    out += _model_problems(cfg, m)
    return out


def _launch_config_problems(cfg, launch: LaunchPlan) -> list[str]:
    """The DeepSpeed JSON's tensor_parallel.autotp_size and an accelerate config's parallelism_config
    must agree with the recipe's sizes (the recipe sets them; a second source that disagrees is refused)."""
    out = []
    ds = launch.facts.deepspeed or {}
    autotp = (ds.get("tensor_parallel") or {}).get("autotp_size")
    if autotp not in (None, 0, 1, launch.mesh.tp):
        out.append(
            f"{launch.facts.deepspeed_source}: tensor_parallel.autotp_size is {autotp} but parallel.tp_size is "
            f"{launch.mesh.tp}; remove tensor_parallel from the DeepSpeed config (the run sets autotp_size from "
            f"parallel.tp_size) or set --parallel.tp_size={autotp}"
        )
    for var, key in ENV_SIZES.items():
        value = os.environ.get(var)
        if value is not None and value.strip() != str(getattr(cfg.parallel, key)):
            out.append(
                f"{var}={value} (an accelerate config's parallelism_config) but the recipe has parallel.{key} "
                f"{getattr(cfg.parallel, key)}; remove parallelism_config from the accelerate config (the recipe's "
                f"`parallel` section sets the mesh) or set --parallel.{key}={value}"
            )
    return out


def _model_problems(cfg, m: meshes.Mesh) -> list[str]:
    """Heads against sp and tp, and the model's tp plan, from its config (no weights)."""
    try:
        config = _model_config(cfg.model.name_or_path)
    except Exception as e:  # noqa: BLE001 - transformers' config validation raises its own classes
        return [
            f"model.name_or_path {cfg.model.name_or_path}: its config.json does not load ({type(e).__name__}: "
            f"{str(e).splitlines()[-1]}), so its heads and tp plan cannot be checked against the mesh; fix the config"
        ]
    if config is None:
        return []  # the model source check (finetune/preflight/checks.py) says why it cannot be found
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = cfg.model.name_or_path
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    out = []
    if m.sp > 1 and heads is not None:
        if heads % m.sp or (kv % m.sp and m.sp % kv):
            out.append(
                f"parallel.sp_size {m.sp}: model {name} has {heads} attention heads and {kv} key/value heads; Ulysses "
                f"gives each rank heads / sp_size of them, so sp_size must divide {heads} and divide or be a multiple "
                f"of {kv}; allowed here: {_divisors(heads, lambda d: kv % d == 0 or d % kv == 0, m.world)}"
            )
    if m.tp > 1:
        if heads is not None and (heads % m.tp or kv % m.tp):
            out.append(
                f"parallel.tp_size {m.tp}: model {name} has {heads} attention heads and {kv} key/value heads; the tp "
                f"plan splits both across the tensor-parallel ranks, so tp_size must divide both; allowed here: "
                f"{_divisors(heads, lambda d: kv % d == 0, m.world)}"
            )
        if not getattr(text, "base_model_tp_plan", None):
            out.append(
                f"parallel.tp_size {m.tp}: model {name} ({type(text).__name__}, model_type "
                f"{getattr(text, 'model_type', '?')!r}) has no tensor-parallel plan (base_model_tp_plan in its "
                f"transformers config class), so nothing says which layers to split; use a model whose config "
                f"carries one (Llama, Mistral, Qwen2/3, ...), or parallel.sp_size / ZeRO-3 to fit this one"
            )
    return out


def _divisors(n: int, keep, world: int) -> str:
    """The sizes > 1 the model allows that also divide the `world` processes of this launch."""
    found = [d for d in range(2, n + 1) if n % d == 0 and keep(d)]
    here = [d for d in found if world % d == 0]
    if here:
        return ", ".join(map(str, here))
    other = f"; {found[0]} runs on a multiple of {found[0]} processes" if found else ""
    return f"none on {world} processes (keep it at 1{other})"


def _model_config(name_or_path: str):
    """The model's transformers config when it can be read without loading or converting anything."""
    from transformers import AutoConfig

    from finetune.config.sections import BUNDLED_MODEL

    if name_or_path == BUNDLED_MODEL:
        from finetune.modeling import bundled

        if not bundled.is_prepared():
            return None
        name_or_path = str(bundled.model_dir())
    try:
        return AutoConfig.from_pretrained(name_or_path, local_files_only=True)
    except (OSError, ValueError):  # not on this machine, or its own code: model_source / model_files name it
        return None
