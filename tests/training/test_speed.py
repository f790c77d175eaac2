"""Speed options: padding-free and packed batches give the padded path's per-token losses and
keep examples apart; unsafe combinations are refused; token counts.

Tolerance: fp32 tiny model, per-token losses and logits compared at atol 1e-5 (different
batch shapes reorder float sums; observed differences are ~1e-6)."""

from __future__ import annotations

import json

import pytest
import torch

from finetune.config.validate import build_config
from finetune.data import collate, pack, render
from finetune.data.build import build_datasets
from finetune.errors import ConfigError, UserError
from finetune.training import speed

ATOL = 1e-5
ROWS = [
    {"instruction": "Name a colour.", "output": "Blue."},
    {
        "instruction": "Write a very long sentence about rivers, mountains and the sea, please.",
        "output": "Rivers run from the mountains down to the sea, carrying stones, sand and stories.",
    },
    {"instruction": "Add 2 and 3.", "output": "5"},
    {"instruction": "Say hello in French and then in German.", "output": "Bonjour. Hallo."},
]


def _data_cfg(path, **kw):
    cfg = build_config({"data": {"path": str(path), "max_length": 128, **kw}}).data
    return cfg


@pytest.fixture
def examples(tokenizer, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    bundle = build_datasets(_data_cfg(path), tokenizer, seed=0)
    rows = [dict(r) for r in bundle.train]
    assert len({len(r["input_ids"]) for r in rows}) > 1, "examples must differ in length to exercise padding"
    return rows


def _kept(tmp_path):
    """A trainer's sinks that keep its record in memory (as a run's ranks other than 0 do)."""
    from finetune.telemetry.record import RunRecord
    from finetune.telemetry.sinks import Kept, Sinks

    return Sinks(Kept(RunRecord(tmp_path / "run.json", run_name="t", recipe="t", config={})))


def _model(tokenizer, attn):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM._from_config(config, attn_implementation=attn, dtype=torch.float32).eval()


def _per_token_losses(model, batch) -> list[tuple[int, float]]:
    """(target token id, loss) for every scored position, in order along each row."""
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits
    labels = batch["labels"]
    out = []
    for b in range(labels.shape[0]):
        loss = torch.nn.functional.cross_entropy(logits[b, :-1], labels[b, 1:], reduction="none", ignore_index=-100)
        out += [(int(t), float(v)) for t, v in zip(labels[b, 1:], loss) if t != -100]
    return out


def _by_example(pairs_rows):
    return sorted(pairs_rows)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padding_free_and_packing_give_padded_losses(tokenizer, examples, attn):
    model = _model(tokenizer, attn)
    mcfg = build_config({"model": {"attn_implementation": attn}}).model
    padded = collate.collate(examples, tokenizer.pad_token_id)
    assert "attention_mask" in padded and (padded["attention_mask"] == 0).any()  # really padded
    flat = collate.make_collator(_data_cfg("x", padding_free=True), mcfg, tokenizer.pad_token_id)(examples)
    assert flat["input_ids"].shape == (1, sum(len(e["input_ids"]) for e in examples))
    assert "attention_mask" not in flat

    reference = _per_token_losses(model, padded)
    got = _per_token_losses(model, flat)
    assert [t for t, _ in got] == [t for t, _ in reference]  # same targets, same order
    torch.testing.assert_close(
        torch.tensor([v for _, v in got]), torch.tensor([v for _, v in reference]), atol=ATOL, rtol=0
    )
    # The model's own (Trainer's) loss: mean over the same targets.
    with torch.no_grad():
        loss_padded = model(**padded, use_cache=False).loss
        loss_flat = model(**{k: flat[k] for k in ("input_ids", "labels", "position_ids")}, use_cache=False).loss
    torch.testing.assert_close(loss_flat, loss_padded, atol=ATOL, rtol=0)

    # Packing: rows built by finetune/data/pack.py in shuffled order; compare per target as multisets.
    packed_rows = pack.pack([render.Example(e["input_ids"], e["labels"]) for e in examples], 10_000, seed=0)
    packed = collate.make_collator(_data_cfg("x", packing=True), mcfg, tokenizer.pad_token_id)(packed_rows)
    got_packed = _per_token_losses(model, packed)
    assert sorted(t for t, _ in got_packed) == sorted(t for t, _ in reference)
    torch.testing.assert_close(
        torch.tensor(sorted(v for _, v in got_packed)), torch.tensor(sorted(v for _, v in reference)), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_no_attention_crosses_example_boundaries(tokenizer, examples, attn):
    model = _model(tokenizer, attn)
    mcfg = build_config({"model": {"attn_implementation": attn}}).model
    flatten = collate.make_collator(_data_cfg("x", padding_free=True), mcfg, tokenizer.pad_token_id)

    def logits(batch):
        with torch.no_grad():
            return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]

    flat = flatten(examples)
    row = logits(flat)
    start = 0
    for e in examples:  # each example inside the row == that example alone
        n = len(e["input_ids"])
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([e["input_ids"]]), use_cache=False).logits[0]
        torch.testing.assert_close(row[start : start + n], alone, atol=ATOL, rtol=0)
        start += n

    # Perturb every token of the first example: the others' logits must not move at all.
    perturbed = [dict(examples[0], input_ids=[(t + 7) % len(tokenizer) for t in examples[0]["input_ids"]])]
    perturbed += examples[1:]
    row2 = logits(flatten(perturbed))
    n0 = len(examples[0]["input_ids"])
    assert (row2[:n0] - row[:n0]).abs().max() > 1e-3  # the perturbation itself is visible
    torch.testing.assert_close(row2[n0:], row[n0:], atol=ATOL, rtol=0)
    # Control: the same row without position_ids (plain causal attention) does leak.
    with torch.no_grad():
        leak1 = model(input_ids=flat["input_ids"], use_cache=False).logits[0]
        leak2 = model(input_ids=flatten(perturbed)["input_ids"], use_cache=False).logits[0]
    assert (leak2[n0:] - leak1[n0:]).abs().max() > 1e-3


