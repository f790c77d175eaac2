"""Model loading (finetune/modeling/load.py): full, LoRA and QLoRA on a tiny random Llama, on CPU.

Expected parameter counts are computed from the config dimensions, not from the model under test.
"""

from __future__ import annotations

import pytest
import torch

from finetune.config.sections import BUNDLED_MODEL, MethodConfig, ModelConfig
from finetune.errors import UserError
from finetune.modeling.load import count_parameters, load_model, load_tokenizer, resolve_model_path

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def model_cfg(path) -> ModelConfig:
    return ModelConfig(name_or_path=str(path), dtype="float32")


def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each decoder linear, from the config alone."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def expected_base_count(config) -> int:
    h, layers = config.hidden_size, config.num_hidden_layers
    per_layer = sum(a * b for a, b in linear_shapes(config).values()) + 2 * h  # + two RMSNorms
    head = 0 if config.tie_word_embeddings else config.vocab_size * h
    return config.vocab_size * h + layers * per_layer + h + head  # + final norm


def expected_lora_count(config, r: int, targets=LINEARS) -> int:
    return config.num_hidden_layers * sum(r * (a + b) for m, (a, b) in linear_shapes(config).items() if m in targets)


def lora_targets(model) -> set[str]:
    """Qualified names (model.layers.N.self_attn.q_proj, ...) of the modules carrying an adapter."""
    from peft.tuners.lora import LoraLayer

    prefix = "base_model.model."
    return {name[len(prefix) :] for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def expected_targets(config, targets=LINEARS) -> set[str]:
    kind = {m: ("self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp") for m in LINEARS}
    return {f"model.layers.{n}.{kind[m]}.{m}" for n in range(config.num_hidden_layers) for m in targets}


def batch(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, 12), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


# --- full and LoRA ------------------------------------------------------------------------------


def test_full_every_parameter_trainable(tiny_model_dir):
    model = load_model(model_cfg(tiny_model_dir), MethodConfig(name="full"))
    params = list(model.parameters())
    assert params and all(p.requires_grad for p in params)
    assert all(p.dtype == torch.float32 for p in params)
    assert model.config.use_cache is False
    assert not model.is_activation_checkpointing
    n = expected_base_count(model.config)
    assert count_parameters(model) == (n, n)


def test_zero3_partitioned_parameters_are_counted_at_their_full_size(tiny_model_dir):
    """Issue 15 item 3: under zero3_init_flag from_pretrained loads each weight straight into its
    shard and leaves an empty placeholder that carries DeepSpeed's ds_numel; the record said
    {trainable: 0, total: 0}. Simulated here on the placeholders' two attributes that matter."""
    model = load_model(ModelConfig(name_or_path=str(tiny_model_dir), dtype="float32"), MethodConfig(name="full"))
    want = count_parameters(model)
    assert want[0] == want[1] > 0
    for p in model.parameters():
        p.ds_numel = p.numel()
        p.data = torch.empty(0)  # what a rank holds of a partitioned parameter outside the engine
    assert count_parameters(model) == want


def test_lora_all_linear(tiny_model_dir):
    method = MethodConfig(name="lora")  # target_modules defaults to "all-linear"
    model = load_model(model_cfg(tiny_model_dir), method)
    config = model.config

    assert lora_targets(model) == expected_targets(config)  # every decoder linear, not lm_head
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * len(expected_targets(config))
    adapter = model.base_model.model.model.layers[1].mlp.down_proj
    assert (adapter.r["default"], adapter.scaling["default"]) == (16, 32 / 16)

    lora = expected_lora_count(config, method.lora_r)
    assert count_parameters(model) == (lora, expected_base_count(config) + lora)


def test_lora_custom_target_modules(tiny_model_dir):
    method = MethodConfig(name="lora", lora_r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = load_model(model_cfg(tiny_model_dir), method)
    config = model.config
    assert lora_targets(model) == expected_targets(config, ("q_proj", "v_proj"))
    lora = expected_lora_count(config, 4, ("q_proj", "v_proj"))
    assert count_parameters(model) == (lora, expected_base_count(config) + lora)


@pytest.mark.parametrize(
    "targets",
    [["qkv_proj_typo"], ["q_proj", "v_projj"], "no_such_(proj|layer)"],
    ids=["none-match", "one-typo", "regex"],
)
def test_lora_unknown_target_module_is_a_user_error(tiny_model_dir, targets):
    # peft itself only fails when nothing matches; a typo next to a valid name must fail too.
    method = MethodConfig(name="lora", target_modules=targets)
    with pytest.raises(UserError, match=r"^method\.target_modules: ") as info:
        load_model(model_cfg(tiny_model_dir), method)
    assert (targets[-1] if isinstance(targets, list) else targets) in str(info.value)


@pytest.mark.parametrize("name", ["full", "lora", "qlora"])
def test_gradient_checkpointing_enabled_and_used(tiny_model_dir, name):
    model = load_model(model_cfg(tiny_model_dir), MethodConfig(name=name), gradient_checkpointing=True)
    assert model.is_activation_checkpointing
    base = model if name == "full" else model.base_model.model
    assert all(layer.gradient_checkpointing for layer in base.model.layers)

    # Really used: with checkpointing the block's forward runs again during backward. (A pre-hook:
    # torch's non-reentrant recompute stops early, once the last saved tensor is rebuilt, which is
    # inside the MLP, so a forward hook on the MLP would not fire the second time.)
    calls = []
    base.model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    model.train()
    loss = model(**batch(model.config.vocab_size)).loss
    assert len(calls) == 1
    loss.backward()
    assert len(calls) == 2
    grads = [p.grad for n, p in model.named_parameters() if p.requires_grad and (name == "full" or ".lora_B." in n)]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


# --- QLoRA --------------------------------------------------------------------------------------


@pytest.mark.parametrize("storage, want_storage", [("auto", torch.float32), ("uint8", torch.uint8)])
def test_qlora_base_is_bnb_4bit_and_trains_on_cpu(tiny_model_dir, storage, want_storage):
    import bitsandbytes as bnb
    from bitsandbytes.functional import dequantize_4bit
    from transformers import LlamaForCausalLM

    method = MethodConfig(name="qlora", quant_storage=storage)
    model = load_model(model_cfg(tiny_model_dir), method)
    plain = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    config = model.config

    assert lora_targets(model) == expected_targets(config)
    base = model.base_model.model
    for name in expected_targets(config):
        layer = base.get_submodule(name).base_layer
        original = plain.get_submodule(name).weight.detach()
        w = layer.weight
        assert isinstance(layer, bnb.nn.Linear4bit), name
        assert type(w) is bnb.nn.Params4bit and not w.requires_grad, name
        assert w.bnb_quantized and w.quant_state.quant_type == "nf4", name
        assert w.quant_state.nested, f"{name}: double quantization is off"  # absmax quantized again
        assert w.dtype == want_storage and layer.quant_storage == want_storage, name
        assert layer.compute_dtype == torch.float32, name
        assert w.numel() * w.element_size() * 2 == original.numel(), name  # 4 bits per weight
        # The packed data is the NF4 code of this layer's weights: close, but not exact.
        deq = dequantize_4bit(w.data, w.quant_state)
        assert deq.shape == original.shape
        rel = ((deq - original).norm() / original.norm()).item()
        assert 0 < rel < 0.15, (name, rel)

    lora = expected_lora_count(config, method.lora_r)
    # Logical size: the 4-bit weights count as the unquantized model's parameters.
    assert count_parameters(model) == (lora, expected_base_count(config) + lora)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)

    # The 4-bit forward on CPU computes with those dequantized weights: lora_B starts at zero, so
    # the QLoRA model must match the plain model with its linears replaced by their NF4 values.
    with torch.no_grad():
        for name in expected_targets(config):
            w = base.get_submodule(name).base_layer.weight
            plain.get_submodule(name).weight.copy_(dequantize_4bit(w.data, w.quant_state))
    inputs = batch(config.vocab_size)
    model.train()  # dropout is applied before lora_A, which meets lora_B = 0: no effect yet
    out = model(**inputs)
    with torch.no_grad():
        want = plain(**inputs)
    torch.testing.assert_close(out.logits, want.logits, atol=1e-4, rtol=1e-4)
    assert torch.isfinite(out.loss)

    out.loss.backward()
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, n
            continue
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        if ".lora_B." in n:  # lora_A's gradient is exactly zero while lora_B is zero
            assert p.grad.abs().sum() > 0, n


# --- where the model comes from -----------------------------------------------------------------


def test_missing_local_path_is_a_user_error(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(UserError, match=r"^model\.name_or_path: .*no such local directory") as info:
        load_model(model_cfg(missing), MethodConfig(name="lora"))
    assert str(missing) in str(info.value)


def test_directory_without_a_model_is_a_user_error(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(UserError, match=r"^model\.name_or_path: .*exists but is not a transformers model"):
        load_model(model_cfg(tmp_path), MethodConfig(name="full"))


def test_bundled_name_resolves_to_the_cache_dir(bundled_model_dir):
    assert resolve_model_path(BUNDLED_MODEL) == str(bundled_model_dir)
    assert (bundled_model_dir / "config.json").is_file()
    assert resolve_model_path("some-org/some-model") == "some-org/some-model"  # hub ids pass through
    with pytest.raises(UserError, match=r"model\.name_or_path: unknown bundled model 'bundled:Other'"):
        resolve_model_path("bundled:Other")


def test_load_tokenizer_pads_with_eos_when_there_is_no_pad_token(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).pad_token is None  # the case under test

    loaded = load_tokenizer(ModelConfig(name_or_path=str(tmp_path)))
    assert loaded.pad_token == loaded.eos_token == "<|im_end|>"
    assert loaded.chat_template


# --- the precision policy (finetune/precision.py) at load time -----------------------------------


def _policy_model(tiny_model_dir, policy, method, deepspeed=False):
    from finetune import precision

    return load_model(
        ModelConfig(name_or_path=str(tiny_model_dir)),
        MethodConfig(name=method),
        policy=precision.get(policy),
        deepspeed=deepspeed,
    )


def test_bf16_mixed_full_keeps_fp32_masters_that_start_from_the_bf16_checkpoint(tiny_model_dir):
    from transformers import LlamaForCausalLM

    model = _policy_model(tiny_model_dir, "bf16-mixed", "full")
    fp32 = dict(LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).named_parameters())
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.requires_grad, name
        # bf16-exact: what DeepSpeed's master starts from (a bf16 module, .float()), not the fp32 file's low bits
        assert torch.equal(p.detach(), fp32[name].detach().bfloat16().float()), name
    assert any(not torch.equal(p.detach(), fp32[n].detach()) for n, p in model.named_parameters())  # control
    # under DeepSpeed nothing is upcast: the engine keeps the module in bf16 and builds its own fp32 master
    assert {p.dtype for p in _policy_model(tiny_model_dir, "bf16-mixed", "full", deepspeed=True).parameters()} == {
        torch.bfloat16
    }
    assert {p.dtype for p in _policy_model(tiny_model_dir, "bf16-true", "full").parameters()} == {torch.bfloat16}


def test_lora_adapters_are_fp32_on_a_bf16_base_except_under_deepspeed_and_bf16_true(tiny_model_dir):
    def dtypes(model):
        frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
        adapters = {p.dtype for p in model.parameters() if p.requires_grad}
        return frozen, adapters

    assert dtypes(_policy_model(tiny_model_dir, "bf16-mixed", "lora")) == ({torch.bfloat16}, {torch.float32})
    assert dtypes(_policy_model(tiny_model_dir, "bf16-mixed", "lora", deepspeed=True)) == (
        {torch.bfloat16},
        {torch.bfloat16},
    )  # DeepSpeed's fp32 partitions are the master
    assert dtypes(_policy_model(tiny_model_dir, "bf16-true", "lora")) == ({torch.bfloat16}, {torch.bfloat16})
    assert dtypes(_policy_model(tiny_model_dir, "32-true", "lora")) == ({torch.float32}, {torch.float32})


def _lora_grads_after(model, inputs, eval_forward: bool) -> dict[str, torch.Tensor]:
    """The adapter's gradients on `inputs` in training mode, after an eval forward without gradients (the exact match
    before training) when `eval_forward`."""
    if eval_forward:
        model.eval()
        with torch.no_grad():
            model(**inputs)
    model.train()
    model.zero_grad()
    model(**inputs).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_qlora_trains_the_same_after_an_eval_forward(tiny_model_dir):
    """bitsandbytes 0.50 repacks a 4-bit layer for its AVX512-BF16 CPU kernel at its first eval forward without
    gradients, and trains through that kernel from then on, which has no autograd: the layers below got no gradient
    through it (finetune/modeling/load.py differentiable_4bit). The gradients after an eval forward are those before,
    bit for bit. Control: the same model with bitsandbytes' repacking left on gets other gradients."""
    from bitsandbytes.functional import has_avx512bf16

    if not has_avx512bf16():
        pytest.skip("bitsandbytes repacks 4-bit weights only on a CPU with AVX512-BF16; this one has none")

    def loaded(repack: bool):
        torch.manual_seed(0)  # the same adapter initialisation
        model = load_model(model_cfg(tiny_model_dir), MethodConfig(name="qlora", lora_dropout=0.0))
        for module in model.modules():
            if repack and hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = True  # bitsandbytes' default on this CPU
            if hasattr(module, "lora_B"):
                for b in module.lora_B.values():
                    torch.nn.init.normal_(b.weight, std=0.05)  # peft's zeros carry no gradient to the layers below
        return model

    model = loaded(False)
    inputs = batch(model.config.vocab_size)
    before = _lora_grads_after(model, inputs, eval_forward=False)
    after = _lora_grads_after(model, inputs, eval_forward=True)
    assert before and all(torch.equal(before[n], after[n]) for n in before)
    control = loaded(True)
    assert all(torch.equal(before[n], g) for n, g in _lora_grads_after(control, inputs, eval_forward=False).items())
    repacked = _lora_grads_after(control, inputs, eval_forward=True)
    worst = max((before[n] - repacked[n]).abs().max().item() / before[n].abs().max().item() for n in before)
    assert worst > 0.1, worst


def test_qlora_compute_dtype_follows_the_policy(tiny_model_dir):
    import bitsandbytes as bnb

    mixed = _policy_model(tiny_model_dir, "bf16-mixed", "qlora")
    layers = [m for m in mixed.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and {m.compute_dtype for m in layers} == {torch.bfloat16}
    assert {m.weight.dtype for m in layers} == {torch.bfloat16}  # quant_storage auto = the compute dtype
    unquantized = {p.dtype for p in mixed.parameters() if not p.requires_grad and type(p).__name__ != "Params4bit"}
    assert unquantized == {torch.float32}  # peft's prepare_model_for_kbit_training upcast, kept (measured policy)
    true = _policy_model(tiny_model_dir, "bf16-true", "qlora")
    assert {p.dtype for p in true.parameters() if type(p).__name__ != "Params4bit"} == {torch.bfloat16}
