"""`finetune plan`'s text: the table of every strategy, the breakdown of the recommended one (every
component at the predicted peak, allocated and reserved, the other moments of the step, the host
process), the recommendation and the assumptions with every constant's source."""

from __future__ import annotations

# Columns of the table: components by what they are (finetune/planning/memory.py names them).
COLUMNS = tuple(
    (column, tuple(names.split()))
    for column, names in {
        "params": "weights frozen_weights nf4_weights unquantized_weights lora_adapters fsdp_unsharded_root "
        "zero3_gathered_params fsdp_unsharded_blocks",
        "master": "master_weights",
        "optim": "optimizer_states",
        "grads": "ddp_grad_buckets grad_partition_buffer ipg_bucket accumulated_grads accumulated_grad_partition "
        "gradients tied_embedding_grad_parts head_grad upper_block_gradients fp32_grad_partition "
        "offload_grad_staging grads_in_partition fp32_subgroup_grad",
        "activ": "activations autocast_weight_copies recomputed_block rotary_and_targets forward_temporaries "
        "block_backward_temporaries norm_backward_temporaries",
        "loss": "loss_buffers",
    }.items()
)
NAMED = {name for _, names in COLUMNS for name in names}


def _cells(comp: dict) -> list[float]:
    cells = [sum(comp.get(k, 0.0) for k in keys) for _, keys in COLUMNS]
    cells.append(sum(v for k, v in comp.items() if k not in NAMED))  # cuBLAS workspaces, the batch, ...
    return cells


def breakdown_lines(row: dict) -> list[str]:
    d = row["device"]
    allowance = d["reserved_gib"] - d["allocated_gib"]
    lines = [
        f"breakdown of {row['method']} under {row['strategy']} ({row['precision']}; attention kernel "
        f"{row['attention_kernel']}):",
        f"  peak at {row['phase']}: {d['allocated_gib']:.2f} GiB allocated, {d['reserved_gib']:.2f} GiB reserved "
        f"(+{allowance:.2f} allocator), {d['total_gib']:.2f} GiB with the CUDA context "
        f"({d['cuda_context_gib']:.1f} GiB)",
    ]
    items = sorted(d["components_gib"].items(), key=lambda kv: -kv[1])
    for i in range(0, len(items), 3):
        lines.append("    " + "   ".join(f"{k} {v:.2f}" for k, v in items[i : i + 3]))
    others = ", ".join(f"{k} {v:.2f}" for k, v in d["phases_gib"].items() if k != row["phase"])
    lines.append(f"  other moments (allocated GiB): {others}")
    host = row["host_per_process"]
    lines.append(
        f"  host per process {host['total_gib']:.2f} GiB: "
        + ", ".join(f"{k} {v:.2f}" for k, v in host["components_gib"].items())
    )
    return lines


def _mesh_line(m: dict) -> str:
    """The mesh per device: what each rank holds of a sequence and of the blocks (finetune/mesh.py)."""
    if (m["sp"], m["tp"], m["cp"]) == (1, 1, 1):
        return f"mesh: data parallel {m['dp']} (no sequence, tensor or context parallelism)"
    held = []
    if m["sp"] > 1 or m["cp"] > 1:
        k = m["sp"] * m["cp"]
        held.append(f"1/{k} of every sequence (activations and logits / {k})")
    if m["tp"] > 1:
        held.append(f"1/{m['tp']} of every block's linear layers (their weights, grads, states and activations)")
    return (
        f"mesh: data parallel {m['dp']} x sp {m['sp']} x tp {m['tp']} x cp {m['cp']}: each GPU holds "
        + " and ".join(held)
        + "; only the strategies that run this mesh are listed"
    )


