"""CPU instruments for the planner's mechanism tests: a small Llama with Llama-3.2-1B's ratios (GQA
4:1, head_dim 64, intermediate 4h), models in the regimes the planner knows, and two independent
counts of memory: the storages autograd saves (torch.autograd.graph.saved_tensors_hooks, per
decoder layer) and the live bytes over a whole training step from the allocator events the torch
profiler records (profile_memory=True).

The profiler's timeline comes from torch.profiler._memory_profiler.MemoryProfile, a private torch
API (pinned: torch 2.13 on this machine; its public wrapper, profile.export_memory_timeline, is
deprecated and gives the same peak). Used by tests only.
"""

from __future__ import annotations

import contextlib
import tempfile

import torch

from finetune.planning import regimes, shapes

SHAPE = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=64,
    tie_word_embeddings=True,
)

# name: (method, load dtype, torch.autocast, the planner's regime)
REGIMES = {
    "bf16_true_full": ("full", torch.bfloat16, False, regimes.policy_regime("bf16-true", "full", "single")),
    "fp32_full": ("full", torch.float32, False, regimes.policy_regime("32-true", "full", "single")),
    "bf16_mixed_full": ("full", torch.float32, True, regimes.policy_regime("bf16-mixed", "full", "single")),
    "lora_legacy": ("lora", torch.bfloat16, False, regimes.legacy_regime("lora", "single")),
    "lora_mixed": ("lora", torch.bfloat16, True, regimes.policy_regime("bf16-mixed", "lora", "single")),
    "lora_bf16_true": ("lora", torch.bfloat16, False, regimes.policy_regime("bf16-true", "lora", "single")),
    "qlora_legacy": ("qlora", torch.bfloat16, False, regimes.legacy_regime("qlora", "single")),
    "qlora_mixed": ("qlora", torch.bfloat16, True, regimes.policy_regime("bf16-mixed", "qlora", "single")),
}
# The SDPA kernel CUDA would run (finetune/planning/activations.py attention_kind), forced on CPU,
# where mem-efficient attention does not exist: CPU flash takes masks and fp32 like it.
BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "FLASH_ATTENTION", "math": "MATH", "eager": None}


def config(model_type: str = "llama", **kw):
    from transformers import AutoConfig

    attn = kw.pop("attn", "sdpa")
    return AutoConfig.for_model(model_type, **{**SHAPE, "attn_implementation": attn, **kw})


def build(regime: str, cfg, *, ckpt: bool = False, lora_dropout: float = 0.0, seed: int = 0):
    """A model as finetune/modeling/load.py builds it for the regime (peft, bitsandbytes, checkpointing)."""
    from transformers import AutoModelForCausalLM

    method, dtype, _, reg = REGIMES[regime]
    torch.manual_seed(seed)
    if method == "qlora":
        from peft import prepare_model_for_kbit_training
        from transformers import BitsAndBytesConfig

        tmp = tempfile.mkdtemp(prefix="planner_q_")
        AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(tmp)
        q = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_quant_storage=torch.bfloat16,
        )
        model = AutoModelForCausalLM.from_pretrained(
            tmp, dtype=torch.bfloat16, quantization_config=q, attn_implementation=cfg._attn_implementation
        )
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=ckpt, gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    else:
        model = AutoModelForCausalLM.from_config(cfg).to(dtype)
        if ckpt:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            if method == "lora":
                model.enable_input_require_grads()
    model.config.use_cache = False
    if method != "full":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=16, lora_alpha=32, lora_dropout=lora_dropout, target_modules="all-linear", task_type="CAUSAL_LM"
        )
        model = get_peft_model(model, lora, autocast_adapter_dtype=reg.param == regimes.F32)
    return model.train()


def batch(vocab: int, b: int, s: int, *, pad: int = 0, packed: bool = False, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    out = {"input_ids": ids, "labels": ids.clone()}
    if packed:  # two examples per row, position_ids restarting (finetune/data/collate.py)
        half = s // 2
        out["position_ids"] = torch.cat([torch.arange(half), torch.arange(s - half)]).repeat(b, 1)
    else:
        mask = torch.ones_like(ids)
        if pad:
            mask[:, -pad:] = 0
        out["attention_mask"] = mask
    return out


@contextlib.contextmanager
def sdpa(kind: str):
    name = BACKENDS[kind]
    if name is None:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, name)]):
        yield


def autocast_ctx(regime: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if REGIMES[regime][2] else contextlib.nullcontext()


def saved_per_layer(model, inputs: dict, regime: str, kind: str | list[str]) -> dict:
    """Bytes of the unique storages autograd saves in the forward (parameters excluded), by where
    they are first saved: "layer0", "layer1", ... (a decoder layer running) or "outside" (embedding,
    final norm, head, loss). One forward, loss included. `kind`: the attention kernel to force, or one
    per decoder layer (Gemma 3's sliding layers get a mask the others do not)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where = {"now": "outside"}
    seen: dict[int, tuple[str, int]] = {}
    layers = [m for name, m in model.named_modules() if type(m).__name__.endswith("DecoderLayer")]
    kinds = kind if isinstance(kind, list) else [kind] * len(layers)
    handles, forced = [], contextlib.ExitStack()

    def enter(k):
        where["now"] = f"layer{k}"
        forced.enter_context(sdpa(kinds[k]))

    def leave():
        where["now"] = "outside"
        forced.close()

    for k, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda *_, k=k: enter(k)))
        handles.append(layer.register_forward_hook(lambda *_: leave()))

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.data_ptr() not in seen:
            seen[st.data_ptr()] = (where["now"], st.nbytes())
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast_ctx(regime):
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    out: dict[str, int] = {}
    for place, nbytes in seen.values():
        out[place] = out.get(place, 0) + nbytes
    return out


def storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is not None:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def step_peak(model, inputs: dict, regime: str, kind: str) -> dict:
    """Peak live bytes above the model states during one training step (forward with transformers'
    loss, backward, gradient clipping, fused AdamW, zero_grad), after a first step created the
    optimizer states; and the innermost op running at that peak. From the CPU allocator events."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfile

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=True)

    def step():
        with sdpa(kind):  # around the backward too: checkpointing recomputes there
            with autocast_ctx(regime):
                loss = model(**inputs).loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    states = storage_bytes(
        list(model.parameters())
        + list(model.buffers())
        + [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    )
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    results = prof.profiler.kineto_results
    live = peak = 0
    at = None
    for t, action, (key, _), size in MemoryProfile(results).timeline:
        if key.device.type != "cpu":
            continue
        live += size if action == Action.CREATE else (-size if action == Action.DESTROY else 0)
        if live > peak:
            peak, at = live, t
    op = None
    for e in results.events():
        start, end = e.start_ns(), e.start_ns() + e.duration_ns()
        if e.name() != "[memory]" and start <= at <= end and (op is None or e.duration_ns() < op[1]):
            op = (e.name(), e.duration_ns())
    return {"peak": peak, "op": op[0] if op else None, "states": states}


def workload(regime: str, b: int, s: int, **kw) -> shapes.Workload:
    return shapes.Workload(method=REGIMES[regime][0], micro_batch=b, seq_len=s, **kw)
