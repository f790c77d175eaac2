"""The run's fault handling inside Trainer (docs/faults.md): stop signals and non-finite values agreed once per
optimizer step (ResilienceCallback, StepFlags; docs/speed.md "Per-micro-batch work"), and a collapsed model
(CollapseWatch; docs/faults.md "A collapsed model"). A further per-step check adds a slot to SLOTS, not a collective.
"""

from __future__ import annotations

import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import TrainerCallback

from finetune.checkpointing import checkpoints
from finetune.errors import EXIT_NONFINITE, UserError
from finetune.training import fault_injection, signals
from finetune.training.signals import flags_per_rank
from finetune.training.trainer import FinetuneTrainer

log = logging.getLogger("finetune")


class Diverged(RuntimeError):
    """Training stopped because it went wrong (exit 3): a non-finite value, or a collapse."""

    exit_code = EXIT_NONFINITE

    def __init__(self, message: str, skipped: list[dict]):
        super().__init__(message)
        self.skipped = skipped  # steps skipped before this one (training.on_nonfinite: skip)


class CollapseError(Diverged):
    pass


class CollapseWatch(TrainerCallback):
    def __init__(self, *, policy: str, windows: int, vocab_size: int | None):
        self.policy, self.windows, self.vocab_size = policy, windows, vocab_size
        self.zero_windows = 0  # consecutive log windows with a gradient norm of exactly 0
        self.found: str | None = None  # what was seen, once the collapse is established

    def on_log(self, args, state, control, logs=None, **kwargs):
        norm = (logs or {}).get("grad_norm")
        if norm is None or "loss" not in logs:
            return
        self.zero_windows = self.zero_windows + 1 if norm == 0 else 0
        if self.zero_windows < self.windows or self.found is not None:
            return
        self.found = self._describe(state.global_step, logs["loss"], args.logging_steps)
        if self.policy == "stop":
            control.should_training_stop = True  # this log window is recorded; the loop ends after it
            log.error("%s; stopping (training.on_collapse: stop)", self.found)
        else:
            log.warning("%s; training goes on (training.on_collapse: flag): the run will end failed", self.found)

    def stopped(self, skipped: list[dict]) -> CollapseError | None:
        """The error a run stopped by the collapse ends with, once Trainer's loop returned; else None."""
        if self.found is None or self.policy != "stop":
            return None
        return CollapseError(f"{self.found}; stopped (training.on_collapse: stop)", skipped)

    def error(self, skipped: list[dict]) -> CollapseError | None:
        """The error a flagged run ends with once it trained to the end and exported; else None."""
        if self.found is None or self.policy != "flag":
            return None
        return CollapseError(f"{self.found}; trained to the end and exported (training.on_collapse: flag)", skipped)

    def _describe(self, step: int, loss: float, logging_steps: float) -> str:
        uniform = math.log(self.vocab_size) if self.vocab_size else None
        at_uniform = (
            f" = ln({self.vocab_size}), a uniform prediction"
            if uniform and abs(loss - uniform) <= 1e-3 * uniform
            else f" (ln of the vocabulary: {uniform:.4f})"
            if uniform
            else ""
        )
        return (
            f"the model collapsed: gradient norm exactly 0 in {self.zero_windows} consecutive log windows up to step "
            f"{step} (logging_steps {logging_steps:g}), loss {loss:.4f}{at_uniform}: nothing trains any more. "
            f"Lower training.learning_rate (or raise warmup_steps) and start again from the last checkpoint before it"
        )


# What each rank's row holds: a 0/1 flag and the first non-finite value of each checked quantity, and
# this rank's signal code (finetune/training/signals.py `code`: 0 for none).
SLOTS = ("loss", "loss_value", "grad_norm", "grad_norm_value", "signal")
CHECKED = {"loss": "loss", "grad_norm": "gradient norm"}  # slot -> the name in messages and run.json


class NonFiniteError(Diverged):
    """A non-finite loss or gradient norm that every rank agreed on (exit 3)."""


def check_policy(policy: str, distributed_type: str) -> None:
    if policy == "skip" and distributed_type == "DEEPSPEED":
        raise UserError(
            "training.on_nonfinite: 'skip' is not implemented under DeepSpeed (its engine runs the "
            "optimizer step inside backward, so the update cannot be dropped from outside); "
            "use 'stop' (the default) and resume from the last checkpoint"
        )


