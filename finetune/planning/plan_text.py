"""`finetune plan`'s text, answer first: the fastest option that fits and how to train it, what it was planned
for, then the table (each shipped strategy at the recipe's levers and at its best levers that fit; --all: every
method and strategy too), the breakdown of the answer (every component at the predicted peak, allocated and
reserved, the other moments of the step, the host process), and the assumptions with every constant's source."""

from __future__ import annotations

from finetune.planning.search import fastest

# The components by what they are (finetune/planning/memory.py names them), also finetune/compare/plots.py's legend
# groups; the table shows the first four together as "states".
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
STATES = ("params", "master", "optim", "grads")
HEAD = (
    f"{'strategy':18}{'b x a':>6}{'ckpt':>5}{'states':>8}{'activ':>7}{'loss':>6}{'device':>8}{'use':>6}"
    f"{'host':>7}{'comm GB':>8}{'step s':>7}{'fits':>6}"
)


def _cells(comp: dict) -> list[float]:
    """(states, activ, loss) GiB of one row's components."""
    group = {column: sum(comp.get(k, 0.0) for k in keys) for column, keys in COLUMNS}
    return [sum(group[c] for c in STATES), group["activ"], group["loss"]]


def answer_lines(plan: dict) -> list[str]:
    """The answer (line 1), how to train it, and why."""
    a = plan["answer"]
    if a["strategy"] is None:
        return [f"answer: none: {a['reason']}"]
    hw = plan["hardware"]
    ckpt = "on" if a["gradient_checkpointing"] else "off"
    speed = f"~{a['tokens_per_s']:,} tokens/s predicted" if a["tokens_per_s"] else a["tokens_per_s_note"]
    lines = [
        f"answer: {a['strategy']}, micro-batch {a['micro_batch']} x accumulation {a['grad_accum']}, gradient "
        f"checkpointing {ckpt}, offload {a['offload']}; GPU {a['device_gib']:.1f} of {hw['gpu_memory_gib']:.0f} GiB "
        f"({a['device_fraction']:.0%}), host {a['host_per_node_gib']:.1f} of {hw['host_memory_gib']:.0f} GiB per node "
        f"({a['host_fraction']:.0%}); {speed}",
        f"  train it: {a['command']}",
    ]
    if a["tokens_per_s"]:
        lines.append(f"  speed: {a['tokens_per_step']:,} tokens per optimizer step; {a['tokens_per_s_note']}")
    faster = a["faster_options_that_do_not_fit"]
    why = f"  why: {a['reason']}"
    if faster:
        shown = ", ".join(
            f"{o['strategy']} {o['micro_batch']}x{o['grad_accum']} {'on' if o['gradient_checkpointing'] else 'off'} "
            f"({o['device_gib']:.1f} GiB, {o['device_fraction']:.0%})"
            for o in faster[:4]
        )
        why += f"; faster ones that do not fit: {shown}" + (f" and {len(faster) - 4} more" if len(faster) > 4 else "")
    return lines + [why]


def context_lines(plan: dict) -> list[str]:
    """What the answer is for: the workload and where each number came from, the model, the hardware."""
    m, hw, a = plan["model"], plan["hardware"], plan["assumptions"]
    wl = a["workload"]
    lengths = wl["lengths"]
    seq = (
        f"sequence {wl['seq_len']:,} = the data's longest row (p50 {lengths['p50']:,}, p95 {lengths['p95']:,}, "
        f"max {lengths['max']:,} tokens: {lengths['source']})"
        if lengths
        else f"sequence {wl['seq_len']:,} from {wl['seq_len_from']} (--data.path=FILE plans from the data's lengths)"
    )
    note = f"; {m['note']}" if m["note"] else ""
    return [
        f"for: {plan['method']} of {m['name']}, {wl['sequences_per_device_step']} sequences per GPU per optimizer step "
        f"({wl['sequences_per_device_step_from']}: the search keeps it), {seq}",
        f"model {m['name']}: {m['model_type']}, {m['parameters'] / 1e9:.3f}B parameters, {m['layers']} layers, "
        f"hidden {m['hidden']}, vocab {m['vocab']}, {'tied' if m['tied_embeddings'] else 'untied'} embeddings; "
        f"LoRA adds {m['lora_parameters']:,}; from the {m['source']}{note}",
        f"hardware: {hw['nodes']} node(s) x {hw['gpus_per_node']} GPU(s) of {hw['gpu_memory_gib']:.0f} GiB, "
        f"host {hw['host_memory_gib']:.0f} GiB per node; fits = reserved + CUDA context <= {hw['margin']:.0%} of each",
        f"recipe {plan['recipe']}: precision {a['precision']}, loss {a['loss_impl']}, layout {a['layout']}",
        _mesh_line(a["mesh"]),
    ]


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


