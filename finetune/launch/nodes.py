"""The machines a run spans, read from the live process group: run.json `nodes` (docs/multinode.md).

Each rank says where it runs and the ranks gather it (one all_gather_object after the process group
exists): its node name (SLURMD_NODENAME under SLURM, where every node of the test cluster shares
one host name; else the host name), its node rank (torchrun's GROUP_RANK, the launch's
--machine_rank; else SLURM_NODEID; else 0) and its process id. The number of machines is the number
of distinct node ranks. Later, from the live objects: the parameter elements each rank holds
(ZeRO-3 partitions, FSDP2 shards, or whole replicas) when training begins, and each rank's host
memory high-water mark when training ends, summed per node.

`machines_problem` refuses a launch whose machine count disagrees with what it runs on: a SLURM
job step on N nodes that formed another number of machines (num_machines left at 1: every node
trains alone), or `--machine_rank K` with fewer than K + 1 machines.
"""

from __future__ import annotations

import os
import socket
import sys

from finetune.units import GIB

_LAYOUT: dict | None = None  # this process's layout, gathered once
_HEARTBEAT = None  # finetune/launch/peers.py Heartbeat of this rank (multi-process runs)


def this_rank(rank: int, local_rank: int, env=os.environ) -> dict:
    """Where this process runs (pure given env: tests give it made-up ones)."""
    if env.get("GROUP_RANK", "").isdigit():
        node_rank, source = int(env["GROUP_RANK"]), "GROUP_RANK"
    elif env.get("SLURM_NODEID", "").isdigit():
        node_rank, source = int(env["SLURM_NODEID"]), "SLURM_NODEID"
    else:
        node_rank, source = 0, "one machine"
    hostname = socket.gethostname()
    return {"rank": rank, "local_rank": local_rank, "node": env.get("SLURMD_NODENAME") or hostname,
            "node_rank": node_rank, "node_rank_from": source, "hostname": hostname, "pid": os.getpid(),
            "params_local": None, "params_full": None, "host_peak_rss_gib": None}


def layout_of(ranks: list[dict], env=os.environ) -> dict:
    """run.json `nodes` from every rank's place (sorted by rank); per-node figures start empty."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
    node_ranks = sorted({r["node_rank"] for r in ranks})
    slurm = None
    if env.get("SLURM_JOB_ID"):
        slurm = {"job_id": env["SLURM_JOB_ID"], "job_nodelist": env.get("SLURM_JOB_NODELIST"),
                 "step_nodes": _int(env.get("SLURM_STEP_NUM_NODES")), "restart_count": _int(env.get("SLURM_RESTART_COUNT")) or 0}
    return {"world_size": len(ranks), "num_machines": len(node_ranks), "node_rank_from": ranks[0]["node_rank_from"],
            "slurm": slurm, "ranks": [{k: v for k, v in r.items() if k != "node_rank_from"} for r in ranks],
            "per_node": per_node(ranks), "param_partition": None}


def per_node(ranks: list[dict]) -> list[dict]:
    """Per node rank: its name, its ranks, the parameter elements they hold (and the fraction of the
    model's) and their host memory high-water marks summed; null where a rank has no figure yet."""
    out = []
    for node_rank in sorted({r["node_rank"] for r in ranks}):
        mine = [r for r in ranks if r["node_rank"] == node_rank]
        local = _sum(r["params_local"] for r in mine)
        full = mine[0]["params_full"]
        host = _sum(r["host_peak_rss_gib"] for r in mine)
        out.append({"node_rank": node_rank, "node": mine[0]["node"], "ranks": [r["rank"] for r in mine],
                    "params_local": local, "param_fraction": round(local / full, 4) if local is not None and full else None,
                    "host_peak_rss_gib": round(host, 4) if host is not None else None})
    return out


def gather(state) -> dict:
    """The layout, gathered across ranks once per process (collective: every rank calls it); starts
    this rank's heartbeat (finetune/launch/peers.py) in a multi-process run."""
    global _LAYOUT, _HEARTBEAT
    if _LAYOUT is not None:
        return _LAYOUT
    rank, world = getattr(state, "process_index", 0), state.num_processes
    layout = layout_of(_all_gather(this_rank(rank, getattr(state, "local_process_index", 0)), world))
    if _group_exists():  # a launched process: its layout does not change
        from finetune.launch import peers

        _LAYOUT, _HEARTBEAT = layout, peers.start(rank, world)
    return layout


def _group_exists() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _all_gather(obj, world_size: int) -> list:
    if world_size < 2 or not _group_exists():
        return [obj]
    import torch.distributed as dist

    out: list = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


# --- the launch's machine count ------------------------------------------------------------------


def declared_machines(launcher) -> tuple[int, int, str] | None:
    """(num_machines, machine_rank, where from) that `accelerate launch` was given: its command line,
    else its config file, else accelerate's defaults (1, 0); None for other launchers."""
    if launcher is None or launcher.kind not in ("accelerate launch", "finetune train"):
        return None
    values: dict = {}
    if launcher.config_file:
        from pathlib import Path

        from finetune.launch.configs import read_yaml

        try:
            values = read_yaml(Path(launcher.config_file))
        except Exception:  # noqa: BLE001 - an unreadable config is reported by the launch checks
            values = {}
    machines = _first(launcher.num_machines, values.get("num_machines"), 1)
    rank = _first(launcher.machine_rank, values.get("machine_rank"), 0)
    where = ("--num_machines on the launch line" if launcher.num_machines is not None
             else f"num_machines in {launcher.config_file}" if values.get("num_machines") is not None
             else "accelerate's default num_machines")
    return int(machines), int(rank), where


def machines_problem(layout: dict, launcher=None, env=os.environ) -> str | None:
    """The launch's machine count against the machines it runs on (module docstring), or None."""
    found = layout["num_machines"]
    declared, machine_rank, where = declared_machines(launcher) or (found, 0, "the launcher")
    config = getattr(launcher, "config_file", None) or "your accelerate config"
    step_nodes = _int(env.get("SLURM_STEP_NUM_NODES"))
    if step_nodes and step_nodes != found:
        return (f"this SLURM job step runs on {step_nodes} nodes (SLURM_STEP_NUM_NODES) but the launch formed "
                f"{found} machine(s) of {layout['world_size']} process(es) ({where}: {declared}): "
                f"{'each node would train alone' if found < step_nodes else 'the machine counts disagree'}. "
                f"Launch with --num_machines {step_nodes} --machine_rank $SLURM_NODEID (as "
                f"accelerate_configs/slurm_two_node.sbatch does), or set num_machines: {step_nodes} in {config}")
    if machine_rank >= found:
        return (f"--machine_rank {machine_rank} is machine {machine_rank + 1} of a multi-machine run, but the launch "
                f"formed {found} machine(s) ({where}: {declared}): this machine would train alone. Give every "
                f"machine's launch --num_machines {machine_rank + 1} (or more), or set num_machines in {config}")
    return None


# --- the live figures, recorded --------------------------------------------------------------------


def param_counts(model) -> tuple[int, int, str]:
    """(elements this rank holds, elements of the whole model, how they are split) from the live
    parameters: ZeRO-3 partitions (ds_tensor of ds_numel), FSDP2 DTensor shards, else whole."""
    params = list(model.parameters())
    if any(hasattr(p, "ds_numel") for p in params):
        return (sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params),
                sum(getattr(p, "ds_numel", p.numel()) for p in params), "zero3 partitions (ds_tensor of ds_numel)")
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in params):
        return (sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params),
                sum(p.numel() for p in params), "fsdp2 shards (DTensor local of global)")
    n = sum(p.numel() for p in params)
    return n, n, "replicated (every rank holds every parameter)"


