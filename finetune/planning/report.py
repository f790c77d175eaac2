"""`finetune plan`: the model's config (no weights: finetune/planning/model_source.py), the workload (the recipe's
sequence length, or the data's token lengths), and the answer first: the fastest strategy, micro-batch,
accumulation, gradient checkpointing and offload that fit with the margin (finetune/planning/search.py), then the
memory and communication of every option. Without a data path nothing here imports torch."""

from __future__ import annotations

import dataclasses
import json

from finetune import precision
from finetune.errors import ConfigError, UserError
from finetune.planning import model_source, search
from finetune.planning.comm import read_bandwidth, step_time, step_traffic
from finetune.planning.memory import CUDA_CONTEXT_GIB, loss_text
from finetune.planning.plan_text import render
from finetune.planning.prediction import NOT_MODELLED, constants, length_stats, plan_rows, workload_from_config
from finetune.planning.search import MARGIN
from finetune.planning.shapes import Shape, Workload, shape_of
from finetune.strategies import by_key
from finetune.units import gib, parse_size


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
    gpu: dict | None = None,
    lengths: dict | None = None,
) -> dict:
    """The plan as JSON. `gpu`: {"label", "peak_flops", "source"} of a named GPU (tokens/s are predicted for it),
    None: the assumed H100 peak ranks the options. `lengths`: the data's token lengths (length_stats plus
    `source`), whose longest row is planned instead of data.max_length."""
    shape = shape_of(model_config)
    # A plan is for GPUs: `auto` is taken as bf16-mixed, as a GPU with bf16 resolves it.
    policy = precision.resolve(cfg.training.precision, True, True)
    seq_len = min(lengths["max"], cfg.data.max_length) if lengths else None
    masked = bool(lengths) and lengths["min"] < seq_len and not cfg.data.packing
    w = workload_from_config(cfg, precision=policy.name, seq_len=seq_len, masked=masked)
    n = gpus * nodes
    shards = w.sp * w.tp * w.cp
    if n % shards:
        raise UserError(
            f"parallel.sp_size {w.sp} x tp_size {w.tp} x cp_size {w.cp} = {shards} does not divide the "
            f"{n} GPU(s) planned (--gpus x --nodes); plan a multiple of {shards} GPUs or change the sizes"
        )
    if not bandwidth["h2d_gbs"]:  # host<->device copies always count (PCIe), at an assumed bandwidth if unmeasured
        bandwidth = {**bandwidth, "h2d_gbs": search.H2D_GBS, "h2d_source": "assumed (PCIe 4.0 x16)"}
    where = {"gpus": gpus, "gpu": gpu_memory, "host": host_memory, "bandwidth": bandwidth}
    where["peak"] = gpu["peak_flops"] if gpu else search.PEAK_FLOPS
    rows = [plan_row(shape, w, row, n, where) for row in plan_rows(shape, w, n)]
    sequences, made = search.sequences_per_step(cfg)
    options = []
    for lever in search.lever_workloads(w, sequences, micro_batch=True, checkpointing=True):
        options += [plan_row(shape, lever, row, n, where) for row in plan_rows(shape, lever, n, methods=(w.method,))]
    options = [o for o in options if recommendable(o["strategy"], n)]
    p = shape.params
    plan = {
        "model": {
            "name": model_name,
            "source": model_config.source,
            "note": model_config.note or None,
            "model_type": shape.model_type,
            "parameters": p.total,
            "layers": shape.layers,
            "hidden": shape.hidden,
            "vocab": shape.vocab,
            "tied_embeddings": p.lm_head == 0,
            "max_positions": getattr(model_config, "max_position_embeddings", None),
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
            "gpu": gpu,
        },
        "recipe": cfg.recipe,
        "method": w.method,
        "assumptions": plan_notes(cfg, w, policy, shape, n // shards, overrides, sequences, made, lengths),
        "differences_from_deepspeed": DEEPSPEED_DIFFERENCES,
        "options": options,
        "rows": rows,
    }
    plan["answer"] = answer(plan, cfg, sequences, shards)
    return plan


def recommendable(strategy: str, world: int) -> bool:
    """Only what ships a recipe and its configs is an answer (the planner-only rows are for comparison); with
    several GPUs the single-device row is a reference only: it would leave the others idle."""
    return bool(by_key(strategy).recipe) and (world == 1 or by_key(strategy).multi_process)


def plan_row(shape: Shape, w: Workload, row: dict, n: int, where: dict) -> dict:
    """One strategy, method and set of levers: its memory, whether it fits, its traffic and estimated step time.
    `where`: {"gpus": per node, "gpu": bytes per GPU, "host": bytes per node, "bandwidth", "peak": FLOP/s}."""
    method_w = dataclasses.replace(w, method=row["method"])
    bandwidth = where["bandwidth"]
    traffic = step_traffic(shape, method_w, row["strategy"], n, row["regime"])
    times = step_time(traffic, bandwidth["busbw_gbs"], bandwidth["h2d_gbs"])
    host_node = row["host_total"] * where["gpus"]  # one process per GPU on each node
    fit_dev, fit_host = row["device_total"] / where["gpu"], host_node / where["host"]
    return {
        "method": row["method"],
        "strategy": row["strategy"],
        "micro_batch": w.micro_batch,
        "grad_accum": w.grad_accum,
        "gradient_checkpointing": w.gradient_checkpointing,
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
        "step_time": search.step_seconds(shape, method_w, times, where["peak"]),
    }


def answer(plan: dict, cfg, sequences: int, shards: int) -> dict:
    """The fastest option that fits, how it runs, and why nothing faster does: run.json-like facts the first line
    of the text says (plan_text.answer_lines)."""
    hw, options = plan["hardware"], plan["options"]
    best = search.fastest(options)
    gpu_memory, host_memory = hw["gpu_memory_gib"], hw["host_memory_gib"]
    if best is None:
        least = min(options, key=lambda r: r["device"]["total_gib"])
        lighter = {"full": "a lighter method (lora, qlora), ", "lora": "a lighter method (qlora), "}.get(
            plan["method"], ""
        )
        return {
            "strategy": None,
            "method": plan["method"],
            "reason": (
                f"nothing fits {plan['method']} with a {1 - MARGIN:.0%} margin, not even micro-batch 1 with gradient "
                f"checkpointing and offload: the least is {least['strategy']} at {least['device']['total_gib']:.1f} GiB "
                f"of {gpu_memory:.0f} GiB per GPU and {least['host_per_node_gib']:.1f} of {host_memory:.0f} GiB host; "
                f"use a shorter sequence, {lighter}or more or larger GPUs"
            ),
        }
    faster = [o for o in options if not o["fits"] and search.rank(o) < search.rank(best)]
    st = by_key(best["strategy"])
    seq_len = plan["assumptions"]["seq_len"]
    tokens = sequences * seq_len * (hw["world_size"] // shards)
    total = best["step_time"]["total_s"]
    out = {
        **{k: best[k] for k in ("strategy", "method", "micro_batch", "grad_accum", "gradient_checkpointing")},
        "offload": st.offload,
        "device_gib": best["device"]["total_gib"],
        "device_fraction": best["device_fraction"],
        "host_per_node_gib": best["host_per_node_gib"],
        "host_fraction": best["host_fraction"],
        "step_time": best["step_time"],
        "tokens_per_step": tokens,
        "tokens_per_s": round(tokens / total) if hw["gpu"] else None,
        "tokens_per_s_note": speed_note(hw, best),
        "faster_options_that_do_not_fit": [short(o) for o in sorted(faster, key=search.rank)],
        "command": command(cfg, best),
    }
    out["reason"] = (
        f"the fastest of {len(options)} options (strategy x micro-batch x checkpointing) that fits with a "
        f'{1 - MARGIN:.0%} margin, by the estimated step time (docs/planning.md "The answer")'
    )
    return out


def speed_note(hw: dict, best: dict) -> str:
    """What the predicted tokens/s rest on, or why there are none."""
    if not hw["gpu"]:
        return "tokens/s not predicted (the GPU's peak is unknown: --gpu NAME)"
    coll = (
        "at the given bandwidth" if best["step_time"]["collectives_s"] is not None else "not counted (no --bandwidth)"
    )
    return (
        f"{hw['gpu']['label']} at {hw['gpu']['peak_flops'] / 1e12:.0f} TFLOP/s x an assumed {search.MFU:.0%} MFU; "
        f"collectives {coll}, host copies at {hw['bandwidth']['h2d_gbs']:g} GB/s, nothing overlapped"
    )


def short(row: dict) -> dict:
    """An option in a few figures (what did not fit, and by how much)."""
    return {
        "strategy": row["strategy"],
        "micro_batch": row["micro_batch"],
        "grad_accum": row["grad_accum"],
        "gradient_checkpointing": row["gradient_checkpointing"],
        "device_gib": row["device"]["total_gib"],
        "device_fraction": row["device_fraction"],
        "host_fraction": row["host_fraction"],
    }


def command(cfg, row: dict) -> str:
    """The overrides that train the answer with the recipe (only what differs from it)."""
    st = by_key(row["strategy"])
    given = cfg.training.typed
    out = [f"finetune train --recipe {cfg.recipe}"]
    if cfg.run.strategy != st.name or cfg.run.offload not in ("any", st.offload):
        out += [
            f"--run.strategy={st.name}",
            f"--run.offload={st.offload}",
            f"--run.accelerate_config={st.accelerate_config}",
        ]
    if given.per_device_train_batch_size != row["micro_batch"]:
        out.append(f"--training.per_device_train_batch_size={row['micro_batch']}")
    if given.gradient_accumulation_steps != row["grad_accum"]:
        out.append(f"--training.gradient_accumulation_steps={row['grad_accum']}")
    if given.gradient_checkpointing != row["gradient_checkpointing"]:
        out.append(f"--training.gradient_checkpointing={str(row['gradient_checkpointing']).lower()}")
    return " ".join(out)


def plan_notes(cfg, w: Workload, policy, shape: Shape, dp: int, overrides, sequences, made, lengths) -> dict:
    """The plan's assumptions: the workload and where its numbers came from, the policy, the
    constants, and what is not modelled."""
    how = "" if cfg.training.precision != "auto" else " (auto on a GPU with bf16)"
    return {
        "workload": workload_note(cfg, w, overrides, sequences, made, lengths),
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


def workload_note(cfg, w: Workload, overrides, sequences: int, made: str, lengths: dict | None) -> dict:
    """What the plan is for, and where each number came from (the recipe, the command line, the data)."""
    given = {o.split("=")[0] for o in overrides}

    def source(key: str) -> str:
        return "command line" if f"--{key}" in given else f"recipe {cfg.recipe}"

    return {
        "micro_batch": w.micro_batch,
        "micro_batch_from": source("training.per_device_train_batch_size"),
        "seq_len": w.seq_len,
        "seq_len_from": (
            f"the data's longest row ({lengths['source']})"
            if lengths
            else source("data.max_length") + " data.max_length"
        ),
        "lengths": lengths,
        "grad_accum": w.grad_accum,
        "sequences_per_device_step": sequences,
        "sequences_per_device_step_from": made,
        "tokens_per_micro_step": w.micro_batch * w.seq_len,
    }


def data_lengths(cfg, model_name: str, model_config) -> dict:
    """Token lengths of the training rows as the run builds them (finetune/data/build.py: its reading, rendering,
    tokenizing, truncating and packing; the machine's prepared copy when there is one), with the tokenizer of the
    planned model (or model.tokenizer_name_or_path). Imports transformers, hence torch."""
    from finetune.data.build import build_datasets
    from finetune.modeling.load import load_tokenizer

    model = dataclasses.replace(cfg.model, name_or_path=model_name)
    if not model.tokenizer_name_or_path and not model_config.source.startswith(("local", "Hugging Face cache")):
        raise UserError(
            f"data.path {cfg.data.path}: its token lengths need the tokenizer of {model_name}, and its config came "
            f"from the {model_config.source.split(' (')[0]}, which holds no tokenizer: pass "
            f"--model.tokenizer_name_or_path=DIR_OR_HUB_ID (that model's tokenizer) or a local --model"
        )
    tokenizer = load_tokenizer(model)
    bundle = build_datasets(cfg.data, tokenizer, seed=cfg.training.typed.seed)
    stats = length_stats([len(ids) for ids in bundle.train["input_ids"]])
    tok = model.tokenizer_name_or_path or model_name
    return {**stats, "source": f"{cfg.data.path}, {stats['rows']:,} training rows tokenized by {tok}'s tokenizer"}


def run(args, overrides: list[str], gpu: dict | None = None) -> int:
    """`finetune plan` (finetune/cli/dispatch.py): `gpu` is --gpu resolved in the peak table, or None."""
    import shutil

    from finetune.config.recipe import load_recipe

    problems = list(getattr(args, "problems", []))  # the command line's (finetune/cli/dispatch.py parse)
    cfg, _ = load_recipe(args.recipe, overrides, problems)
    if args.gpus < 1 or args.nodes < 1:
        problems.append(f"--gpus and --nodes must be >= 1, got {args.gpus} and {args.nodes}")
    if problems:
        raise ConfigError(problems, "finetune plan")
    name = args.model or cfg.model.name_or_path
    model_config = model_source.read_config(name, None if args.model else cfg.model.revision)
    lengths = data_lengths(cfg, name, model_config) if cfg.data.path != "demo" else None
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
            gpu=gpu,
            lengths=lengths,
        )
    except ValueError as e:  # an architecture the arithmetic does not cover
        raise UserError(f"--model {name}: {e}") from None
    width = shutil.get_terminal_size().columns
    print(json.dumps(plan, indent=2) if args.json else render(plan, all_methods=args.all, width=width))
    return 0


def step_time_constants() -> dict:
    return {
        "step_time_peak_flops": {
            "value": search.PEAK_FLOPS,
            "kind": "assumed",
            "source": "H100 SXM dense bf16 (whitepaper) when --gpu names no GPU: ranks the options only",
        },
        "step_time_mfu": {
            "value": search.MFU,
            "kind": "assumed",
            "source": "a tuned fine-tuning step (docs/benchmarks.md's target); not measured",
        },
        "h2d_gbs_when_not_measured": {
            "value": search.H2D_GBS,
            "kind": "assumed",
            "source": "PCIe 4.0 x16 pinned copies; `finetune bench-comm --out FILE` measures it",
        },
    }