@dataclass(frozen=True)
class Agreed:
    """Every rank's row of one step's agreement, the same on every rank."""

    rows: list[list[float]]

    def ranks(self, slot: str) -> list[int]:
        i = SLOTS.index(slot)
        return [r for r, row in enumerate(self.rows) if row[i]]

    def value(self, slot: str, rank: int) -> float:
        return self.rows[rank][SLOTS.index(slot)]

    def nonfinite(self) -> tuple[str, list[int]] | None:
        """(the checked slot, its ranks) of the first non-finite quantity, the loss before the norm
        (a non-finite loss makes the norm non-finite too); None when every rank's step was finite."""
        for slot in CHECKED:
            ranks = self.ranks(slot)
            if ranks:
                return slot, ranks
        return None

    def signals(self) -> list[int]:
        """Each rank's signal code (finetune/training/signals.py `code`: 0 for none)."""
        return [int(self.value("signal", r)) for r in range(len(self.rows))]


class StepFlags:
    """This rank's row of the current optimizer step, on the device, until `agree` reads it."""

    def __init__(self, device):
        self.values = torch.zeros(len(SLOTS), dtype=torch.float32, device=device)

    def note(self, slot: str, value: torch.Tensor) -> None:
        """Fold `value` (a loss, a gradient norm) into the step's row: device kernels, no host sync."""
        v = value.detach().float().reshape(-1)
        if v.device != self.values.device:  # a CPU-offloaded norm; never the case for the loss
            v = v.to(self.values.device, non_blocking=True)
        bad = ~torch.isfinite(v).all()
        i, j = SLOTS.index(slot), SLOTS.index(slot + "_value")
        self.values[j] = torch.where(bad & (self.values[i] == 0), v.sum(), self.values[j])  # keep the first
        self.values[i] = torch.where(bad, 1.0, self.values[i])

    def agree(self, accelerator, signum: int) -> Agreed:
        """Every rank's row on every rank: one all-gather (none on one process), one host read; the
        row starts again at zero for the next step."""
        self.values[SLOTS.index("signal")] = float(signum)  # a fill kernel: no host-to-device copy to wait for
        world = accelerator.num_processes
        gathered = accelerator.gather(self.values) if world > 1 else self.values
        rows = gathered.reshape(world, len(SLOTS)).tolist()  # the step's one host sync
        self.values.zero_()
        return Agreed(rows)


# --- signals, complete checkpoints, the non-finite guard ----------------------------------------------


class ResilienceCallback(TrainerCallback):
    def __init__(self, trainer: ResilientTrainer, *, save_total_limit: int | None, run_facts=None):
        self.trainer, self.stops = trainer, trainer.stops
        self.save_total_limit = save_total_limit
        self.preempted: dict | None = None  # {step, signal, ranks, relayed_by} once the ranks agreed to stop
        self.nothing_to_train = False  # resumed from a checkpoint of the last step
        self.last_complete: Path | None = None
        self.run_facts = run_facts  # () -> the marker's `run` block (finetune/checkpointing/provenance.py)

    # --- signals ---------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, **kwargs):
        # Resumed from a checkpoint of the last step (a run stopped after training): Trainer would
        # train one step past max_steps before it looks; there is nothing left to train.
        self.nothing_to_train = state.global_step >= state.max_steps > 0
        if self.nothing_to_train:
            log.info("resumed at step %d of %d: nothing left to train", state.global_step, state.max_steps)
            control.should_training_stop = True

    def on_step_begin(self, args, state, control, **kwargs):
        fault_injection.at_step_begin(rank=self.trainer.accelerator.process_index, step=state.global_step + 1)

    def on_step_end(self, args, state, control, **kwargs):
        self.stops.watch.step = state.global_step  # the last step done: the progress file carries it
        flags = self.trainer.agreement_of(state.global_step).signals()  # rode on the step's one agreement
        if any(flags) and self.preempted is None:
            self.preempted = {"step": state.global_step, **self.stops.describe(flags)}
            control.should_save = True
            control.should_training_stop = True

    def stop_after_training(self, flags: list[int]) -> None:
        """Every rank agreed (`flags`: every rank's signal flag, one non-zero) to stop after Trainer.train()
        returned: a complete checkpoint of the final step, and the run is preempted."""
        with self.stops.watch.during("the checkpoint of the final step", self.trainer.args.ddp_timeout):
            self.final_checkpoint()
        self.preempted = {"step": self.trainer.state.global_step, **self.stops.describe(flags)}

    def final_checkpoint(self) -> Path:
        """A complete checkpoint of the final step, on every rank: the one saved at the last step (or resumed from) when
        every rank sees it complete, else saved now (agreed: a rank that cannot see it makes every rank save)."""
        trainer = self.trainer
        final = Path(trainer.args.output_dir) / f"checkpoint-{trainer.state.global_step}"
        missing = checkpoints.problem(final, verify=False) is not None
        if any(flags_per_rank(trainer.accelerator, int(missing))):
            log.warning("saving a checkpoint of the final step: %s", final)
            trainer._save_checkpoint(trainer.model_wrapped, trial=None)
            trainer.control = trainer.callback_handler.on_save(trainer.args, trainer.state, trainer.control)
        self.last_complete = final
        return final

    def on_prediction_step(self, args, state, control, **kwargs):
        self.stops.watch.progress()  # an evaluation batch done: the watchdog's limit counts from here

    # --- checkpoints -----------------------------------------------------------------------

    def on_save(self, args, state, control, **kwargs):
        acc = self.trainer.accelerator
        ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        acc.wait_for_everyone()  # every rank's shards are on disk before the marker says so
        error = None
        if acc.is_main_process:
            try:
                run = self.run_facts() if self.run_facts else None
                checkpoints.write_marker(ckpt, step=state.global_step, world_size=acc.num_processes, run=run)
                checkpoints.rotate(Path(args.output_dir), self.save_total_limit, ckpt)
                log.info("checkpoint %s complete", ckpt)
            except Exception as e:  # noqa: BLE001 - agreed below: every rank raises
                error = e
        self.stops.agree(acc, f"the completion marker of {ckpt.name}", error, with_signals=False)  # not a plain barrier
        self.last_complete = ckpt


