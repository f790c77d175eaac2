"""run.json `nodes` (docs/run_record.md): the machines the launch gathered (LaunchPlan.machines),
recorded when the trainer exists, with two figures per rank read from the live objects and gathered
across ranks: the parameter elements it holds when training begins (engaged_strategy.held_elements:
ZeRO-3 partitions, FSDP2 shards, or whole replicas) and its host memory high-water mark when
training ends (the meter's lifetime peak); summed per node by finetune/launch/nodes.py.
"""

from __future__ import annotations

from finetune.launch import nodes
from finetune.training.engaged_strategy import held_elements
from finetune.units import GIB


def install(trainer, machines, record) -> None:
    """Record `nodes` now (rank 0; `record` is None elsewhere) and add the callback that fills the
    figures. Every rank must call it: the callback gathers."""
    from transformers import TrainerCallback

    figures = [dict(nodes.NO_FIGURES) for _ in machines.ranks]
    partition: list = [None]  # how the parameters are split, once read

    def update(mine: dict) -> None:
        for entry, values in zip(figures, nodes.all_gather(mine)):
            entry.update(values)
        if record is not None:
            record.set("nodes", nodes.section(machines, figures, partition[0]))
            record.write()

    class _NodeFigures(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            local, full, partition[0] = held_elements(trainer.model_wrapped.parameters())
            update({"params_local": local, "params_full": full})

        def on_train_end(self, args, state, control, **kwargs):
            memory = trainer.meter.memory
            memory.host_peak_now()  # folds the mark since the last log into the lifetime peak
            update({"host_peak_rss_gib": round(memory.lifetime_host_peak / GIB, 4)})

    if record is not None:
        record.set("nodes", nodes.section(machines))
    trainer.add_callback(_NodeFigures())
