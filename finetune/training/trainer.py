"""The run's Trainer: transformers.Trainer that measures each step and keeps the record current (the fault handling on
top of it: finetune/training/resilience.py). FinetuneTrainer feeds the meter (finetune/telemetry/meter.py) from inside
the step, before Trainer hands a log window to its callbacks, so every `report_to` integration receives the extra keys.
What Ulysses sequence parallelism needs of it (the loss, ShardLoader): docs/parallelism.md.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ProgressCallback

from finetune.checkpointing.resume_plan import restore_rng
from finetune.data.collate import COUNTS_KEY, REAL_TOKENS_KEY
from finetune.data.render import IGNORE_INDEX
from finetune.modeling.loss import SCORED_TOKENS_KWARG, installed
from finetune.telemetry.meter import BatchShare, Meter, counting
from finetune.telemetry.sinks import Sinks
from finetune.training import fault_injection, rank_imports


class _StepClock(TrainerCallback):
    """Drives the meter's clock: training begins, each optimizer step begins and ends."""

    def __init__(self, trainer: FinetuneTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        # the model is prepared: the mesh's groups exist, and each rank knows how its batches count
        self.trainer.meter.share = batch_share(self.trainer.model_wrapped, self.trainer.accelerator)
        fault_injection.install_tp_partial_sums(
            self.trainer.model_wrapped, rank=self.trainer.accelerator.process_index, step=self.trainer.next_step
        )
        self.trainer.meter.start_training(self.trainer.accelerator)

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer.meter.step_begin()

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.meter.step_end()


class FinetuneTrainer(Trainer):
    """`sinks`: where each log window goes (finetune/telemetry/sinks.py); `resumed_world_size`: the world size that
    wrote the checkpoint resumed from (its RNG streams, `_load_rng_state`); `find_unused_parameters`: DDP's, as the run
    decided it from the model (finetune/training/speed.py; None: TrainingArguments' rule)."""

    def __init__(
        self,
        *args,
        sinks: Sinks,
        model_flops=None,
        peak_flops=None,
        resumed_world_size=None,
        find_unused_parameters=None,
        **kwargs,
    ):
        self.find_unused_parameters = find_unused_parameters  # read by Trainer.__init__ (_build_accelerator_args)
        super().__init__(*args, **kwargs)
        self.sinks = sinks
        if self.pop_callback(ProgressCallback) is not None:
            self.add_callback(CompactProgress)
        self.meter = Meter(model_flops=model_flops, peak_flops=peak_flops)
        pc = self.accelerator.parallelism_config
        self.sequence_parallel = pc is not None and pc.sp_enabled and pc.sp_backend == "deepspeed"
        if not self.sequence_parallel:  # Ulysses re-cuts the collator's batches: counted on the device there
            self.data_collator = counting(self.data_collator)  # the meter's counts, on the host (train and eval)
        self.add_callback(_StepClock(self))
        # The chunked loss takes its scored-token count from the host (no nonzero() sync per micro-batch);
        # not under torch.compile, which skips the compaction and would recompile for every new count,
        # nor under a mesh (a rank's shard of the positions is not the batch the host counted).
        mesh = pc is not None and (pc.tp_enabled or pc.cp_enabled or pc.sp_enabled)
        self._pass_scored = (
            bool((installed(self.model) or {}).get("compact")) and not self.args.torch_compile and not mesh
        )
        self.resumed_world_size = resumed_world_size
        self._logged_share = 1.0  # a rank's share of the logged loss (sequence_parallel_loss)
        if self.sequence_parallel:  # sequence_parallel_loss divides by the step's token count itself
            self.loss_is_scaled_for_ga = True
            route_skips()

    def _build_accelerator_args(self, **kwargs) -> dict:
        """Trainer's, with DDP's find_unused_parameters as decided (Trainer reads TrainingArguments', built before
        the model could be probed); run.json speed.ddp checks the live handler against the decision."""
        args = super()._build_accelerator_args(**kwargs)
        if self.find_unused_parameters is not None:  # its one handler: DistributedDataParallelKwargs
            args["kwargs_handlers"] = [
                dataclasses.replace(handler, find_unused_parameters=self.find_unused_parameters)
                for handler in args["kwargs_handlers"]
            ]
        return args

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """Trainer's, with DeepSpeed's sequence-parallel dataloader adapter made a ShardLoader
        (epochs and mid-epoch resumption; docs/parallelism.md "The dataloader")."""
        model, loader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if self.sequence_parallel:
            loader = ShardLoader(loader)
            self.callback_handler.train_dataloader = loader
        return model, loader

    def next_step(self) -> int:
        """The optimizer step being trained, counted from 1 as in run.json's steps[]."""
        return self.state.global_step + 1

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Trainer fetches every batch of an optimizer step here, before on_step_begin (transformers
        5.23 Trainer._run_epoch): outside the step clock, so its time is the data loading of the
        step, measured on its own (the meter's per-window data_loading_s and share of wall time).
        Under sequence parallelism the step's scored tokens are counted here over every rank."""
        t0 = time.perf_counter()
        batches, items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.sequence_parallel:
            items = scored_tokens(batches, device)
        self.meter.data_loading(time.perf_counter() - t0)
        return batches, items

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.sequence_parallel and model.training:
            return self.sequence_parallel_loss(model, inputs, return_outputs, num_items_in_batch)
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def sequence_parallel_loss(self, model, inputs, return_outputs, num_items_in_batch):
        """The loss of one sequence shard under Ulysses such that the step's gradient is the token-weighted
        mean over the whole step (docs/parallelism.md "The loss"): the shard's summed token losses / the
        step's scored tokens (get_batch_samples) x gradient_divisor(). DeepSpeed's adapter shifted the
        labels before the split (`shift_labels`)."""
        shift = inputs["shift_labels"]
        if fault_injection.late_shift(rank=self.accelerator.process_index, step=self.next_step()):
            shift = shift.clone()
            shift[..., -1] = IGNORE_INDEX  # = the shard's own labels shifted after the split (a control)
        # `labels` for the model's own loss, which reads shift_labels when given (ForCausalLMLoss)
        outputs = model(**{**inputs, "shift_labels": shift, "labels": shift}, num_items_in_batch=num_items_in_batch)
        divisor = gradient_divisor(model)
        self._logged_share = divisor / self.accelerator.num_processes  # training_step: Trainer logs the mean
        loss = outputs.loss * divisor
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        trace_samples(self, inputs)  # FINETUNE_SAMPLE_TRACE only (tests)
        counts = self.meter.count_batch(inputs)
        if self._pass_scored:
            inputs[SCORED_TOKENS_KWARG] = counts[1]  # trained tokens = the positions the loss scores
        out = super().training_step(model, inputs, num_items_in_batch)
        self.meter.memory.sample()
        if self.sequence_parallel:  # Trainer logs the mean over ranks: each rank's share of the step's loss
            out = out / self._logged_share
        return out

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs.pop(REAL_TOKENS_KEY, None)  # counts for the meter, not model inputs
        counts = inputs.pop(COUNTS_KEY, None)
        if self._pass_scored and counts is not None:
            inputs[SCORED_TOKENS_KWARG] = counts[1]
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        training_log = "loss" in logs and "train_runtime" not in logs
        step_entry = self.meter.log_window(logs, self.accelerator, self.state.global_step) if training_log else None
        super().log(logs, start_time)
        if step_entry is not None:
            self.sinks.log(step_entry)

    def record_tail(self) -> None:
        """The steps after the last log as one more `steps` entry, so steps[] covers every step of
        the launch (a resumed run totals its earlier segments from it). Every rank (it gathers)."""
        tail = self.meter.tail_window(self.accelerator, self.state.global_step)
        if tail is not None:
            self.sinks.log(tail)

    def _load_rng_state(self, checkpoint):
        """Trainer's own restore at the same world size; across a change, the explicit rule of
        finetune/checkpointing/resume_plan.py restore_rng (Trainer would look for files of its own layout and say nothing)."""
        old = self.resumed_world_size
        if checkpoint is None or old is None or old == self.args.world_size:
            return super()._load_rng_state(checkpoint)
        restore_rng(checkpoint, rank=self.args.process_index, old_world_size=old)

    def final_measurements(self) -> dict:
        """record_tail(), then the per-step series summed over ranks and memory peaks (per rank,
        max), and the nodes' host peaks read again after them (never below memory.per_rank). Every rank must call
        this (it gathers)."""
        self.record_tail()
        measured = self.meter.final(self.accelerator)
        self.hooks.record_node_host_peaks()  # RunHooks (finetune/training/build.py)
        return measured


def batch_share(wrapped, accelerator) -> BatchShare:
    """How this rank's micro-batches relate to the other ranks' (finetune/telemetry/meter.py BatchShare),
    from the live groups: tensor- and context-parallel ranks train on the same batch (the group's
    first rank counts it); Ulysses ranks each hold a shard of it."""
    if not dist.is_initialized():
        return BatchShare()
    counted, sp_group = True, None
    if any(c.__name__ == "DeepSpeedEngine" for c in type(wrapped).__mro__):
        from deepspeed.utils import groups

        if wrapped.autotp_size() > 1:
            counted = dist.get_rank(group=groups.get_tensor_model_parallel_group()) == 0
        if wrapped.sequence_parallel_size > 1:
            sp_group = groups._get_sequence_parallel_group()
    mesh = getattr(accelerator, "torch_device_mesh", None)
    for dim in ("tp", "cp"):
        if mesh is not None and dim in (mesh.mesh_dim_names or ()):
            counted = counted and mesh[dim].get_local_rank() == 0
    return BatchShare(counted=counted, sp_group=sp_group)


class CompactProgress(ProgressCallback):
    """Trainer's progress bar, with one compact line per log step instead of the raw dict. Its other
    dicts are not printed: the end-of-training one (Trainer's own clock and counts; after a resume its
    train_loss covers the last segment only) and the evaluation's are in run.json and the summary."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not (state.is_world_process_zero and self.training_bar is not None and logs):
            return super().on_log(args, state, control, logs=logs, **kwargs)
        if "loss" not in logs:
            if "eval_loss" in logs:
                self.training_bar.write(
                    f"step {state.global_step}/{state.max_steps} | eval loss {logs['eval_loss']:.4f}"
                )
            return None
        parts = [
            f"step {state.global_step}/{state.max_steps}",
            f"loss {logs['loss']:.4f}",
            f"lr {logs.get('learning_rate', 0):.3g}",
        ]
        if logs.get("grad_norm") is not None:
            parts.append(f"gnorm {logs['grad_norm']:.3g}")
        if "perf/trained_tokens_per_s" in logs:
            parts.append(
                f"{logs['perf/trained_tokens_per_s']:,.0f} tok/s ({logs['perf/trained_tokens_per_s_per_device']:,.0f}"
                f"/dev)"
            )
        parts.append(f"{logs['perf/step_s']:.2f} s/step")
        if "perf/mfu" in logs:
            parts.append(f"MFU {100 * logs['perf/mfu']:.1f}%")
        if "memory/max_device_peak_allocated_gib" in logs:
            parts.append(f"dev {logs['memory/max_device_peak_allocated_gib']:.2f} GiB")
        parts.append(f"host {logs.get('memory/max_host_peak_rss_gib', 0):.2f} GiB")
        self.training_bar.write(" | ".join(parts))


# --- Ulysses sequence parallelism ---------------------------------------------------------------------


def scored_tokens(batches: list[dict], device) -> torch.Tensor:
    """Tokens the loss scores in one optimizer step, over every rank: each rank holds distinct
    shards (sequence parallelism) or rows (data parallelism), so the sum counts each token once."""
    n = sum((b["shift_labels"] != IGNORE_INDEX).sum() for b in batches).to(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(n)
    return n


def gradient_divisor(engine) -> int:
    """The number DeepSpeed divides the summed gradients by under Ulysses, read from its engine. Not
    one number: ZeRO-1/2 (stage_1_and_2.py average_tensor) and ZeRO-3's contiguous all-reduce
    (stage3.py __avg_scatter_contiguous_grads) divide by the sequence-and-data-parallel group's size
    / sp, the data-parallel size; ZeRO-3's reduce-scatter (stage3.py __avg_scatter_grads ->
    coalesced_collectives.reduce_scatter_coalesced, the default) by the whole group's size."""
    ranks, sp = int(engine.seq_dp_world_size), int(engine.sequence_parallel_size)
    zero = engine.optimizer
    if int(engine.zero_optimization_stage()) == 3 and getattr(zero, "reduce_scatter", False):
        return ranks
    return ranks // sp


class ShardLoader:
    """DeepSpeed's sequence-parallel dataloader adapter (UlyssesSPDataLoaderAdapter) with `set_epoch`
    and mid-epoch resumption, which the adapter lacks (docs/parallelism.md "The dataloader")."""

    def __init__(self, adapter, drop: int = 0):
        self.adapter = adapter
        self._drop = drop  # micro-batches of the first refill already trained (resumed mid-refill)

    def __len__(self) -> int:
        return len(self.adapter)

    def __iter__(self):
        it = iter(self.adapter)  # the adapter is its own iterator
        for _ in range(self._drop):
            next(it)  # every rank refills together (a collective), then drops the same micro-batches
        self._drop = 0
        return it

    def set_epoch(self, epoch: int) -> None:
        inner = self.adapter.dl
        if hasattr(inner, "set_epoch"):
            inner.set_epoch(epoch)
        if not self.adapter.micro_batches:  # its iterator was made before this epoch was set
            self.adapter.iter = iter(inner)

    def skipped(self, micro_batches: int) -> ShardLoader:
        """This loader without its first `micro_batches` (Trainer counts the adapter's micro-batches:
        each of the inner loader's batches makes sp of them, one per rank's batch)."""
        from accelerate import skip_first_batches

        a, sp = self.adapter, self.adapter.sp_world_size
        inner = skip_first_batches(a.dl, micro_batches // sp)
        fresh = type(a)(inner, sp_rank=a.sp_rank, sp_group=a.sp_group, sp_world_size=sp, device=a.device)
        return ShardLoader(fresh, drop=micro_batches % sp)


@functools.cache
def route_skips() -> None:
    """Trainer resumes mid-epoch through the name `skip_first_batches` in its own module: a ShardLoader
    skips itself, every other loader goes to accelerate's as before. Idempotent."""
    import transformers.trainer as hf

    original = hf.skip_first_batches

    @functools.wraps(original)
    def skip_first_batches(dataloader, num_batches=0):
        if isinstance(dataloader, ShardLoader):
            return dataloader.skipped(num_batches)
        return original(dataloader, num_batches)

    hf.skip_first_batches = skip_first_batches


# --- test hook: which training rows each optimizer step trained on, per rank (FINETUNE_SAMPLE_TRACE=DIR):
# a hash of every row of every micro-batch to DIR/rank<r>.jsonl, and rank 0's dataset row hashes to
# DIR/dataset.json, so a test can recount, independently of the code under test, that a resumed run
# trains the same rows per step (tests/training/test_strategies.py); and at the rank's first micro-batch the
# optional packages it has imported and the garbage collector's state (on again after the imports, which it
# froze: finetune/errors.py imports_without_gc) to DIR/rank<r>.imports.json (finetune/training/rank_imports.py).
# Unset, it does nothing.

SAMPLE_TRACE = "FINETUNE_SAMPLE_TRACE"


def row_hash(ids) -> str:
    return hashlib.sha1(torch.as_tensor(ids, dtype=torch.long).cpu().numpy().tobytes()).hexdigest()[:16]


def trace_samples(trainer, inputs) -> None:
    """Called by the trainer for every micro-batch, before it trains on it."""
    out = os.environ.get(SAMPLE_TRACE)
    if not out:
        return
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    rank = trainer.accelerator.process_index
    imports = directory / f"rank{rank}.imports.json"
    if not imports.exists():
        start_up = {"packages": rank_imports.loaded(), "gc_enabled": gc.isenabled(), "gc_frozen": gc.get_freeze_count()}
        imports.write_text(json.dumps(start_up), encoding="utf-8")
    if rank == 0 and not (directory / "dataset.json").exists():
        hashes = [row_hash(r) for r in trainer.train_dataset["input_ids"]]
        (directory / "dataset.json").write_text(json.dumps(hashes), encoding="utf-8")
    ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    rows = [row_hash(ids[i][mask[i].bool()] if mask is not None else ids[i]) for i in range(ids.shape[0])]
    with open(directory / f"rank{rank}.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": trainer.state.global_step + 1, "rows": rows}) + "\n")