class ResilientTrainer(FinetuneTrainer):
    """FinetuneTrainer with the non-finite guard and the resilience callback installed. The guard
    keeps its flags on the device (StepFlags): no host sync and no collective
    per micro-batch; the ranks agree once per optimizer step, before its update."""

    def __init__(
        self,
        *args,
        stops: signals.Stops,
        save_total_limit: int | None = None,
        run_facts=None,
        on_nonfinite: str = "stop",
        max_nonfinite_skips: int = 0,
        on_collapse: str = "stop",
        collapse_windows: int = 3,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.stops = stops  # this process's stop signals and watchdog (finetune/training/signals.py)
        self.resilience = ResilienceCallback(self, save_total_limit=save_total_limit, run_facts=run_facts)
        self.add_callback(self.resilience)
        config = getattr(self.model, "config", None)
        vocab = getattr(config.get_text_config() if config is not None else None, "vocab_size", None)
        self.collapse = CollapseWatch(policy=on_collapse, windows=collapse_windows, vocab_size=vocab)
        self.add_callback(self.collapse)
        stops.install()  # normally done by finetune/train.py at start; again: no change
        self.on_nonfinite = on_nonfinite
        self.max_nonfinite_skips = max_nonfinite_skips
        self.skipped_steps: list[dict] = []
        self._skip_update = False
        check_policy(on_nonfinite, self.accelerator.distributed_type.value)
        self._deepspeed = self.accelerator.distributed_type.value == "DEEPSPEED"
        self.flags = StepFlags(self.accelerator.device)
        self._agreed: tuple[int, Agreed] | None = None  # (step, every rank's row) of the last agreement

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if self.resilience.nothing_to_train:  # no batch drawn: the step loop ends without a step
            return [], None
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def _save_checkpoint(self, model, trial):
        """Trainer's save, made an agreed outcome: a full disk (or quota, or read-only) on any rank is
        a StorageError on every rank (rank 0's names the checkpoint, the reason, the free space and
        the newest complete checkpoint); the incomplete one is removed (it has no marker; removing it
        frees its space for run.json). Any other error on any rank raises on every rank."""
        from finetune import storage

        acc = self.accelerator
        ckpt = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
        failure = error = None
        try:
            with self.stops.watch.during(f"the save of {ckpt.name}", self.args.ddp_timeout):  # the watchdog's limit
                super()._save_checkpoint(model, trial)
                fault_injection.at_save(rank=acc.process_index, step=self.state.global_step, ckpt=ckpt)
        except Exception as e:  # noqa: BLE001 - agreed below before any rank goes on
            failure, error = storage.error(e, ckpt, f"writing checkpoint {ckpt}"), e
        # every rank's outcome: 0 saved, an errno (a full or read-only disk), -1 any other error
        codes = flags_per_rank(acc, failure.errno if failure else -1 if error else 0)
        if not any(codes):
            return
        if -1 in codes:  # not the disk: every rank raises (its own error, or one naming the ranks that failed)
            if error is not None:
                raise error
            failed = [r for r, c in enumerate(codes) if c]
            raise signals.FailedElsewhere(f"writing checkpoint {ckpt} failed on rank(s) {failed}; stopped with them")
        if acc.is_main_process and ckpt.exists() and checkpoints.problem(ckpt) is not None:
            shutil.rmtree(ckpt, ignore_errors=True)
        acc.wait_for_everyone()
        if not acc.is_main_process:
            raise storage.StorageError(f"writing checkpoint {ckpt} failed (rank 0 says why)", failure and failure.errno)
        last = next((c for c in reversed(checkpoints.checkpoints(ckpt.parent)) if checkpoints.problem(c) is None), None)
        then = f"The incomplete {ckpt.name} was removed; " + (
            f"the newest complete checkpoint is {last}: free space, then continue with --resume"
            if last
            else "no complete checkpoint was written: free space, then run again"
        )
        ranks = [r for r, c in enumerate(codes) if c]
        code = next(c for c in codes if c)
        failed_at = failure.failed_at if failure else None
        where = f"writing checkpoint {ckpt}" + (f" on rank(s) {ranks}" if acc.num_processes > 1 else "")
        raise storage.StorageError(storage.message(code, ckpt, where, then, failed_at=failed_at), code)

    def faults_section(self) -> dict:
        """run.json `faults`: how this run meets a stalled rank, a non-finite step and old checkpoints."""
        return {
            "collective_timeout_s": self.args.ddp_timeout,
            "on_nonfinite": self.on_nonfinite,
            "max_nonfinite_skips": self.max_nonfinite_skips,
            "on_collapse": self.collapse.policy,
            "collapse_windows": self.collapse.windows,
            "save_total_limit": self.resilience.save_total_limit,
        }

    def agreement_of(self, step: int) -> Agreed:
        """The agreement of optimizer step `step`; an error if it did not run (a Trainer whose step no
        longer passes through the hooks below would otherwise train unguarded)."""
        if self._agreed is None or self._agreed[0] != step:
            raise RuntimeError(
                f"the ranks did not agree on optimizer step {step} before its update: the non-finite "
                "guard's hooks (compute_loss, _get_grad_norm) were not called as transformers 5.24 calls them"
            )
        return self._agreed[1]

    def _agree(self) -> None:
        """The step's one agreement (signals included); then stop, or mark the update skipped."""
        step = self.state.global_step + 1
        agreed = self.flags.agree(self.accelerator, self.stops.code())
        self._agreed = (step, agreed)
        if any(agreed.signals()):
            self.stops.watch.acted()  # the stop is agreed: the watchdog's grace period ends (checkpoint next)
        bad = agreed.nonfinite()
        if bad is None:
            return
        slot, ranks = bad
        what = CHECKED[slot]
        if self.on_nonfinite == "skip" and len(self.skipped_steps) < self.max_nonfinite_skips:
            self.skipped_steps.append({"step": step, "what": what, "ranks": ranks})
            log.warning(
                f"non-finite {what} at step {step} on rank(s) {ranks}: skipping this step's optimizer update "
                f"({len(self.skipped_steps)} of at most {self.max_nonfinite_skips})"
            )
            self._skip_update = True
            return
        limit = (
            f"; {len(self.skipped_steps)} step(s) already skipped, training.max_nonfinite_skips="
            f"{self.max_nonfinite_skips}"
            if self.on_nonfinite == "skip"
            else ""
        )
        values = ", ".join(f"rank {r}: {agreed.value(slot + '_value', r)}" for r in ranks)
        last = self.resilience.last_complete
        raise NonFiniteError(
            f"non-finite {what} at step {step} on rank(s) {ranks} ({values}); stopped before that step's "
            f"optimizer update{limit}. Last complete checkpoint: {last if last else 'none written in this run'}",
            list(self.skipped_steps),
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if not model.training:  # evaluation also comes through here
            return out
        loss = out[0] if return_outputs else out
        loss = fault_injection.corrupt_loss(loss, rank=self.accelerator.process_index, step=self.state.global_step + 1)
        self.flags.note("loss", loss)
        if self._deepspeed and self.accelerator.sync_gradients:
            self._agree()  # the step's last micro-batch: the engine steps inside its backward
        return (loss, *out[1:]) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        # A non-finite micro-batch adds 0 to the logged loss (its step is skipped or stops the run):
        # on the device, so Trainer's own per-micro-batch check (logging_nan_inf_filter) can stay off.
        return torch.nan_to_num(super().training_step(model, inputs, num_items_in_batch), 0.0, 0.0, 0.0)

    def _get_grad_norm(self, model, grad_norm=None):
        """Trainer computes the norm here (clipped or not) right before the optimizer step: the
        agreement point of every strategy but DeepSpeed, whose engine has stepped by now."""
        norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        if not self._deepspeed:
            if norm is not None:
                # FSDP2: this rank's part of a DTensor norm; the agreement ORs the ranks (no collective)
                local = norm.to_local() if hasattr(norm, "to_local") else torch.as_tensor(norm)
                self.flags.note("grad_norm", local)
            self._agree()
        return norm

    def create_optimizer(self, *args, **kwargs):
        opt = super().create_optimizer(*args, **kwargs)
        if self.on_nonfinite == "skip" and not getattr(opt, "_finetune_guarded", False):
            step = opt.step

            def guarded_step(*a, **k):
                if self._skip_update:
                    self._skip_update = False
                    return None  # gradients are zeroed by Trainer right after; no update, on every rank
                return step(*a, **k)

            opt.step = guarded_step
            opt._finetune_guarded = True
        return opt
