"""run.json `nodes` as typed structures (declared with the other sections in record_schema.py):
the machines a run spans, read from the live process group by finetune/launch/nodes.py."""

from __future__ import annotations

from typing import TypedDict


class RankPlace(TypedDict):
    rank: int
    local_rank: int
    node: str  # SLURMD_NODENAME under SLURM, else the host name
    node_rank: int  # the launch's machine rank (torchrun GROUP_RANK), else SLURM_NODEID, else 0
    hostname: str
    pid: int
    params_local: int | None  # parameter elements this rank holds, read when training begins
    params_full: int | None  # parameter elements of the whole model
    host_peak_rss_gib: float | None  # this rank's host RSS high-water mark, read when training ends


class NodeFigures(TypedDict):
    node_rank: int
    node: str
    ranks: list[int]
    params_local: int | None  # summed over the node's ranks
    param_fraction: float | None  # params_local / the model's elements
    host_peak_rss_gib: float | None  # the ranks' high-water marks summed


class SlurmJob(TypedDict):
    job_id: str
    job_nodelist: str | None
    step_nodes: int | None
    restart_count: int


class Nodes(TypedDict):
    """The machines the run spans, from the live process group (finetune/launch/nodes.py)."""

    world_size: int
    num_machines: int
    node_rank_from: str  # GROUP_RANK | SLURM_NODEID | one machine
    slurm: SlurmJob | None
    ranks: list[RankPlace]
    per_node: list[NodeFigures]
    param_partition: str | None  # how the parameters are split, read from the live engine