def table_rows(plan: dict, all_methods: bool) -> list[dict]:
    """Each answerable strategy at the recipe's levers, then its fastest option that fits when that differs; with
    all_methods, every method and strategy at the recipe's levers after them."""
    a = plan["assumptions"]
    given = (a["micro_batch"], a["grad_accum"], a["gradient_checkpointing"])
    out = []
    for strategy in dict.fromkeys(o["strategy"] for o in plan["options"]):
        mine = [o for o in plan["options"] if o["strategy"] == strategy]
        as_given = next(
            (o for o in mine if (o["micro_batch"], o["grad_accum"], o["gradient_checkpointing"]) == given), None
        )
        out += [r for r in (as_given, fastest(mine)) if r is not None]
    if all_methods:
        out += plan["rows"]
    return list({id(r): r for r in out}.values())


def table_line(r: dict, plan: dict, all_methods: bool) -> str:
    d, c, a = r["device"], r["communication"], plan["answer"]
    coll = sum(c["collectives_bytes"].values()) / 1e9
    fit = "yes" if r["fits"] else ("barely" if r["fits_without_margin"] else "NO")
    chosen = a["strategy"] is not None and all(
        r[k] == a[k] for k in ("strategy", "method", "micro_batch", "grad_accum", "gradient_checkpointing")
    )
    name = f"{r['method']:6} {r['strategy']}" if all_methods else r["strategy"]
    return (
        f"{name:{25 if all_methods else 18}}{str(r['micro_batch']) + 'x' + str(r['grad_accum']):>6}"
        f"{'on' if r['gradient_checkpointing'] else 'off':>5}"
        + "".join(f"{v:{w}.2f}" for v, w in zip(_cells(d["components_gib"]), (8, 7, 6)))
        + f"{d['total_gib']:8.2f}{r['device_fraction']:6.0%}{r['host_per_node_gib']:7.1f}{coll:8.2f}"
        + f"{r['step_time']['total_s']:7.2f}{fit:>6}"
        + ("  <-" if chosen else "")
    )


def breakdown_lines(row: dict) -> list[str]:
    d = row["device"]
    allowance = d["reserved_gib"] - d["allocated_gib"]
    lines = [
        f"breakdown of the answer, {row['method']} under {row['strategy']} ({row['precision']}; attention kernel "
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


def render(plan: dict, all_methods: bool = False, width: int = 100) -> str:
    """The plan as text; every line wrapped at `width` (the terminal's), the table kept whole."""
    hw = plan["hardware"]
    legend = (
        "GiB per GPU (2^30 bytes) at each option's predicted peak: states = weights, master, optimizer and gradient "
        "buffers; device = reserved + CUDA context; use = device / GPU; host = GiB per node; comm = GB (1e9) sent "
        "per GPU per optimizer step; step s = estimated optimizer step"
        + (
            f" (communication at {hw['bandwidth']['busbw_gbs']:.1f} GB/s, {hw['bandwidth']['source']}, not overlapped)"
            if hw["bandwidth"]["busbw_gbs"]
            else " (compute only: pass --bandwidth to count communication)"
        )
        + "; b x a = micro-batch x accumulation; <- the answer"
    )
    head = f"{'method':7}{'strategy':18}" + HEAD[18:] if all_methods else HEAD
    table = [head, "-" * len(head)] + [table_line(r, plan, all_methods) for r in table_rows(plan, all_methods)]
    top = answer_lines(plan) + [""] + context_lines(plan) + ["", legend]
    return "\n".join(_wrap(top, width) + table + _wrap(_after_table(plan, all_methods), width))


def _after_table(plan: dict, all_methods: bool) -> list[str]:
    """Below the table: notes on the rows, the breakdown of the answer, the assumptions."""
    from finetune.strategies import STRATEGIES

    a = plan["assumptions"]
    lines = []
    if all_methods:
        extra = [s.key for s in STRATEGIES if not s.recipe]
        lines.append(f"({', '.join(extra)}: for comparison; no recipe or config ships them, so never an answer)")
    if plan["hardware"]["world_size"] > 1 and all_methods:
        lines.append("(single: one GPU of the same kind, for reference; never the answer when more are there)")
    if plan["method"] == "qlora" or all_methods:
        lines.append(
            "(qlora under single/DDP keeps peft's fp32 norms and embedding, so its residual stream and what the "
            "blocks save are fp32; FSDP2 and DeepSpeed cast them to bf16: their activations are smaller)"
        )
    chosen = plan["answer"]
    row = next(
        (
            o
            for o in plan["options"]
            if chosen["strategy"] is not None
            and all(o[k] == chosen[k] for k in ("strategy", "micro_batch", "grad_accum", "gradient_checkpointing"))
        ),
        None,
    )
    if row is not None:
        lines += [""] + breakdown_lines(row)
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
