"""One side of one benchmark run, in its own process (so host peak memory is its own):

    python -m finetune.bench.worker SPEC.json RESULT.json

Every side is measured by the same meter through a callback and a collator wrapper that change
nothing about the training (docs/benchmarks.md); each side's precision is read from its live objects.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from transformers import TrainerCallback

from finetune import strategies
from finetune.telemetry.meter import Meter, batch_counts


def main(argv=None) -> int:
    spec_path, out_path = (argv or sys.argv[1:])[:2]
    spec = json.loads(Path(spec_path).read_text())
    result = run(spec)
    Path(out_path).write_text(json.dumps(result, indent=1))
    return 0


def run(spec: dict) -> dict:
    import torch

    from finetune.modeling import attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    plain = spec["side"] in ("trl_plain", "plain_trainer")  # scripts that leave torch's SDPA flags alone
    policy = "torch_default" if plain else spec.get("sdpa_backends", "auto")
    with attention.flags_restored():
        attention_record = attention.apply(policy, device, spec["attn_implementation"])
        result = _run(spec, attention_record)
    return result


class SideClock(TrainerCallback):
    """Drives a side's own meter: its step clock and memory tracker (the counts come from the
    collator, `counting_collator`). Changes nothing about the training."""

    def __init__(self, meter: Meter, *, reset_peaks: bool):
        self.meter, self.reset_peaks = meter, reset_peaks

    def on_train_begin(self, *a, **k):
        if self.reset_peaks:  # FinetuneTrainer's own meter resets (and keeps) our side's peaks
            self.meter.memory.reset()  # peaks from here on are training, not model loading

    def on_step_begin(self, *a, **k):
        self.meter.step_begin()

    def on_step_end(self, *a, **k):
        self.meter.step_end()
        self.meter.memory.sample()


def _run(spec: dict, attention_record: dict) -> dict:
    import datasets
    import torch

    ours = spec["side"] == "finetune"
    rows = [json.loads(line) for line in Path(spec["data_file"]).read_text().splitlines() if line.strip()]
    meter = Meter()  # this side's own: its clock and memory; the counts come from the collator below
    torch.manual_seed(spec["seed"])
    trainer = build_side(spec, datasets.Dataset.from_list(rows), [SideClock(meter, reset_peaks=not ours)])
    batches: list[tuple[int, int, int, int, int]] = []  # trained, real input tokens, rows, positions, sum T_i^2
    trainer.data_collator = counting_collator(trainer.data_collator, batches)  # Trainer builds its loader from it
    trainer.train()
    # Our side's peaks, device and host, are the trainer's own training peaks (max over its log
    # windows): its meter resets torch's peak counters and the kernel's VmHWM at every log, so
    # this worker's tracker would see only the steps after the last one. TRL's side: the tracker.
    if ours:
        trainer.stops.restore()  # the stop signals act as before the trainer (the next side may run in this process)
        mem = trainer.final_measurements()["memory"]["max"]
        peak_source = "FinetuneTrainer run peak (max over its log windows)"
    else:
        mem, peak_source = meter.memory.snapshot(), "worker tracker (reset at train begin)"
    steps = [s[0] for s in meter.steps]
    figures = measured(spec, trainer, steps, batches[: len(steps)])
    return {
        "side": spec["side"],
        "trainer": type(trainer).__name__,
        "method": spec["method"],
        "round": spec["round"],
        **figures,
        "device_peak_allocated_gib": mem["device_peak_allocated_gib"],
        "device_peak_source": peak_source,
        "host_peak_rss_gib": mem["host_peak_rss_gib"],
        "attention": attention_record,
        **live_settings(spec, trainer, ours),
    }


def build_side(spec: dict, dataset, callbacks: list):
    """The side's trainer: ours as `finetune train` builds it, or a baseline (finetune/bench/baselines.py)."""
    from finetune.bench import baselines

    if spec["side"] == "finetune":
        return _our_trainer(spec, dataset, callbacks)
    if spec["side"] == "plain_trainer":
        return baselines.plain_trainer(spec, dataset, callbacks)
    return baselines.trl_trainer(spec, dataset, callbacks, tuned=spec["side"] == "trl_tuned")


def counting_collator(collator, batches: list):
    """The side's collator, counting each batch into `batches`: trained tokens, real input tokens,
    examples, positions computed (real tokens + padding: the input_ids size) and squared example
    lengths (the attention FLOPs: finetune/telemetry/model_flops.py), as FinetuneTrainer counts them."""

    def counting(features):
        batch = collator(features)
        n_input, n_trained, _, sum_sq = batch_counts(dict(batch)).tolist()
        batches.append((int(n_trained), int(n_input), len(features), int(batch["input_ids"].numel()), sum_sq))
        return batch

    return counting