def _cfg(**sections):
    return build_config(sections)


@pytest.mark.parametrize(
    ("sections", "needle"),
    [
        ({"data": {"packing": True, "padding_free": True}}, "choose one"),
        (
            {
                "data": {"packing": True},
                "model": {"attn_implementation": "flash_attention_2"},
                "training": {"per_device_train_batch_size": 2},
            },
            "per_device_train_batch_size 2",
        ),
        ({"data": {"padding_free": True}, "model": {"trust_remote_code": True}}, "trust_remote_code"),
    ],
)
def test_unsafe_combinations_are_refused(sections, needle):
    with pytest.raises(ConfigError, match=needle):
        speed.check(_cfg(**sections))


def test_safe_combinations_pass():
    speed.check(
        _cfg(
            data={"padding_free": True},
            model={"attn_implementation": "flash_attention_2"},
            training={"per_device_train_batch_size": 8},
        )
    )
    speed.check(
        _cfg(
            data={"packing": True},
            model={"attn_implementation": "flash_attention_2"},
            training={"per_device_train_batch_size": 1},
        )
    )
    speed.check(_cfg(data={"packing": True}, model={"attn_implementation": "eager"}))


def test_liger_on_cpu_is_a_clear_error(monkeypatch):
    """On any machine (it skipped where a GPU was visible): CUDA hidden as speed.check reads it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match=r"use_liger_kernel: .*(not installed|CUDA)"):
        speed.check(_cfg(training={"use_liger_kernel": True}))


@pytest.mark.parametrize("layout", ["packing", "padding_free"])
def test_trainer_counts_real_and_trained_tokens(tokenizer, tiny_model_dir, examples, tmp_path, layout):
    """Input tokens = real tokens (no padding), trained tokens = labels[1:] != -100 of each example,
    examples = the examples in the rows, for both layouts; expected values come from the examples."""
    import datasets
    from transformers import TrainingArguments

    from finetune.config.sections import MethodConfig, ModelConfig
    from finetune.modeling.load import load_model
    from finetune.training.trainer import FinetuneTrainer

    rows = examples
    if layout == "packing":
        rows = pack.pack([render.Example(e["input_ids"], e["labels"]) for e in examples], 100, seed=0)
        assert len({len(r["input_ids"]) for r in rows}) > 1  # rows of different length: padded batch
    dcfg = _data_cfg("x", packing=layout == "packing", padding_free=layout == "padding_free")
    mcfg = ModelConfig(name_or_path=str(tiny_model_dir), dtype="float32")
    model = load_model(mcfg, MethodConfig(name="full"))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=len(rows),
        max_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = FinetuneTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        data_collator=collate.make_collator(dcfg, mcfg, tokenizer.pad_token_id),
        sinks=_kept(tmp_path),
    )
    trainer.train()
    step = trainer.meter.steps[0]  # seconds, input tokens, trained tokens, examples, sum of squared lengths
    n_input, n_trained, n_examples = step[1:4]
    assert n_input == sum(len(e["input_ids"]) for e in examples)
    assert n_trained == sum(sum(1 for x in e["labels"][1:] if x != -100) for e in examples)
    assert n_examples == len(examples), (layout, n_examples)  # not the batch's rows (issue 15 item 1)
    assert step[4] == sum(len(e["input_ids"]) ** 2 for e in examples)
    # the batch fetch (Trainer.get_batch_samples, outside the step clock) was timed: data loading
    assert trainer.meter.tail_window(trainer.accelerator, 1)["data_loading_s"] > 0


@pytest.mark.parametrize("layout", ["padded", "padding_free", "packing"])
def test_bucketed_batches_keep_loss_gradients_and_real_token_count(layout):
    """data.pad_to_multiple_of: the batch grows to a multiple of 64 tokens; loss, every gradient
    (fp32, 1e-5) and the meter's real-token count are those of the unrounded batch."""
    from finetune.telemetry.meter import token_counts
    from tests.modeling.test_loss import assert_same, examples, run, tiny

    exs = examples(n=3)
    if layout == "packing":
        exs = pack.pack([render.Example(e["input_ids"], e["labels"]) for e in exs], 60, seed=0)
        assert len(exs) > 1
    mcfg = build_config({}).model
    plain = collate.make_collator(_data_cfg("x", **{layout: True} if layout != "padded" else {}), mcfg, 0)(exs)
    bucketed = collate.make_collator(
        _data_cfg("x", pad_to_multiple_of=64, **{layout: True} if layout != "padded" else {}), mcfg, 0
    )(exs)
    n, m = plain["input_ids"].shape[-1], bucketed["input_ids"].shape[-1]
    assert m % 64 == 0 and m > n  # really rounded up

    def count(b):
        return [
            int(x)
            for x in token_counts(b["input_ids"], b.get("attention_mask"), b["labels"], b.get(collate.REAL_TOKENS_KEY))
        ]

    assert count(bucketed) == count(plain)  # filler is neither an input token nor trained
    assert count(plain)[0] == sum(len(e["input_ids"]) for e in exs)
    model = tiny()

    def strip(b):  # FinetuneTrainer takes the stated count out before the forward
        return {k: v for k, v in b.items() if k != collate.REAL_TOKENS_KEY}

    assert_same(run(model, strip(plain)), run(model, strip(bucketed)))


