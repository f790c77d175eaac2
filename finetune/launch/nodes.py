"""Where each rank runs (node name, node rank, pid), gathered once from the live process group into
LaunchPlan.machines (finetune/launch/plan.py), and run.json `nodes` built from it (docs/multinode.md
"What the run records": which variables name the node).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs."""

    rank: int
    local_rank: int
    node: str  # SLURMD_NODENAME under SLURM, else the host name
    node_rank: int
    node_rank_from: str  # GROUP_RANK | SLURM_NODEID | one machine
    hostname: str
    pid: int


@dataclass(frozen=True)
class SlurmStep:
    """The SLURM job (and job step) a launch runs in, from its environment."""

    job_id: str
    job_nodelist: str | None
    step_nodes: int | None  # SLURM_STEP_NUM_NODES: the nodes of the `srun` step; None outside a step
    restart_count: int  # SLURM_RESTART_COUNT: requeues before this segment

    @classmethod
    def from_env(cls, env=os.environ) -> SlurmStep | None:
        if not env.get("SLURM_JOB_ID"):
            return None
        return cls(
            env["SLURM_JOB_ID"],
            env.get("SLURM_JOB_NODELIST"),
            _int(env.get("SLURM_STEP_NUM_NODES")),
            _int(env.get("SLURM_RESTART_COUNT")) or 0,
        )


def this_rank(rank: int, local_rank: int, env=os.environ) -> RankPlace:
    """Where this process runs (pure given env: tests give it made-up ones)."""
    if env.get("GROUP_RANK", "").isdigit():
        node_rank, source = int(env["GROUP_RANK"]), "GROUP_RANK"
    elif env.get("SLURM_NODEID", "").isdigit():
        node_rank, source = int(env["SLURM_NODEID"]), "SLURM_NODEID"
    else:
        node_rank, source = 0, "one machine"
    hostname = socket.gethostname()
    node = env.get("SLURMD_NODENAME") or hostname
    return RankPlace(rank, local_rank, node, node_rank, source, hostname, os.getpid())


def gather(state, env=os.environ) -> tuple[tuple[RankPlace, ...], SlurmStep | None]:
    """Every rank's place, by rank, and the SLURM step (collective: every rank calls it)."""
    mine = this_rank(getattr(state, "process_index", 0), getattr(state, "local_process_index", 0), env)
    ranks = sorted(all_gather(mine), key=lambda r: r.rank)
    return tuple(ranks), SlurmStep.from_env(env)


def all_gather(obj) -> list:
    """Every rank's `obj`, by rank (collective); [obj] without a process group of several ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# --- run.json `nodes` ------------------------------------------------------------------------------


NO_FIGURES = {"params_local": None, "params_full": None, "host_peak_rss_gib": None}


def section(machines, figures: list[dict] | None = None, partition: str | None = None) -> dict:
    """run.json `nodes` (finetune/telemetry/record_schema.py Nodes) from LaunchPlan.machines and, per rank,
    the live figures read so far (`figures[rank]`: NO_FIGURES' keys; null until read)."""
    ranks = [
        {**{k: v for k, v in dataclasses.asdict(r).items() if k != "node_rank_from"}, **NO_FIGURES}
        for r in machines.ranks
    ]
    for entry, mine in zip(ranks, figures or []):
        entry.update(mine)
    slurm = machines.slurm
    return {
        "world_size": len(ranks),
        "num_machines": machines.num_machines,
        "node_rank_from": machines.ranks[0].node_rank_from if machines.ranks else None,
        "slurm": dataclasses.asdict(slurm) if slurm is not None else None,
        "ranks": ranks,
        "per_node": per_node(ranks),
        "param_partition": partition,
    }


def per_node(ranks: list[dict]) -> list[dict]:
    """Per node rank: its name, its ranks, the parameter elements they hold (and the fraction of the
    model's) and their host memory high-water marks summed; null where a rank has no figure yet."""
    out = []
    for node_rank in sorted({r["node_rank"] for r in ranks}):
        mine = [r for r in ranks if r["node_rank"] == node_rank]
        local = _sum(r["params_local"] for r in mine)
        full = mine[0]["params_full"]
        host = _sum(r["host_peak_rss_gib"] for r in mine)
        out.append(
            {
                "node_rank": node_rank,
                "node": mine[0]["node"],
                "ranks": [r["rank"] for r in mine],
                "params_local": local,
                "param_fraction": round(local / full, 4) if local is not None and full else None,
                "host_peak_rss_gib": round(host, 4) if host is not None else None,
            }
        )
    return out


def _sum(values):
    values = list(values)
    return None if not values or any(v is None for v in values) else sum(values)


def _int(text):
    return int(text) if text and str(text).isdigit() else None
