"""One side of one benchmark run, in its own process (so host peak memory is its own):

    python -m finetune.bench.worker SPEC.json RESULT.json

Every side is measured by the same meter (finetune/telemetry/meter.py) through two hooks that
change nothing about the training: a callback driving its step clock and memory tracker, and a
wrapper around the side's collator counting tokens and rows per batch (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


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
    policy = "torch_default" if spec["side"] == "trl_plain" else spec.get("sdpa_backends", "auto")
    with attention.flags_restored():
        attention_record = attention.apply(policy, device, spec["attn_implementation"])
        result = _run(spec, attention_record)
    return result


def _run(spec: dict, attention_record: dict) -> dict:
    import datasets
    import torch
    from transformers import TrainerCallback

    from finetune.modeling import loss
    from finetune.telemetry import formulas, model_flops
    from finetune.telemetry.meter import Meter, batch_counts

    ours = spec["side"] == "finetune"
    rows = [json.loads(line) for line in Path(spec["data_file"]).read_text().splitlines() if line.strip()]
    dataset = datasets.Dataset.from_list(rows)
    meter = Meter()  # this side's own: its clock and memory; the counts come from the collator below
    batches: list[tuple[int, int, int, int, int]] = []  # trained, real input tokens, rows, positions, sum T_i^2

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            if not ours:  # FinetuneTrainer's own meter resets (and keeps) our side's peaks
                meter.memory.reset()  # peaks from here on are training, not model loading

        def on_step_begin(self, *a, **k):
            meter.step_begin()

        def on_step_end(self, *a, **k):
            meter.step_end()
            meter.memory.sample()

    torch.manual_seed(spec["seed"])
    if ours:
        trainer = _our_trainer(spec, dataset, [Clock()])
    else:
        from finetune.bench import trl_side

        trainer = trl_side.build_trainer(spec, dataset, [Clock()], tuned=spec["side"] == "trl_tuned")
    collator = trainer.data_collator

    def counting(features):
        batch = collator(features)
        # real input tokens, trained tokens, examples, squared example lengths (the attention FLOPs:
        # finetune/telemetry/model_flops.py), as FinetuneTrainer counts them; positions computed =
        # real tokens + padding (the batch's input_ids size)
        n_input, n_trained, _, sum_sq = batch_counts(dict(batch)).tolist()
        batches.append((int(n_trained), int(n_input), len(features), int(batch["input_ids"].numel()), sum_sq))
        return batch

    trainer.data_collator = counting  # Trainer builds its data loader from this attribute in train()
    trainer.train()
    # Our side's peaks, device and host, are the trainer's own training peaks (max over its log
    # windows): its meter resets torch's peak counters and the kernel's VmHWM at every log, so
    # this worker's tracker would see only the steps after the last one. TRL's side: the tracker.
    if ours:
        mem = trainer.final_measurements()["memory"]["max"]
        peak_source = "FinetuneTrainer run peak (max over its log windows)"
    else:
        mem, peak_source = meter.memory.snapshot(), "worker tracker (reset at train begin)"
    device_peak = mem["device_peak_allocated_gib"]
    steps = [s[0] for s in meter.steps]
    n = len(steps)
    trained, inputs, samples, positions, sum_sq = ([b[i] for b in batches[:n]] for i in range(5))
    r = formulas.rates(steps, trained, inputs, samples, warmup=spec["warmup_steps"])
    warm = r["excluded"]
    counter, why = model_flops.from_model(trainer.model, spec["method"])
    total_flops = sum(counter.flops(i, q) for i, q in zip(inputs[warm:], sum_sq[warm:])) if counter else None
    flops = total_flops / sum(inputs[warm:]) if total_flops and sum(inputs[warm:]) else None  # per input token
    convention = counter.convention if counter else f"no FLOPs figure: {why}"
    peak = formulas.device_peak()
    input_tps = r["input_tokens_per_s"]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {
        "side": spec["side"],
        "method": spec["method"],
        "round": spec["round"],
        "steps": n,
        "warmup_steps_excluded": warm,
        "step_s": steps,
        "trained_tokens": trained,
        "input_tokens": inputs,
        "rows": samples,
        "positions": positions,
        "losses": losses,
        "padding_fraction": 1 - sum(inputs) / sum(positions) if sum(positions) else None,
        "trained_tokens_per_s": r["trained_tokens_per_s"],
        "input_tokens_per_s": input_tps,
        "median_step_s": r["median_step_s"],
        "mfu": formulas.mfu(total_flops, r["seconds"], peak[1] if peak else None),
        "flops_per_token": flops,
        "flops_convention": convention,
        "peak_device": peak[0] if peak else None,
        "device_peak_allocated_gib": device_peak,
        "device_peak_source": peak_source,
        "host_peak_rss_gib": mem["host_peak_rss_gib"],
        "attention": attention_record,
        "loss_impl": loss.installed(trainer.model) if ours else "TRL's own (SFTConfig loss_type nll)",
    }


def _our_trainer(spec: dict, dataset, callbacks: list):
    """This project's path: finetune.modeling loading, finetune.data.collate batching, FinetuneTrainer."""
    import torch

    from finetune.config.sections import DataConfig, MethodConfig, ModelConfig
    from finetune.data import collate
    from finetune.modeling import loss
    from finetune.modeling.load import load_model, load_tokenizer
    from finetune.training import arguments, speed
    from finetune.training.trainer import FinetuneTrainer

    cuda = torch.cuda.is_available()
    mcfg = ModelConfig(
        name_or_path=spec["model_dir"],
        dtype="bfloat16" if cuda else "float32",
        attn_implementation=spec["attn_implementation"],
    )
    dcfg = DataConfig(
        path=spec["data_file"],
        max_length=spec["seq_len"],
        pad_to_multiple_of=spec["pad_to_multiple_of"],
        padding_free=spec["layout"] == "padding_free",
        packing=spec["layout"] == "packing",
    )
    tokenizer = load_tokenizer(mcfg)
    if spec["layout"] == "packing":
        import datasets

        from finetune.data import pack, render

        examples = [render.Example(r["input_ids"], r["labels"]) for r in dataset]
        dataset = datasets.Dataset.from_list(pack.pack(examples, spec["seq_len"], spec["seed"]))
    model = load_model(mcfg, MethodConfig(name=spec["method"]), gradient_checkpointing=spec["gradient_checkpointing"])
    loss.install(
        model,
        spec["loss_impl"],
        use_liger_kernel=spec["liger"],
        device_type="cuda" if cuda else "cpu",
        tokens=spec["batch"] * spec["seq_len"],
    )  # `auto` weighed as finetune train weighs it
    args = arguments.build(
        output_dir=spec["output_dir"],
        max_steps=spec["steps"],
        per_device_train_batch_size=spec["batch"],
        learning_rate=spec["learning_rate"],
        bf16=cuda,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=spec["seed"],
        disable_tqdm=True,
        use_cpu=not cuda,
        torch_compile=spec["torch_compile"],
        use_liger_kernel=spec["liger"],
    )
    if spec["liger"]:
        speed.check_liger()
    return FinetuneTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        callbacks=callbacks,
        data_collator=collate.make_collator(dcfg, mcfg, tokenizer.pad_token_id),
        processing_class=tokenizer,
    )


if __name__ == "__main__":
    raise SystemExit(main())