def test_trainer_passes_the_steps_item_count_to_the_chunked_loss(tmp_path):
    """Through FinetuneTrainer, 2 micro-batches per step (gradient accumulation) and an evaluation:
    the chunked model's step loss, gradient norm and eval loss equal the standard model's (fp32, 1e-5
    relative). Trainer gives num_items_in_batch only to a model whose forward takes loss kwargs; a
    chunked loss that averaged each micro-batch on its own would give another gradient here."""
    import datasets
    from transformers import TrainingArguments

    from finetune.modeling import loss
    from finetune.training.trainer import FinetuneTrainer
    from tests.modeling.test_loss import examples, tiny

    rows = examples(seed=5, n=4)
    rows[0]["labels"][-8:] = [-100] * 8  # unequal scored counts: per-micro-batch means would differ
    logs = {}
    for impl in ("standard", "chunked"):
        model = tiny()
        assert loss.install(model, impl, chunk=16)["resolved"] == impl
        args = TrainingArguments(
            output_dir=str(tmp_path / impl),
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=1,
            logging_steps=1,
            learning_rate=1e-3,
            report_to="none",
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
        )
        trainer = FinetuneTrainer(
            model=model,
            args=args,
            train_dataset=datasets.Dataset.from_list(rows),
            eval_dataset=datasets.Dataset.from_list(rows[:2]),
            data_collator=collate.make_collator(_data_cfg("x"), build_config({}).model, 0),
            sinks=_kept(tmp_path),
        )
        assert trainer.model_accepts_loss_kwargs  # so Trainer passes num_items_in_batch
        trainer.train()
        step = next(h for h in trainer.state.log_history if "loss" in h)
        logs[impl] = (step["loss"], step["grad_norm"], trainer.evaluate()["eval_loss"])
    for a, b in zip(logs["standard"], logs["chunked"]):
        assert abs(a - b) <= 1e-5 * abs(a), logs


