"""`finetune plan`: the model's config (no weights), the memory and communication of every
strategy, and a recommendation: the fastest strategy that fits with a margin."""

from __future__ import annotations

import json
from pathlib import Path

from finetune import precision
from finetune.errors import ConfigError, UserError
from finetune.planning.comm import read_bandwidth, step_time, step_traffic
from finetune.planning.memory import CUDA_CONTEXT_GIB, loss_text
from finetune.planning.plan_text import render
from finetune.planning.prediction import NOT_MODELLED, constants, plan_rows, workload_from_config
from finetune.planning.shapes import Shape, Workload, shape_of
from finetune.strategies import by_key
from finetune.units import GIB, gib, parse_size

MARGIN = 0.90  # "fits" = at most 90% of device (and host) memory: headroom for fragmentation spikes


def load_model_config(name_or_path: str):
    """A transformers config without weights: a local directory or config.json, a shipped model config
    by name (finetune/model_configs/: `Llama-3.1-8B`), the bundled model (once prepared), or a hub id
    whose config is already in the Hugging Face cache."""
    from transformers import AutoConfig

    from finetune import resources
    from finetune.config.sections import BUNDLED_MODEL

    if name_or_path == BUNDLED_MODEL:
        from finetune.modeling import bundled

        if not bundled.is_prepared():
            raise UserError(
                "the bundled model is not prepared yet: run `finetune prepare-model` once, or pass "
                f"--model DIR_OR_CONFIG_JSON or a shipped model config ({', '.join(resources.model_config_names())})"
            )
        name_or_path = str(bundled.model_dir())
    path = Path(name_or_path)
    if not path.exists() and resources.model_config(name_or_path):
        path = resources.model_config(name_or_path)
    if path.is_file():
        try:
            values = json.loads(path.read_text(encoding="utf-8"))
            kind = values.pop("model_type")
            return AutoConfig.for_model(kind, **values)
        except (ValueError, KeyError) as e:
            raise UserError(
                f"--model: {path} is not a transformers config.json (needs model_type and the "
                f"model's shapes): {type(e).__name__}: {e}"
            ) from None
    if path.is_dir():
        from finetune.modeling.load import code_problem

        if not (path / "config.json").is_file():
            raise UserError(f"--model: directory {path} has no config.json")
        code = code_problem(path, trust=False)
        if code:
            raise UserError(
                f"--model: {code}; `finetune plan` runs no model code: give a config of an architecture "
                f"transformers has (a config.json with its model_type and shapes)"
            )
        return AutoConfig.from_pretrained(path)
    try:
        return AutoConfig.from_pretrained(name_or_path, local_files_only=True)
    except (OSError, ValueError):
        raise UserError(not_found_message(name_or_path)) from None


def not_found_message(name: str) -> str:
    """--model that is no file, directory, shipped config or cached hub config: what to pass instead."""
    from finetune import resources

    names = resources.model_config_names()
    tail = name.rstrip("/").split("/")[-1]
    same = next((n for n in names if n.lower() == tail.lower()), None)
    hint = f"--model {same} (the shipped config of that model), or " if same else ""
    return (
        f"--model: {name!r} is not a local directory or file, not a shipped model config, and its config is "
        f"not in the Hugging Face cache (no hub access here). Pass {hint}a config.json written from the model "
        f"card (--model path/to/config.json, or a directory holding it), or a shipped model config by name: "
        f"{', '.join(names)}"
    )