def render(plan: dict, all_methods: bool = True, width: int = 100) -> str:
    """The plan as text; every line but the table's wrapped at `width` (the terminal's)."""
    m, hw, a = plan["model"], plan["hardware"], plan["assumptions"]
    wl = a["workload"]
    lines = [
        f"planned for: {wl['micro_batch']} sequences x {wl['seq_len']} tokens per device per micro-step "
        f"({wl['tokens_per_micro_step']:,} tokens; micro-batch from {wl['micro_batch_from']}, sequence length "
        f"from {wl['seq_len_from']}), accumulation {wl['grad_accum']}; other sizes: "
        f"--training.per_device_train_batch_size=N --data.max_length=N",
        f"model {m['name']}: {m['model_type']}, {m['parameters'] / 1e9:.3f}B parameters, {m['layers']} layers, "
        f"hidden {m['hidden']}, vocab {m['vocab']}, {'tied' if m['tied_embeddings'] else 'untied'} embeddings; "
        f"LoRA adds {m['lora_parameters']:,}",
        f"hardware: {hw['nodes']} node(s) x {hw['gpus_per_node']} GPU(s) of {hw['gpu_memory_gib']:.0f} GiB, "
        f"host {hw['host_memory_gib']:.0f} GiB per node; fits = reserved + CUDA context <= "
        f"{hw['margin']:.0%} of each",
        f"recipe {plan['recipe']}: method {plan['method']}, precision {a['precision']}, micro-batch "
        f"{a['micro_batch']} x accumulation {a['grad_accum']}, sequence {a['seq_len']} ({a['layout']}), loss "
        f"{a['loss_impl']}, gradient checkpointing {'on' if a['gradient_checkpointing'] else 'off'}",
        _mesh_line(a["mesh"]),
        "GiB per device (2^30 bytes) at each row's predicted peak; comm = GB (1e9) sent per rank per optimizer step"
        + (
            f"; time at {hw['bandwidth']['busbw_gbs']:.1f} GB/s bus bandwidth ({hw['bandwidth']['source']}), "
            f"step s = compute (assumed GPU and MFU, below) + communication, not overlapped"
            if hw["bandwidth"]["busbw_gbs"]
            else "; pass --bandwidth for times"
        ),
        "",
    ]
    head = (
        f"{'method':6} {'strategy':18}"
        + "".join(f"{c:>7}" for c, _ in COLUMNS)
        + f"{'other':>7}"
        + f"{'alloc':>8}{'resrvd':>8}{'device':>8}{'host/node':>10}{'comm GB':>9}{'comm s':>8}{'h2d GB':>8}"
        + f"{'step s':>8}  fits"
    )
    table = [head, "-" * len(head)]
    for r in plan["rows"]:
        if not all_methods and r["method"] != plan["method"]:
            continue
        d, c = r["device"], r["communication"]
        coll = sum(c["collectives_bytes"].values()) / 1e9
        h2d = sum(c["host_device_bytes"].values()) / 1e9
        t = f"{c['collectives_s']:8.3f}" if c["collectives_s"] is not None else f"{'-':>8}"
        fit = "yes" if r["fits"] else ("barely" if r["fits_without_margin"] else "NO")
        table.append(
            f"{r['method']:6} {r['strategy']:18}"
            + "".join(f"{v:7.2f}" for v in _cells(d["components_gib"]))
            + f"{d['allocated_gib']:8.2f}{d['reserved_gib']:8.2f}{d['total_gib']:8.2f}"
            f"{r['host_per_node_gib']:10.2f}{coll:9.2f}{t}{h2d:8.2f}"
            + (f"{r['step_time']['total_s']:8.2f}" if r.get("step_time") else f"{'-':>8}")
            + f"  {fit}"
        )
    return "\n".join(_wrap(lines, width) + table + _wrap(_recommendation_lines(plan), width))


def _recommendation_lines(plan: dict) -> list[str]:
    """Below the table: the breakdown of the recommended row, the recommendation, the assumptions."""
    from finetune.strategies import STRATEGIES

    a, rec = plan["assumptions"], plan["recommendation"]
    extra = [s.key for s in STRATEGIES if not s.recipe]
    lines = [f"({', '.join(extra)}: for comparison; no recipe or config ships them, so never recommended)"]
    if plan["hardware"]["world_size"] > 1:
        lines.append("(single: one GPU of the same kind, for reference; not recommended when more are there)")
    shown = next((r for r in plan["rows"] if r["method"] == rec["method"] and r["strategy"] == rec["strategy"]), None)
    shown = shown or next((r for r in plan["rows"] if r["method"] == plan["method"]), None)
    if shown is not None:
        lines += [""] + breakdown_lines(shown)
    lines += ["", f"recommendation for {rec['method']}: {rec['strategy'] or 'none'}", f"  {rec['reason']}"]
    for s in rec["does_not_fit"]:
        lines.append(f"  does not fit: {s['strategy']}: {s['problem']}")
    lines += ["", f"assumptions: optimizer {a['optimizer']}; {a['gpu']}"]
    for name, c in a["constants"].items():
        lines.append(f"  {name} = {c['value']:g} ({c['kind']}: {c['source']})")
    lines.append("  not modelled: " + "; ".join(a["not_modelled"]))
    lines.append("differs from DeepSpeed's estimators: " + plan["differences_from_deepspeed"])
    return lines


def _wrap(lines: list[str], width: int) -> list[str]:
    """Each line wrapped at `width`, its continuation indented 4 past the line's own indent."""
    import textwrap

    return [
        textwrap.fill(line, width, subsequent_indent=" " * (len(line) - len(line.lstrip()) + 4), break_on_hyphens=False)
        if line
        else line
        for line in lines
    ]