def test_ddp_find_unused_parameters_is_decided_by_a_probe_that_sees_an_unused_parameter(tiny_model_dir):
    """LoRA and full fine-tuning of the tiny Llama: every trainable parameter is in the autograd graph
    of one forward's loss, so DDP need not search for unused ones (Trainer's default would). The
    control: a trainable parameter the forward never uses is named and turns the decision to True
    (DDP with False would fail waiting for its gradient). The probe leaves the RNG and train mode as
    they were; the recipe's own setting, a mixture of experts and a run that is not DDP decide otherwise."""
    from types import SimpleNamespace

    from finetune.config.sections import MethodConfig, ModelConfig
    from finetune.modeling import loss
    from finetune.modeling.load import load_model

    ddp = SimpleNamespace(distributed_type="MULTI_GPU", world_size=2)
    cfg = build_config({})
    ids = list(range(5, 25))
    mcfg = ModelConfig(name_or_path=str(tiny_model_dir), dtype="float32")
    for method in ("full", "lora"):  # the LoRA model last: the controls below use it
        model = load_model(mcfg, MethodConfig(name=method))
        loss.install(model, "auto", tokens=20)
        model.train()
        rng = torch.get_rng_state()
        decided = speed.ddp_unused_parameters(cfg, ddp, model, ids, "cpu")
        assert decided == {
            "find_unused_parameters": False,
            "decided_by": "probe",
            "unused_trainable": [],
            "reason": None,
        }, (method, decided)
        assert torch.equal(torch.get_rng_state(), rng) and model.training
    model.base_model.model.model.extra = torch.nn.Linear(4, 4)  # trainable, never called by forward
    model.base_model.model.model.frozen_extra = torch.nn.Linear(4, 4).requires_grad_(False)  # not trainable: no matter
    decided = speed.ddp_unused_parameters(cfg, ddp, model, ids, "cpu")
    assert decided["find_unused_parameters"] is True and decided["decided_by"] == "probe", decided
    assert decided["unused_trainable"] == ["base_model.model.model.extra.weight", "base_model.model.model.extra.bias"]
    assert (
        speed.ddp_unused_parameters(cfg, SimpleNamespace(distributed_type="NO", world_size=1), model, ids, "cpu")[
            "find_unused_parameters"
        ]
        is None
    )
    given = build_config({"training": {"ddp_find_unused_parameters": False}})
    assert speed.ddp_unused_parameters(given, ddp, model, ids, "cpu")["decided_by"] == "recipe"
    model.config.num_local_experts = 8  # a mixture of experts: routing decides which experts train
    moe = speed.ddp_unused_parameters(cfg, ddp, model, ids, "cpu")
    assert moe["find_unused_parameters"] is True and moe["decided_by"] == "model config", moe
