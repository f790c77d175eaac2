"""The chunked loss (finetune/modeling/loss.py) equals the model's own loss, and never builds the
full logits.

Numerics: fp32 on CPU, loss and EVERY parameter gradient at atol 1e-5 against an independent
reference, the unmodified transformers model (its `ForCausalLMLoss` over the full logits). Seen:
loss differences <= 1e-6, gradient differences ~3e-8 (different summation order only). The chunk is
16 tokens, far fewer than a batch's scored tokens, so every case walks many chunks. Controls: a
changed target moves the loss and gradients far beyond the tolerance; the standard model does build
an fp32 tokens x vocab tensor, which the chunked one never does (tests/modeling/test_loss.py is
also the reference other tests import: tiny, examples, padded, flat, run, assert_same).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM

from finetune.errors import ConfigError, UserError
from finetune.modeling import loss

ATOL = 1e-5
V = 49152  # the bundled tokenizer's vocabulary
CHUNK = 16


def tiny(tie: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
        pad_token_id=0,
    )
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)


def pair(tie: bool = True):
    """(reference, chunked): the same weights, the chunked loss installed on a deep copy."""
    ref = tiny(tie)
    new = copy.deepcopy(ref)
    info = loss.install(new, "auto", chunk=CHUNK)
    assert info["resolved"] == "chunked" and info["chunk_tokens"] == CHUNK and not info["logits_materialised"]
    return ref, new


def examples(seed: int = 1, n: int = 4) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(12, 40, (1,), generator=g))
        ids = torch.randint(1, V, (length,), generator=g)
        labels = ids.clone()
        labels[: length // 3] = -100  # the prompt
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def padded(exs: list[dict]) -> dict:
    from finetune.data.collate import collate

    return collate(exs, pad_token_id=0)


def flat(exs: list[dict]) -> dict:
    return DataCollatorWithFlattening(return_tensors="pt")(exs)


def run(model, batch: dict, **kw):
    model.zero_grad(set_to_none=True)
    out = model(**batch, use_cache=False, **kw)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a, b) -> None:
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(la, lb, atol=ATOL, rtol=0)
    assert ga.keys() == gb.keys() and len(ga) > 0
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], atol=ATOL, rtol=0, msg=k)


@pytest.mark.parametrize(
    ("layout", "tie"), [("padded", True), ("padding_free", False)], ids=["padded-tied_head", "padding_free-untied_head"]
)
def test_chunked_equals_standard_loss_and_every_gradient(layout, tie):
    ref, new = pair(tie)
    batch = (padded if layout == "padded" else flat)(examples())
    if layout == "padding_free":  # one row, position_ids restart, each example's first label -100
        assert "attention_mask" not in batch and int((batch["position_ids"] == 0).sum()) == 4
    else:
        assert (batch["attention_mask"] == 0).any()  # really padded
    assert int((batch["labels"] != -100).sum()) > 4 * CHUNK  # many chunks
    reference = run(ref, batch)
    assert_same(reference, run(new, batch))
    with torch.no_grad():
        assert new(**batch, use_cache=False).logits is None  # the chunked path built no logits
    # Control: the comparison sees a wrong loss. One scored label changed moves the loss and the
    # embedding gradient far beyond the tolerance.
    bad = {k: v.clone() for k, v in batch.items()}
    row, col = (bad["labels"] != -100).nonzero()[-1].tolist()
    bad["labels"][row, col] = (bad["labels"][row, col] + 1) % V
    (lr, gr), (lb, gb) = reference, run(new, bad)
    assert abs(lr - lb) > 1e-4
    assert (gr["model.embed_tokens.weight"] - gb["model.embed_tokens.weight"]).abs().max() > 1e-4


@pytest.mark.parametrize("layout", ["padded", "padding_free"])
def test_scored_count_from_the_host_gives_the_same_loss_and_refuses_a_wrong_count(layout):
    """The trainer passes each micro-batch's scored-token count (counted on the host) so the head's
    compaction needs no nonzero(): loss and every gradient equal the standard loss's, as without the
    count; a count that is not the labels' stops the run (on CPU at once, on CUDA as a device assert)."""
    ref, new = pair()
    batch = (padded if layout == "padded" else flat)(examples())
    scored = int((batch["labels"][..., 1:] != -100).sum())
    reference = run(ref, batch)
    assert_same(reference, run(new, batch, **{loss.SCORED_TOKENS_KWARG: scored}))
    with pytest.raises(RuntimeError, match="finetune_scored_tokens differs"):
        run(new, batch, **{loss.SCORED_TOKENS_KWARG: scored - 1})


