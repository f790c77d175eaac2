"""How much the metrics machinery costs: median optimizer-step time of the same training with
FinetuneTrainer (token counting, step clock, memory sampling, per-log gathers and run.json
writes) and with plain transformers.Trainer, alternating, in one process.

    python -m finetune.bench.overhead [--model DIR] [--steps 30] [--rounds 3] [--batch 8]

Not a test: timings depend on the machine; report them with the machine they ran on.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the bundled SmolLM2-135M)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args(argv)

    import torch
    from transformers import Trainer, TrainerCallback

    from finetune.config.sections import DataConfig, MethodConfig, ModelConfig
    from finetune.data import build, collate, demo
    from finetune.modeling.load import load_model, load_tokenizer
    from finetune.telemetry.record import RunRecord
    from finetune.telemetry.sinks import RunJson, Sinks
    from finetune.training import arguments
    from finetune.training.trainer import FinetuneTrainer

    class Clock(TrainerCallback):  # the same external clock for both trainers
        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.t0)

    mcfg = ModelConfig(name_or_path=args.model) if args.model else ModelConfig()
    tokenizer = load_tokenizer(mcfg)
    work = Path(tempfile.mkdtemp(prefix="bench-metrics-"))
    train_file, _ = demo.write_demo(work, args.batch * args.steps, 1)
    dcfg = DataConfig(path=str(train_file), max_length=128)
    dataset = build.build_datasets(dcfg, tokenizer, seed=0).train
    results = {"plain Trainer": [], "FinetuneTrainer": []}
    for r in range(args.rounds):
        for label in results:
            torch.manual_seed(0)
            model = load_model(mcfg, MethodConfig(name="lora", lora_dropout=0.0))
            targs = arguments.build(
                output_dir=str(work / f"{label}-{r}"),
                per_device_train_batch_size=args.batch,
                max_steps=args.steps,
                logging_steps=5,
                report_to="none",
                save_strategy="no",
                disable_tqdm=True,
                seed=0,
                learning_rate=1e-4,
            )
            kwargs = dict(
                model=model,
                args=targs,
                train_dataset=dataset,
                data_collator=lambda f: collate.collate(f, tokenizer.pad_token_id),
            )
            if label == "FinetuneTrainer":
                rec = RunRecord(work / f"{label}-{r}" / "run.json", run_name="bench", recipe="bench", config={})
                trainer = FinetuneTrainer(**kwargs, sinks=Sinks(RunJson(rec)))
            else:
                trainer = Trainer(**kwargs)
            clock = Clock()
            trainer.add_callback(clock)
            trainer.train()
            results[label].extend(clock.times[1:])  # first step: warm-up
            print(f"round {r} {label:16s} median step {statistics.median(clock.times[1:]):.4f} s", flush=True)
    own = _direct_cost(
        FinetuneTrainer,
        Trainer,
        dict(model_cfg=mcfg, dataset=dataset, tokenizer=tokenizer, work=work, batch=args.batch, steps=args.steps),
    )
    plain = statistics.median(results["plain Trainer"])
    ours = statistics.median(results["FinetuneTrainer"])
    print(
        f"median step: plain {plain:.4f} s, FinetuneTrainer {ours:.4f} s, "
        f"overhead {100 * (ours - plain) / plain:+.2f}% over {len(results['plain Trainer'])} steps each"
    )
    print(
        f"direct cost of the machinery (time inside our overrides, excluding Trainer's own work): "
        f"{1000 * own['per_step_s']:.3f} ms per optimizer step = {100 * own['per_step_s'] / ours:.4f}% of the median "
        f"step ({own['steps']} steps, logging every 5)"
    )
    return 0


def _direct_cost(ours_cls, plain_cls, ctx) -> dict:
    """Seconds spent in FinetuneTrainer's own code per optimizer step: its training_step and
    log overrides minus the Trainer methods they call, plus the meter's step bookkeeping and
    start of training (not its CUDA synchronize: that waits for the step's own work). Far more precise
    than a difference of step times, which on a shared CPU varies by several percent."""
    import torch

    from finetune.config.sections import MethodConfig
    from finetune.data import collate
    from finetune.modeling.load import load_model
    from finetune.telemetry.record import RunRecord
    from finetune.telemetry.sinks import RunJson, Sinks
    from finetune.training import arguments

    spent = {"outer": 0.0, "inner": 0.0}

    def timed(fn, key):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t

        return wrapper

    class Timed(ours_cls):
        training_step = timed(ours_cls.training_step, "outer")
        log = timed(ours_cls.log, "outer")

    originals = (plain_cls.training_step, plain_cls.log)
    plain_cls.training_step = timed(plain_cls.training_step, "inner")
    plain_cls.log = timed(plain_cls.log, "inner")
    try:
        torch.manual_seed(0)
        model = load_model(ctx["model_cfg"], MethodConfig(name="lora", lora_dropout=0.0))
        out = ctx["work"] / "direct"
        targs = arguments.build(
            output_dir=str(out),
            per_device_train_batch_size=ctx["batch"],
            max_steps=ctx["steps"],
            logging_steps=5,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        tok = ctx["tokenizer"]
        trainer = Timed(
            model=model,
            args=targs,
            train_dataset=ctx["dataset"],
            data_collator=lambda f: collate.collate(f, tok.pad_token_id),
            sinks=Sinks(RunJson(RunRecord(out / "run.json", run_name="bench", recipe="bench", config={}))),
        )
        trainer.meter.record_step = timed(trainer.meter.record_step, "outer")
        trainer.meter.start_training = timed(trainer.meter.start_training, "outer")
        trainer.train()
    finally:
        plain_cls.training_step, plain_cls.log = originals
    return {"per_step_s": (spent["outer"] - spent["inner"]) / ctx["steps"], "steps": ctx["steps"]}


if __name__ == "__main__":
    raise SystemExit(main())
