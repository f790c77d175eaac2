"""What happens around training, in one list (docs/architecture.md "The hooks"): `RunHooks`, whose methods name in order
what a run records and checks. Every rank runs them: the node figures and the bf16-true share are gathered.
"""

from __future__ import annotations

import logging

from transformers import TrainerCallback

from finetune import precision
from finetune.checkpointing import resume
from finetune.errors import UserError
from finetune.launch import nodes
from finetune.precision import dtype_name
from finetune.training import precision_evidence, strategy_evidence
from finetune.units import GIB

log = logging.getLogger("finetune")


class RunHooks(TrainerCallback):
    """The run's records and checks around training (docs/architecture.md "The hooks"). `machines`: the launch's
    (LaunchPlan.machines), for run.json `nodes`; None leaves `nodes` out (the benchmark)."""

    def __init__(self, trainer, cfg, launch, *, learning_rate: float, sinks, machines=None):
        self.trainer, self.sinks, self.machines = trainer, sinks, machines
        self.expected = (cfg.run.strategy, cfg.run.offload, cfg.recipe, launch.mesh)
        self.policy, self.family, self.method = launch.policy, launch.family, cfg.method.name
        self.requested, self.learning_rate = cfg.training.precision, learning_rate
        self.load_dtype = launch.policy.load_dtype(cfg.method.name)
        self.figures = [dict(nodes.NO_FIGURES) for _ in machines.ranks] if machines else []
        self.partition: str | None = None  # how the parameters are split, once read
        self.record_declared_strategy(launch.setup)
        self.record_declared_precision()
        self.record_declared_nodes()

    # --- once the Trainer exists ------------------------------------------------------------------------

    def record_declared_strategy(self, setup) -> None:
        """The strategy Accelerate's state says, refused now if it is not the recipe's."""
        state = self.trainer.accelerator.state
        strategy, offload, recipe, _ = self.expected
        self.declared = strategy_evidence.engaged(state, method=self.method, setup=setup, expected=strategy)
        strategy_evidence.check_expected(strategy, self.declared, recipe, offload)
        self.sinks.put(strategy=self.declared)

    def record_declared_precision(self) -> None:
        declared = dict(requested=self.requested, family=self.family, load_dtype=self.load_dtype)
        self.sinks.put(precision=precision_evidence.declared(self.policy, **declared))

    def record_declared_nodes(self) -> None:
        if self.machines:
            self.sinks.put(nodes=nodes.section(self.machines))

    # --- training begins: the wrapped model and the optimizer exist, no step has run ---------------------

    def on_train_begin(self, args, state, control, **kwargs):
        self.record_live_strategy_and_mesh()
        expected_compute = self.record_live_precision(state.is_world_process_zero)
        self.record_node_parameters()
        self.confirm_in_first_forward(expected_compute)

    def record_live_strategy_and_mesh(self) -> None:
        """The strategy and the mesh the wrapped engine and the live groups show (run.json `strategy`,
        the resumed segment's mesh), refused if either is not the recipe's: nothing was trained yet."""
        section = strategy_evidence.live_section(self.trainer.model_wrapped, self.trainer.accelerator, self.declared)
        parallel = section["parallel"]
        mesh = {k: parallel[k] for k in ("sp", "tp", "cp")}
        self.sinks.put(strategy=section, resumes=resume.noted(self.sinks.view, mesh=mesh))
        strategy, offload, recipe, planned = self.expected
        strategy_evidence.check_expected(strategy, section, recipe, offload)
        if planned is not None:
            strategy_evidence.check_mesh(parallel, planned, recipe)

    def record_live_precision(self, main: bool) -> str:
        """The precision the live objects show (run.json `precision`), refused if it is not the policy's;
        returns the compute dtype the first forward must show."""
        section = precision_evidence.live_section(
            self.trainer,
            self.policy,
            requested=self.requested,
            family=self.family,
            method=self.method,
            load_dtype=self.load_dtype,
            learning_rate=self.learning_rate,
        )
        if section["warning"] and main:
            log.warning(section["warning"])
        self.sinks.put(precision=section)
        problems = precision.mismatches(self.policy, self.family, section)
        if problems:
            raise UserError(
                f"training.precision {precision.policy_label(self.policy, self.requested)} did not engage "
                f"(read from the live objects before the first optimizer step; nothing was "
                f"trained): " + "; ".join(problems)
            )
        return section["compute_dtype"]

    def record_node_parameters(self) -> None:
        """The parameter elements each rank holds (ZeRO-3 partitions, FSDP2 shards or whole replicas),
        gathered into run.json `nodes`."""
        if self.machines:
            params = self.trainer.model_wrapped.parameters()
            local, full, self.partition = strategy_evidence.held_elements(params)
            self._record_node_figures({"params_local": local, "params_full": full})

    def confirm_in_first_forward(self, expected: str) -> None:
        """The output dtype of the first trainable Linear in step 1's first forward
        (run.json `precision.observed_compute_dtype`), refused if it is not `expected`."""
        linear = precision_evidence.first_observable_linear(self.trainer.model_wrapped)
        if linear is None:
            return

        def hook(module, inputs, output):
            handle.remove()
            seen = dtype_name(output.dtype)
            self.sinks.merge("precision", observed_compute_dtype=seen)
            if seen != expected:
                raise UserError(
                    f"the first forward computed in {seen}, but the live objects said {expected} "
                    f"(run.json precision.evidence has the details); nothing was trained"
                )

        handle = linear.register_forward_hook(hook)

    # --- training ends --------------------------------------------------------------------------------

    def on_train_end(self, args, state, control, **kwargs):
        self.record_node_host_peaks()

    def record_node_host_peaks(self) -> None:
        """Each rank's host memory high-water mark (the meter's lifetime peak), gathered into `nodes`: when training
        ends (what a stopped run keeps), and again by final_measurements() after the meter's last memory window."""
        if self.machines:
            memory = self.trainer.meter.memory
            memory.host_peak_now()  # folds the mark since the last log into the lifetime peak
            self._record_node_figures({"host_peak_rss_gib": round(memory.lifetime_host_peak / GIB, 4)})

    # ----------------------------------------------------------------------------------------------------

    def _record_node_figures(self, mine: dict) -> None:
        for entry, values in zip(self.figures, nodes.all_gather(mine)):
            entry.update(values)
        self.sinks.put(nodes=nodes.section(self.machines, self.figures, self.partition))