def measured(spec: dict, trainer, steps: list[float], batches: list) -> dict:
    """Step times, counts, throughput, MFU and losses of the side's run (the warm-up steps left out of the rates)."""
    from finetune.telemetry import formulas, model_flops

    trained, inputs, samples, positions, sum_sq = ([b[i] for b in batches] for i in range(5))
    r = formulas.rates(steps, trained, inputs, samples, warmup=spec["warmup_steps"])
    warm = r["excluded"]
    counter, why = model_flops.from_model(trainer.model, spec["method"])
    total_flops = sum(counter.flops(i, q) for i, q in zip(inputs[warm:], sum_sq[warm:])) if counter else None
    flops = total_flops / sum(inputs[warm:]) if total_flops and sum(inputs[warm:]) else None  # per input token
    peak = formulas.device_peak()
    return {
        "steps": len(steps),
        "warmup_steps_excluded": warm,
        "step_s": steps,
        "trained_tokens": trained,
        "input_tokens": inputs,
        "rows": samples,
        "positions": positions,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "padding_fraction": 1 - sum(inputs) / sum(positions) if sum(positions) else None,
        "trained_tokens_per_s": r["trained_tokens_per_s"],
        "input_tokens_per_s": r["input_tokens_per_s"],
        "median_step_s": r["median_step_s"],
        "mfu": formulas.mfu(total_flops, r["seconds"], peak[1] if peak else None),
        "flops_per_token": flops,
        "flops_convention": counter.convention if counter else f"no FLOPs figure: {why}",
        "peak_device": peak[0] if peak else None,
    }


def live_settings(spec: dict, trainer, ours: bool) -> dict:
    """The side's live TrainingArguments, loss and precision, read back from its objects."""
    from finetune.modeling import loss
    from finetune.training import precision_evidence

    live = precision_evidence.read_live(trainer)
    return {
        "training_args": json.loads(trainer.args.to_json_string()),
        "loss_impl": loss.installed(trainer.model) if ours else LOSSES[spec["side"]],
        "precision": {  # the policy asked for, and what the live objects say (finetune/training/precision_evidence.py)
            "policy": spec["precision"],
            **{k: live[k] for k in ("param_dtype", "compute_dtype", "optimizer_state_dtype", "master_weights")},
        },
    }


LOSSES = {
    "plain_trainer": "the model's own (transformers ForCausalLMLoss, full logits)",
    "trl_plain": "TRL's own (SFTConfig loss_type nll)",
    "trl_tuned": "TRL's own (SFTConfig loss_type nll)",
}


def config_of(spec: dict):
    """Our side's configuration: the benchmark's settings as a recipe would give them to `finetune
    train` (one process, strategy single; the same LoRA settings as every side: the defaults)."""
    from finetune.config.validate import build_config

    return build_config(
        {
            "model": {
                "name_or_path": spec["model_dir"],
                "attn_implementation": spec["attn_implementation"],
                "sdpa_backends": spec["sdpa_backends"],
            },
            "method": {"name": spec["method"]},
            "data": {
                "path": spec["data_file"],
                "max_length": spec["seq_len"],
                "padding_free": spec["layout"] == "padding_free",
                "packing": spec["layout"] == "packing",
                "pad_to_multiple_of": spec["pad_to_multiple_of"],
            },
            "training": {
                "precision": spec["precision"],
                "per_device_train_batch_size": spec["batch"],
                "max_steps": spec["steps"],
                "learning_rate": spec["learning_rate"],
                "lr_scaling": "none",
                "seed": spec["seed"],
                "logging_steps": 1,
                "save_strategy": "no",
                "disable_tqdm": True,
                "gradient_checkpointing": spec["gradient_checkpointing"],
                "torch_compile": spec["torch_compile"],
                "use_liger_kernel": spec["liger"],
                "loss_impl": spec["loss_impl"],
                "throughput_warmup_steps": spec["warmup_steps"],
            },
            "run": {"strategy": strategies.one_process().name, "output_dir": spec["output_dir"], "save_model": False},
        },
        recipe="bench",
        source="finetune bench options",
    )


def _our_trainer(spec: dict, dataset, callbacks: list):
    """ResilientTrainer as `finetune train` builds it: the run's process set-up and launch, its
    TrainingArguments, model and trainer builders; the benchmark's rows instead of a data file. Its record is
    kept in memory only, as a run's ranks other than 0 keep theirs."""
    from finetune.checkpointing import resume
    from finetune.modeling.load import load_tokenizer
    from finetune.telemetry import sinks
    from finetune.telemetry.record import RunRecord
    from finetune.training import arguments, build, run, signals

    cfg = config_of(spec)
    _, launch, _ = run.start_processes(cfg)
    args = arguments.for_run(cfg, launch, output_dir=spec["output_dir"], run_name=f"bench-{spec['method']}")
    if cfg.data.packing:
        import datasets

        from finetune.data import pack, render

        examples = [render.Example(r["input_ids"], r["labels"]) for r in dataset]
        dataset = datasets.Dataset.from_list(pack.pack(examples, spec["seq_len"], spec["seed"]))
    model = build.model_for(cfg, launch, args)
    trainer = build.trainer_for(
        cfg,
        launch,
        args,
        model,
        train_dataset=dataset,
        eval_dataset=None,
        tokenizer=load_tokenizer(cfg.model),
        sinks=sinks.Sinks(
            sinks.Kept(RunRecord(Path(spec["output_dir"], "run.json"), run_name="bench", recipe="bench", config={}))
        ),
        stops=signals.Stops(),
    )
    trainer.sinks.put(resumes=resume.first_segment(trainer.sinks.view))  # the segment the hooks note the live mesh in
    for callback in callbacks:
        trainer.add_callback(callback)
    return trainer


if __name__ == "__main__":
    raise SystemExit(main())