def build_plan(
    cfg,
    model_config,
    *,
    gpus: int,
    nodes: int,
    gpu_memory: float,
    host_memory: float,
    bandwidth: dict,
    model_name: str,
    overrides: list[str] = (),
) -> dict:
    shape = shape_of(model_config)
    # A plan is for GPUs: `auto` is taken as bf16-mixed, as a GPU with bf16 resolves it.
    policy = precision.resolve(cfg.training.precision, True, True)
    w = workload_from_config(cfg, precision=policy.name)
    n = gpus * nodes
    shards = w.sp * w.tp * w.cp
    if n % shards:
        raise UserError(
            f"parallel.sp_size {w.sp} x tp_size {w.tp} x cp_size {w.cp} = {shards} does not divide the "
            f"{n} GPU(s) planned (--gpus x --nodes); plan a multiple of {shards} GPUs or change the sizes"
        )
    if bandwidth["busbw_gbs"] and not bandwidth["h2d_gbs"]:  # host<->device copies need a bandwidth too
        bandwidth = {**bandwidth, "h2d_gbs": H2D_GBS, "h2d_source": "assumed (PCIe 4.0 x16)"}
    memory = {"gpus": gpus, "gpu": gpu_memory, "host": host_memory}
    rows = [plan_row(shape, w, row, n, memory, bandwidth) for row in plan_rows(shape, w, n)]
    p = shape.params
    return {
        "model": {
            "name": model_name,
            "model_type": shape.model_type,
            "parameters": p.total,
            "layers": shape.layers,
            "hidden": shape.hidden,
            "vocab": shape.vocab,
            "tied_embeddings": p.lm_head == 0,
            "lora_parameters": shape.lora_params(w.lora_r, w.lora_targets),
        },
        "hardware": {
            "gpus_per_node": gpus,
            "nodes": nodes,
            "world_size": n,
            "gpu_memory_gib": gib(gpu_memory),
            "host_memory_gib": gib(host_memory),
            "margin": MARGIN,
            "bandwidth": bandwidth,
        },
        "recipe": cfg.recipe,
        "method": w.method,
        "assumptions": plan_notes(cfg, w, policy, shape, n // shards, overrides),
        "differences_from_deepspeed": DEEPSPEED_DIFFERENCES,
        "rows": rows,
        "recommendation": recommend(rows, w.method, gpu_memory, host_memory, n),
    }


def plan_row(shape: Shape, w: Workload, row: dict, n: int, memory: dict, bandwidth: dict) -> dict:
    """One strategy and method of the plan: its memory, whether it fits, its traffic and step time.
    `memory`: {"gpus": per node, "gpu": bytes per GPU, "host": bytes per node}."""
    method_w = Workload(**{**w.__dict__, "method": row["method"]})
    traffic = step_traffic(shape, method_w, row["strategy"], n, row["regime"])
    times = step_time(traffic, bandwidth["busbw_gbs"], bandwidth["h2d_gbs"])
    host_node = row["host_total"] * memory["gpus"]  # one process per GPU on each node
    fit_dev, fit_host = row["device_total"] / memory["gpu"], host_node / memory["host"]
    return {
        "method": row["method"],
        "strategy": row["strategy"],
        "description": by_key(row["strategy"]).description,
        "precision": row["regime"].note,
        "phase": row["phase"],
        "attention_kernel": row["attn_kind"],
        "device": {
            "components_gib": {k: gib(v) for k, v in row["device"].items()},
            "allocated_gib": gib(row["allocated"]),
            "reserved_gib": gib(row["reserved"]),
            "cuda_context_gib": CUDA_CONTEXT_GIB,
            "total_gib": gib(row["device_total"]),
            "phases_gib": {k: gib(v) for k, v in row["phases"].items()},
        },
        "host_per_process": {
            "components_gib": {k: gib(v) for k, v in row["host"].items()},
            "total_gib": gib(row["host_total"]),
        },
        "host_per_node_gib": gib(host_node),
        "device_fraction": round(fit_dev, 4),
        "host_fraction": round(fit_host, 4),
        "fits": fit_dev <= MARGIN and fit_host <= MARGIN,
        "fits_without_margin": fit_dev <= 1 and fit_host <= 1,
        "communication": {
            "collectives_bytes": {k: round(v) for k, v in traffic["collectives"].items()},
            "host_device_bytes": {k: round(v) for k, v in traffic["host_device"].items()},
            **times,
        },
        "step_time": step_seconds(shape, method_w, times),
    }


def plan_notes(cfg, w: Workload, policy, shape: Shape, dp: int, overrides: list[str]) -> dict:
    """The plan's assumptions: the workload and where its numbers came from, the policy, the
    constants, and what is not modelled."""
    how = "" if cfg.training.precision != "auto" else " (auto on a GPU with bf16)"
    return {
        "workload": workload_note(cfg, w, overrides),
        "precision": f"{policy.name}{how}: {policy.summary}",
        **{k: getattr(w, k) for k in ("micro_batch", "seq_len", "gradient_checkpointing", "grad_accum", "layout")},
        "mesh": {"sp": w.sp, "tp": w.tp, "cp": w.cp, "dp": dp},
        "loss_impl": loss_text(w, shape),
        "optimizer": f"AdamW ({w.optimizer})",
        "gpu": "compute capability 9.x assumed (cuBLAS workspace 32 MiB)",
        "constants": {**constants(), **step_time_constants()},
        "not_modelled": [*NOT_MODELLED, "the host's optimizer step of offloaded optimizers (in the step time)"],
    }


DEEPSPEED_DIFFERENCES = (
    "Model states follow what DeepSpeed 0.19.8 allocates, not its estimators: the module in its dtype, a "
    "separate master partition, AdamW states, the ipg bucket and gradient partitions at the sizes the "
    "config sets (Trainer's 'auto' values filled in), the fp32 gradient partition at the optimizer step "
    "(as estimate_zero2_model_states_mem_needs counts it); ZeRO-3's gathered parameters by its reuse-distance "
    "rule instead of the estimator's largest layer in fp32; no 1.5x factor on host memory (pinned buffers "
    "are rounded up to a power of two instead, as torch's host allocator does); activations, the loss "
    "and the allocator are added, which the estimators leave out."
)


def recommend(rows: list[dict], method: str, gpu_memory: float, host_memory: float, world: int = 1) -> dict:
    """The fastest strategy for the recipe's method that fits with the margin, why, and what does not fit.
    With several GPUs the single-device row is a reference only: it would leave the others idle."""
    mine = sorted(
        (
            r
            for r in rows
            if r["method"] == method
            and (world == 1 or by_key(r["strategy"]).multi_process)
            and by_key(r["strategy"]).recipe
        ),  # only what ships a recipe and its configs (the planner-only rows are for comparison)
        key=lambda r: by_key(r["strategy"]).speed_rank,
    )
    choice = next((r for r in mine if r["fits"]), None)
    short = []
    for r in mine:
        if r["fits"]:
            continue
        over_dev = r["device_fraction"] * gpu_memory - MARGIN * gpu_memory
        over_host = r["host_fraction"] * host_memory - MARGIN * host_memory
        parts = []
        if over_dev > 0:
            parts.append(
                f"device needs {r['device']['total_gib']:.1f} GiB, {over_dev / GIB:.1f} GiB over "
                f"{MARGIN:.0%} of {gpu_memory / GIB:.0f} GiB"
                + ("" if r["device_fraction"] > 1 else " (fits only without the margin)")
            )
        if over_host > 0:
            parts.append(
                f"host needs {r['host_per_node_gib']:.1f} GiB per node, {over_host / GIB:.1f} GiB over "
                f"{MARGIN:.0%} of {host_memory / GIB:.0f} GiB"
            )
        short.append({"strategy": r["strategy"], "problem": "; ".join(parts)})
    if choice is None:
        lighter = {"full": "a lighter method (lora, qlora), ", "lora": "a lighter method (qlora), "}.get(method, "")
        reason = (
            f"no strategy fits {method} with a {1 - MARGIN:.0%} margin: use a smaller micro-batch, gradient "
            f"checkpointing, a shorter sequence, {lighter}or more/larger GPUs"
        )
        return {"strategy": None, "method": method, "reason": reason, "does_not_fit": short}
    faster = [s["strategy"] for s in short if by_key(s["strategy"]).speed_rank < by_key(choice["strategy"]).speed_rank]
    first, choice = choice, _least_step_time(choice, [r for r in mine if r["fits"]])
    reason = (
        f"{choice['strategy']} ({by_key(choice['strategy']).why}) is the fastest that fits: "
        f"{choice['device']['total_gib']:.1f} GiB of {gpu_memory / GIB:.0f} GiB per device "
        f"({100 * choice['device_fraction']:.0f}%), host {choice['host_per_node_gib']:.1f} GiB per node"
    )
    if choice is not first:
        a, b = first["step_time"], choice["step_time"]
        reason += (
            f"; communication dominates at this bandwidth: {first['strategy']} (first in speed order) would "
            f"take an estimated {a['total_s']:.2f} s per step ({a['communication_s']:.2f} s moving data, "
            f"{a['compute_s']:.2f} s computing), {choice['strategy']} {b['total_s']:.2f} s "
            f"({b['communication_s']:.2f} s moving data; its host optimizer step not counted)"
        )
    if faster:
        reason += f"; faster ones do not fit: {', '.join(faster)}"
    return {"strategy": choice["strategy"], "method": method, "reason": reason, "does_not_fit": short}


def _least_step_time(first: dict, fitting: list[dict]) -> dict:
    """The speed order's choice, unless its communication takes longer than its compute at the given
    bandwidth (step_seconds): then the fitting row with the least estimated step time."""
    if not first.get("step_time") or not first["step_time"]["communication_dominates"]:
        return first
    timed = [r for r in fitting if r.get("step_time")]
    best = min(timed, key=lambda r: (r["step_time"]["total_s"], by_key(r["strategy"]).speed_rank))
    return best if best["step_time"]["total_s"] < first["step_time"]["total_s"] else first


def workload_note(cfg, w: Workload, overrides: list[str]) -> dict:
    """What the plan is for, and where each number came from (the recipe, or the command line)."""
    given = {o.split("=")[0] for o in overrides}

    def source(key: str) -> str:
        return "command line" if f"--{key}" in given else f"recipe {cfg.recipe}"

    return {
        "micro_batch": w.micro_batch,
        "micro_batch_from": source("training.per_device_train_batch_size"),
        "seq_len": w.seq_len,
        "seq_len_from": source("data.max_length"),
        "grad_accum": w.grad_accum,
        "tokens_per_micro_step": w.micro_batch * w.seq_len,
    }


def run(args, overrides: list[str]) -> int:
    import shutil

    from finetune.config.recipe import load_recipe

    problems = list(getattr(args, "problems", []))  # the command line's (finetune/cli/dispatch.py parse)
    cfg, _ = load_recipe(args.recipe, overrides, problems)
    if args.gpus < 1 or args.nodes < 1:
        problems.append(f"--gpus and --nodes must be >= 1, got {args.gpus} and {args.nodes}")
    if problems:
        raise ConfigError(problems, "finetune plan")
    name = args.model or cfg.model.name_or_path
    model_config = load_model_config(name)
    try:
        plan = build_plan(
            cfg,
            model_config,
            gpus=args.gpus,
            nodes=args.nodes,
            gpu_memory=parse_size(args.gpu_memory, "--gpu-memory"),
            host_memory=parse_size(args.host_memory, "--host-memory"),
            bandwidth=read_bandwidth(args.bandwidth),
            model_name=name,
            overrides=overrides,
        )
    except ValueError as e:  # an architecture the arithmetic does not cover
        raise UserError(f"--model {name}: {e}") from None
    print(json.dumps(plan, indent=2) if args.json else render(plan, width=shutil.get_terminal_size().columns))
    return 0


# Time per optimizer step, for the recommendation when a bandwidth is known: compute at an assumed
# fraction of an assumed GPU's peak, plus the communication at the bus bandwidth and the host<->device
# copies (finetune/planning/comm.py), with no overlap. Strategies are tried fastest first (their speed_rank),
# which assumes the communication hides behind the compute; where it takes longer than the compute,
# the strategy with the least estimated time wins instead (docs/planning.md "Recommendation").

# ASSUMED: the GPU the plan is for, as the memory arithmetic assumes compute capability 9.x: an H100 SXM's dense bf16
# peak (NVIDIA H100 whitepaper, 989.4 TFLOP/s; finetune/telemetry/formulas.py PEAK_DENSE_FLOPS has the same row).
PEAK_FLOPS = 989.4e12
# ASSUMED: the model FLOPs utilisation of a tuned fine-tuning step (the target of docs/benchmarks.md;
# not measured here). Only decides whether communication dominates; a lower MFU makes that rarer.
MFU = 0.40
# ASSUMED: host<->device copy bandwidth when --bandwidth is a number (PCIe 4.0 x16 carries about
# 25 GB/s of pinned copies); `finetune bench-comm --out` measures it on a GPU machine.
H2D_GBS = 25.0


def flops_per_step(shape: Shape, w: Workload) -> float:
    """Model FLOPs of one optimizer step on one device, as the runs count MFU
    (finetune/telemetry/model_flops.py): 6N per token for full fine-tuning, 4N with a frozen base
    (LoRA, QLoRA: no weight gradients), N the matmul weights (the blocks' linears and the head), plus
    PaLM's 12·L·Q·T attention term; every row taken at its full length (an upper bound)."""
    matmul = shape.block_linear_params + shape.vocab * shape.hidden
    per_token = (6 if w.method == "full" else 4) * matmul + 12 * shape.layers * shape.q * w.seq_len
    return per_token * w.micro_batch * w.seq_len * w.grad_accum


def step_seconds(shape: Shape, w: Workload, comm_times: dict) -> dict | None:
    """{compute_s, communication_s, total_s, communication_dominates} of one row, or None when the
    communication time is unknown (no bandwidth given)."""
    coll, h2d = comm_times.get("collectives_s"), comm_times.get("host_device_s")
    if coll is None or h2d is None:
        return None
    compute = flops_per_step(shape, w) / (PEAK_FLOPS * MFU)
    moving = coll + h2d
    return {
        "compute_s": compute,
        "communication_s": moving,
        "total_s": compute + moving,
        "communication_dominates": moving > compute,
    }


def step_time_constants() -> dict:
    return {
        "step_time_peak_flops": {
            "value": PEAK_FLOPS,
            "kind": "assumed",
            "source": "H100 SXM dense bf16 (whitepaper), the GPU of compute capability 9.x the plan assumes",
        },
        "step_time_mfu": {
            "value": MFU,
            "kind": "assumed",
            "source": "a tuned fine-tuning step (docs/benchmarks.md's target); not measured",
        },
        "h2d_gbs_when_not_measured": {
            "value": H2D_GBS,
            "kind": "assumed",
            "source": "PCIe 4.0 x16 pinned copies; `finetune bench-comm --out FILE` measures it",
        },
    }