def install(trainer, record, state) -> None:
    """Record the layout now and add the callback that fills the live figures: the parameters each
    rank holds when training begins, each rank's host memory high-water mark when it ends (both
    gathered: every rank must call this)."""
    from transformers import TrainerCallback

    layout = gather(state)

    def update(mine: dict) -> None:
        for entry, values in zip(layout["ranks"], _all_gather(mine, state.num_processes)):
            entry.update(values)
        layout["per_node"] = per_node(layout["ranks"])
        if record is not None:
            record.set("nodes", layout)
            record.write()

    class _NodeFigures(TrainerCallback):
        def on_train_begin(self, args, state_, control, **kwargs):
            local, full, how = param_counts(trainer.model_wrapped)
            layout["param_partition"] = how
            update({"params_local": local, "params_full": full})

        def on_train_end(self, args, state_, control, **kwargs):
            memory = trainer.meter.memory
            memory.host_peak_now()  # folds the mark since the last log into the lifetime peak
            update({"host_peak_rss_gib": round(memory.lifetime_host_peak / GIB, 4)})

    if record is not None:
        record.set("nodes", layout)
    trainer.add_callback(_NodeFigures())


def failure_note(error: BaseException) -> str | None:
    """After training failed on this rank: which ranks (and nodes) stopped answering, printed on
    stderr and returned for run.json; None in a one-process run, when every rank is still there, and
    for an interruption or a user error (nothing was lost)."""
    from finetune.errors import UserError

    if _HEARTBEAT is None or _LAYOUT is None or isinstance(error, (KeyboardInterrupt, SystemExit, UserError)):
        return None
    lost, store_error = _HEARTBEAT.lost()
    by_rank = {r["rank"]: r for r in _LAYOUT["ranks"]}
    if store_error:  # the store lives in the launcher of node rank 0
        gone = [r for r in _LAYOUT["ranks"] if r["node_rank"] == 0]
        note = (f"lost node {gone[0]['node']} (node rank 0, rank(s) {[r['rank'] for r in gone]}): the launcher's "
                f"store there no longer answers ({store_error})")
    elif lost:
        parts = []
        for nr, name in sorted({(by_rank[r]["node_rank"], by_rank[r]["node"]) for r in lost}):
            gone = [r for r in lost if by_rank[r]["node_rank"] == nr]
            whole = len(gone) == sum(1 for r in _LAYOUT["ranks"] if r["node_rank"] == nr)  # every rank of the node
            parts.append(f"lost node {name} (node rank {nr}): rank(s) {gone} stopped answering" if whole else
                         f"rank(s) {gone} on node {name} (node rank {nr}) stopped answering")
        note = "; ".join(parts)
    else:
        return None
    me = by_rank.get(_HEARTBEAT.rank, {})
    print(f"finetune: rank {_HEARTBEAT.rank} on node {me.get('node')}: {note}; this rank stops "
          f"({type(error).__name__}). Continue from the last complete checkpoint with --resume, on the nodes left "
          f"too (docs/faults.md)", file=sys.stderr, flush=True)
    return note


def _sum(values):
    values = list(values)
    return None if not values or any(v is None for v in values) else sum(values)


def _first(*values):
    return next(v for v in values if v is not None)


def _int(text):
    return int(text) if text and str(text).isdigit() else None