def test_gradient_accumulation_divides_by_the_steps_item_count():
    """Two micro-batches scaled by num_items_in_batch (what Trainer passes for the whole step)."""
    ref, new = pair()
    b1, b2 = padded(examples(1)), flat(examples(2))
    items = sum(int((b["labels"][..., 1:] != -100).sum()) for b in (b1, b2))
    results = []
    for model in (ref, new):
        model.zero_grad(set_to_none=True)
        total = 0.0
        for b in (b1, b2):
            out = model(**b, use_cache=False, num_items_in_batch=torch.tensor(items))
            out.loss.backward()
            total += out.loss.detach()
        results.append((total, {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert_same(*results)  # the reference divides by the count: a chunked loss that ignored it would differ


def test_lora_model_installed_after_the_wrap():
    """As finetune/training/run.py does: peft wraps first, the loss is installed on the wrapped model."""
    from peft import LoraConfig, get_peft_model

    ref = tiny()
    new = copy.deepcopy(ref)
    cfg = LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM", init_lora_weights=False
    )  # non-zero B: every LoRA gradient is non-trivial
    torch.manual_seed(3)
    ref = get_peft_model(ref, cfg)
    torch.manual_seed(3)
    new = get_peft_model(new, cfg)
    assert loss.install(new, "auto", chunk=CHUNK)["resolved"] == "chunked"
    assert loss.installed(new)["resolved"] == "chunked"
    batch = flat(examples())
    a, b = run(ref, batch), run(new, batch)
    assert any("lora_A" in k for k in a[1])
    assert_same(a, b)


def test_generation_and_logits_callers_are_unchanged():
    ref, new = pair()
    ids = torch.tensor([examples()[0]["input_ids"][:8]])
    a = ref.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    b = new.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)
    with torch.no_grad():
        torch.testing.assert_close(new(input_ids=ids).logits, ref(input_ids=ids).logits, atol=0, rtol=0)


def test_bf16_autocast_stays_within_bf16_noise():
    """bf16-mixed (fp32 parameters, bf16 autocast): close to the standard loss at bf16's precision,
    fp32 gradients for fp32 parameters."""
    ref, new = pair()
    batch = flat(examples())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r, n = run(ref, batch), run(new, batch)
    torch.testing.assert_close(r[0], n[0], atol=2e-2, rtol=0)
    for k in r[1]:
        assert n[1][k].dtype == torch.float32
        torch.testing.assert_close(r[1][k], n[1][k], atol=2e-3, rtol=5e-2, msg=k)


class _LargestLogits(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest float32 tensor with a vocabulary-sized last dimension (logits, their softmax or
    gradient) that any aten op allocated, in elements. Weights and their gradients are [V, H]."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # a view (the head weight transposed, [H, V]) allocates nothing
            return out
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() and t.shape[-1] == V:
                self.largest = max(self.largest, t.numel())
        return out


def test_full_fp32_logits_are_never_built():
    ref, new = pair()
    batch = flat(examples(n=8))
    n_tokens = batch["input_ids"].numel()
    sizes = {}
    for name, model in (("standard", ref), ("chunked", new)):
        with _LargestLogits() as seen:
            run(model, batch)
        sizes[name] = seen.largest
    assert sizes["standard"] >= n_tokens * V  # control: the standard loss builds them (and more)
    assert sizes["chunked"] < 2 * CHUNK * V  # one chunk's logits at a time, never tokens x vocab
    assert 2 * CHUNK < n_tokens // 4


def test_chunk_size_constant():
    assert loss.chunk_tokens(151_936) == 256 and loss.chunk_tokens(128_256) == 512 and loss.chunk_tokens(V) == 1024
    for vocab in (1000, 49_152, 151_936, 262_144):
        n = loss.chunk_tokens(vocab)
        assert n * vocab * 4 <= loss.CHUNK_LOGITS_BYTES or n == loss.MIN_CHUNK_TOKENS
        assert n & (n - 1) == 0


def test_auto_falls_back_with_the_reason_and_explicit_choices_refuse():
    from peft import LoraConfig, get_peft_model

    head_lora = get_peft_model(tiny(tie=False), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    info = loss.install(head_lora, "auto")
    assert info["resolved"] == "standard" and info["logits_materialised"] and "output head" in info["reason"]
    with pytest.raises(ConfigError, match="chunked cannot replace .*output head"):
        loss.install(get_peft_model(tiny(tie=False), LoraConfig(r=4, target_modules=["lm_head"])), "chunked")
    info = loss.install(tiny(), "auto", label_smoothing=0.1)
    assert info["resolved"] == "standard" and "label_smoothing_factor" in info["reason"]
    assert loss.install(tiny(), "standard")["resolved"] == "standard"
    with pytest.raises(UserError, match="loss_impl: liger .*(not installed|CUDA)"):
        loss.install(tiny(), "liger", device_type="cpu")
    with pytest.raises(ConfigError, match="allowed: auto, standard, chunked, liger"):
        loss.install(tiny(), "fused")


def test_auto_weighs_the_micro_batch_when_the_head_trains():
    """Full fine-tuning of the tiny model (V 49,152, h of `tiny`): a 1-token micro-batch makes the fp32
    head-gradient accumulator the larger cost, so `auto` installs the standard loss and says why; a long
    one, or the same head frozen, gets the chunked loss; `tokens` not given: chunked (nothing weighed)."""
    short = loss.install(tiny(tie=False), "auto", tokens=1)
    assert short["resolved"] == "standard" and "weight-gradient accumulator" in short["reason"], short
    assert loss.install(tiny(tie=False), "auto", tokens=8192)["resolved"] == "chunked"
    frozen = tiny(tie=False)
    frozen.lm_head.weight.requires_grad_(False)
    assert loss.install(frozen, "auto", tokens=1)["resolved"] == "chunked"
    assert loss.install(tiny(tie=False), "auto")["resolved"] == "chunked"
