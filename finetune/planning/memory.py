"""Memory per device and per host process for every strategy and method, from the config alone.

Model states use the ZeRO paper's partitioning (finetune/planning/params.py, Rajbhandari et al. 2020)
applied to what this framework actually holds (docs/planning.md has every formula and source):

- weights are loaded in the training dtype (model.dtype "auto": bf16 on a GPU, fp32 on a CPU;
  finetune/modeling/load.py) with no autocast, so torch-native strategies (single, DDP, FSDP2) keep
  no fp32 master copy and AdamW's two states take the parameter's dtype (2 x its bytes);
  DeepSpeed (ZeRO-1/2/3) always keeps an fp32 master partition: K = 12 bytes/parameter.
- LoRA adapters are fp32 (peft casts adapters of a 16-bit model to fp32, autocast_adapter_dtype).
- QLoRA: NF4 4-bit linear weights of the blocks + quantization constants (QLoRA paper,
  Dettmers et al. 2023, §3: blocksize 64; double quantization stores the absmax constants in
  8 bits with one fp32 constant per 256 of them: 8/64 + 32/(64*256) = 0.127 bits/parameter;
  without it 32/64 = 0.5 bits/parameter); embeddings, norms and lm_head stay unquantized and
  peft's prepare_model_for_kbit_training casts them to fp32.
- activations: per layer, the tensors autograd keeps for backward in a Llama block under SDPA
  (no s x s score matrix is stored), our adaptation of Korthikanti et al. 2022 (sbh(34+5as/h)
  for GPT blocks with dropout): act_bytes * s * b * (6h + 2q + 2kv + 4i + 2), q = heads*head_dim,
  kv = kv_heads*head_dim, i = intermediate; eager attention adds 2 * act_bytes * b * heads * s^2.
  With gradient checkpointing: the L block inputs (act_bytes * s * b * h each) + one block whole.
- logits: b*s*V in the activation dtype, an fp32 copy for the loss when that dtype is 16-bit,
  fp32 log-softmax kept for backward and its fp32 gradient: b*s*V*(act_bytes + [4] + 4 + 4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from finetune.planning.params import ADAM_K, ParamCount, count_parameters
from finetune.strategies import KEYS, by_key, planner_key
from finetune.units import GIB, gib

CUDA_CONTEXT_GIB = 0.5  # CUDA context + cuBLAS/NCCL workspaces, outside torch's allocator (typical H100 figure)
TEMPORARY_FRACTION = 0.10  # allocator fragmentation and short-lived temporaries, as a share of the rest
# Resident set of one Python process with torch + transformers + accelerate + peft + deepspeed
# imported: 0.53 GiB measured here (psutil RSS after the imports, torch 2.13 cpu, transformers 5.23).
PROCESS_BASELINE_GIB = 0.55
NF4_BITS = {True: 4 + 8 / 64 + 32 / (64 * 256), False: 4 + 32 / 64}  # double_quant -> bits/parameter

# Plan rows: every strategy of the table (finetune/strategies.py), in its order.
STRATEGIES = KEYS
METHODS = ("full", "lora", "qlora")


@dataclass
class Shape:
    """What the memory arithmetic needs from a transformers config."""

    model_type: str
    params: ParamCount
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    linears: list = field(default_factory=list)  # (name, in_features, out_features) per block

    @property
    def block_linear_params(self) -> int:
        return self.layers * sum(i * o for _, i, o in self.linears)

    def lora_params(self, r: int, targets) -> int:
        """LoRA A (r x in) + B (out x r) per targeted linear of every block. "all-linear" is every
        linear of the blocks (peft leaves the output head alone)."""
        chosen = self.targeted(targets)
        return self.layers * sum(r * (i + o) for _, i, o in chosen)

    def targeted(self, targets) -> list:
        if targets == "all-linear":
            return list(self.linears)
        names = set(targets)
        return [t for t in self.linears if t[0] in names or t[0].rsplit(".", 1)[-1] in names]


def shape_of(config) -> Shape:
    count = count_parameters(config)  # raises ValueError naming unsupported model types
    if config.model_type == "gpt2":
        h, inner = config.n_embd, config.n_inner or 4 * config.n_embd
        linears = [("c_attn", h, 3 * h), ("attn.c_proj", h, h), ("c_fc", h, inner), ("mlp.c_proj", inner, h)]
        return Shape("gpt2", count, h, config.n_layer, config.n_head, config.n_head, h // config.n_head, inner,
                     config.vocab_size, linears)
    h, heads = config.hidden_size, config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or h // heads
    inter = config.intermediate_size
    linears = [("q_proj", h, heads * hd), ("k_proj", h, kv * hd), ("v_proj", h, kv * hd), ("o_proj", heads * hd, h),
               ("gate_proj", h, inter), ("up_proj", h, inter), ("down_proj", inter, h)]
    return Shape(config.model_type, count, h, config.num_hidden_layers, heads, kv, hd, inter, config.vocab_size,
                 linears)


@dataclass
class Workload:
    """The recipe's side of the arithmetic."""

    method: str  # full | lora | qlora
    micro_batch: int
    seq_len: int
    grad_accum: int = 1
    gradient_checkpointing: bool = False
    weight_bytes: int = 2  # training dtype of the weights: 2 (bf16/fp16) or 4 (fp32)
    lora_r: int = 16
    lora_targets: object = "all-linear"
    lora_dropout: float = 0.0
    double_quant: bool = True
    attn_implementation: str = "sdpa"


def activation_bytes(shape: Shape, w: Workload) -> dict:
    """Bytes of activations kept for backward, and of the logits path (see the module docstring)."""
    a, s, b = w.weight_bytes, w.seq_len, w.micro_batch
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    # Two RMSNorms keep input, normalized and weighted output (3h each) + the fp32-sized rsqrt (1);
    # attention keeps rotated q and k, v and the SDPA output (2q + 2kv); the gated MLP keeps
    # gate, up, act(gate) and their product (4i). Seen with torch.autograd.graph.saved_tensors_hooks
    # on transformers' LlamaDecoderLayer (tests/planning/test_plan.py checks it).
    per_layer = a * s * b * (6 * shape.hidden + 2 * q + 2 * kv + 4 * shape.intermediate + 2)
    per_layer += 4 * b * shape.heads * s  # SDPA's fp32 log-sum-exp per query and head
    if w.attn_implementation == "eager":
        per_layer += 2 * a * b * shape.heads * s * s  # the s x s weights before and after softmax
    if w.method in ("lora", "qlora"):
        chosen = shape.targeted(w.lora_targets)
        per_layer += a * s * b * w.lora_r * len(chosen)  # lora_A outputs
        if w.lora_dropout > 0:  # a dropped copy of each adapter input + its mask
            per_layer += sum((a + 1) * s * b * i for _, i, _ in chosen)
    block_input = a * s * b * shape.hidden
    if w.gradient_checkpointing:
        layers = shape.layers * block_input + per_layer  # block inputs + one block recomputed
    else:
        layers = shape.layers * per_layer
    layers += 3 * block_input  # the final norm: input, normalized, weighted
    logits = b * s * shape.vocab * (a + (4 if a < 4 else 0) + 4 + 4)
    return {"activations": layers, "logits": logits}


def components(shape: Shape, w: Workload, strategy: str, n: int) -> tuple[dict, dict]:
    """(device bytes per component, host bytes per component of one rank's process)."""
    st = by_key(strategy)
    psi = shape.params.total
    wb = w.weight_bytes
    frozen = {}  # frozen base weights by component name (LoRA/QLoRA)
    if w.method == "full":
        trainable, tdt = psi, wb
    else:
        trainable, tdt = shape.lora_params(w.lora_r, w.lora_targets), 4  # fp32 adapters (peft)
        if w.method == "qlora":
            quantized = shape.block_linear_params
            frozen["nf4_weights+constants"] = quantized * NF4_BITS[w.double_quant] / 8
            frozen["unquantized_weights_fp32"] = (psi - quantized) * 4  # prepare_model_for_kbit_training
        else:
            frozen["frozen_weights"] = psi * wb
    # Optimizer: DeepSpeed always keeps an fp32 master partition (K = 12); torch AdamW keeps
    # exp_avg and exp_avg_sq in the parameter's dtype and no master copy.
    opt_per_param = ADAM_K if st.zero_stage is not None else 2 * tdt
    grad_per_param = tdt
    shard_p = n if st.shards_params else 1
    shard_g = n if st.shards_grads else 1
    shard_o = n if st.shards_optimizer else 1
    trainable_w = trainable * tdt / shard_p
    grads = trainable * grad_per_param / shard_g
    opt = trainable * opt_per_param / shard_o
    device, host = {}, {}
    if w.method == "full":
        device["weights"] = trainable_w
    else:
        device.update({k: v / shard_p for k, v in frozen.items()})
        device["lora_adapters"] = trainable_w
    device["gradients"] = grads
    device["optimizer_states"] = opt
    if strategy == "ddp":
        # torch DDP's gradient buckets are a second copy of the gradients unless
        # gradient_as_bucket_view=True (torch.nn.parallel.DistributedDataParallel docs).
        device["ddp_grad_buckets"] = trainable * tdt
    if st.offload_optimizer:
        host["optimizer_states"] = device.pop("optimizer_states")
        if st.zero_stage is not None:
            # ZeRO-Offload (Ren et al. 2021, §4.1): gradients are reduced into an fp32 partition in
            # host memory next to the states; the device keeps only a reduce bucket (in temporaries).
            device.pop("gradients")
            host["fp32_grad_partition"] = trainable * 4 / n
    if st.offload_params:
        for key in ("weights", "lora_adapters", *frozen):
            if key in device:
                host[key] = device.pop(key)
        if st.zero_stage is None:  # FSDP2 CPUOffloadPolicy: sharded gradients live on the host too
            host["gradients"] = device.pop("gradients")
    if st.shards_params:
        # Parameters gathered for compute: the current block and the prefetched next one
        # (FSDP2 wraps each decoder layer; ZeRO-3 fetches module by module with prefetch).
        block = shape.params.per_layer
        if w.method == "qlora":
            block_bytes = sum(i * o for _, i, o in shape.linears) * NF4_BITS[w.double_quant] / 8
        else:
            block_bytes = block * wb
        device["gathered_params"] = 2 * block_bytes
    device.update(activation_bytes(shape, w))
    return device, host


def totals(device: dict, host: dict, *, on_gpu: bool) -> tuple[dict, dict]:
    """Add the stated allowances (CUDA context, temporaries, Python process baseline)."""
    device, host = dict(device), dict(host)
    if on_gpu:
        device["temporaries"] = TEMPORARY_FRACTION * sum(device.values())
        device["cuda_context"] = CUDA_CONTEXT_GIB * GIB
    else:  # a CPU run computes on the host: the same temporaries there
        host["temporaries"] = TEMPORARY_FRACTION * sum(host.values())
    host["process_baseline"] = PROCESS_BASELINE_GIB * GIB
    return device, host


def plan_rows(shape: Shape, w: Workload, n: int, methods=METHODS, strategies=STRATEGIES) -> list[dict]:
    """One row per (method, strategy) with bytes per component on one device and one host process."""
    rows = []
    for method in methods:
        wm = Workload(**{**w.__dict__, "method": method})
        for strategy in strategies:
            if n == 1 and strategy != "single" and not by_key(strategy).offload_optimizer:
                continue  # on one device only the offload variants differ from `single`
            dev, host = totals(*components(shape, wm, strategy, n), on_gpu=True)
            rows.append({"method": method, "strategy": strategy, "device": dev, "host": host,
                         "device_total": sum(dev.values()), "host_total": sum(host.values())})
    return rows


def assumptions(w: Workload, *, on_gpu: bool) -> dict:
    return {
        "weight_bytes": w.weight_bytes,
        "optimizer": "AdamW; DeepSpeed keeps fp32 master + momentum + variance (K=12 bytes/param); "
                     "torch-native strategies keep momentum + variance in the parameter dtype, no master copy",
        "activation_formula": "per layer act_bytes*s*b*(6h+2q+2kv+4i+2) (+2*act_bytes*b*heads*s^2 for eager), "
                              "adapted from Korthikanti et al. 2022 sbh(34+5as/h) to Llama blocks under SDPA; "
                              "checkpointing keeps the L block inputs + one block",
        "logits": "b*s*V*(act_bytes + fp32 copy if 16-bit + fp32 log-softmax + fp32 grad)",
        "nf4_bits_per_param": NF4_BITS[w.double_quant],
        "allowance": (f"CUDA context {CUDA_CONTEXT_GIB} GiB + " if on_gpu else "")
                     + f"{int(TEMPORARY_FRACTION * 100)}% temporaries on the computing device"
                     + ("" if on_gpu else " (the host)") + f"; {PROCESS_BASELINE_GIB} GiB Python+torch process baseline",
        "micro_batch": w.micro_batch, "seq_len": w.seq_len, "gradient_checkpointing": w.gradient_checkpointing,
    }


def predicted_memory(model_config, cfg, engaged: dict, *, gradient_checkpointing: bool, on_gpu: bool,
                     weight_bytes: int, seq_len: int | None = None) -> dict:
    """run.json `predicted_memory` for the strategy that engaged (shape in docs/planning.md).
    On a CPU run the device is the host: everything is predicted as one process's RSS."""
    strategy = planner_key(engaged.get("name"), engaged.get("offload", "none"))
    n = engaged.get("world_size") or 1
    w = workload_from_config(cfg, weight_bytes=weight_bytes, gradient_checkpointing=gradient_checkpointing)
    if seq_len is not None:
        w.seq_len = seq_len
    shape = shape_of(model_config)
    device, host = components(shape, w, strategy, n)
    if not on_gpu:  # everything lives in the one process
        host = {**device, **{f"{k} (offloaded)": v for k, v in host.items()}}
        device = {}
    device, host = totals(device, host, on_gpu=on_gpu)
    notes = assumptions(w, on_gpu=on_gpu)
    notes["seq_len_source"] = ("longest tokenized training example (batches are padded to their longest; "
                               "data.max_length caps it)" if seq_len is not None else "data.max_length")
    notes["host_scope"] = "one process (rank); compared with memory.max.host_peak_rss_gib (training peak)"
    notes["device_scope"] = "one device; compared with memory.max.device_peak_allocated_gib, less the CUDA context"
    return {"strategy": strategy, "method": w.method, "world_size": n,
            "device": {"components_gib": {k: gib(v) for k, v in device.items()},
                       "total_gib": gib(sum(device.values()))} if on_gpu else None,
            "host": {"components_gib": {k: gib(v) for k, v in host.items()}, "total_gib": gib(sum(host.values()))},
            "assumptions": notes, "error": None}


def add_error(predicted: dict, memory: dict, host_lifetime_gib: float | None = None) -> dict:
    """Fill predicted['error'] from run.json `memory` (training peaks): (predicted - measured) / measured.
    host_lifetime_gib: rank 0's lifetime peak RSS as the meter kept it (its high-water-mark resets
    also reset what getrusage reports, finetune/telemetry/memory_peaks.py); getrusage without it."""
    peaks = (memory or {}).get("max") or {}

    def err(pred, measured):
        if pred is None or not measured:
            return None
        return {"predicted_gib": round(pred, 4), "measured_gib": measured,
                "relative_error": round((pred - measured) / measured, 4)}

    dev = predicted.get("device")
    dev_pred = None
    if dev:
        dev_pred = dev["total_gib"] - dev["components_gib"].get("cuda_context", 0.0)  # outside torch's counters
    predicted["error"] = {"device": err(dev_pred, peaks.get("device_peak_allocated_gib")),
                          "host": err(predicted["host"]["total_gib"], peaks.get("host_peak_rss_gib"))}
    # The training host peak covers training only (where the kernel's high-water mark cannot be
    # reset it is sampled between micro-steps and misses what lives only inside a step); the
    # lifetime peak of this process (rank 0) includes model loading: both are given.
    import resource
    import sys

    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    lifetime = host_lifetime_gib if host_lifetime_gib is not None else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / GIB
    predicted["error"]["host_lifetime_peak_rank0"] = err(predicted["host"]["total_gib"], round(lifetime, 4))
    return predicted


def workload_from_config(cfg, *, weight_bytes: int, gradient_checkpointing: bool | None = None) -> Workload:
    targs = cfg.training.args
    if gradient_checkpointing is None:
        gradient_checkpointing = bool(targs.get("gradient_checkpointing", False))
    m = cfg.method
    return Workload(method=m.name, micro_batch=int(targs.get("per_device_train_batch_size", 8)),
                    seq_len=cfg.data.max_length, grad_accum=int(targs.get("gradient_accumulation_steps", 1)),
                    gradient_checkpointing=gradient_checkpointing, weight_bytes=weight_bytes, lora_r=m.lora_r,
                    lora_targets=m.target_modules, lora_dropout=m.lora_dropout, double_quant=m.double_quant,
                    attn_implementation=cfg.model.attn_implementation)


def record_prediction(rec, model_config, cfg, *, gradient_checkpointing: bool, weight_bytes: int,
                      train_dataset=None) -> None:
    """run.json `predicted_memory` for the strategy in the record's `strategy`; null with a logged reason
    when the architecture has no arithmetic here (training goes on: a plan is not a precondition).
    The sequence length is the longest training example when the dataset is given (an input the
    run knows before its first step), else data.max_length."""
    import logging

    engaged = rec.view.get("strategy", default={})
    seq_len = None
    if train_dataset is not None and "input_ids" in train_dataset.column_names and len(train_dataset):
        seq_len = min(max(len(ids) for ids in train_dataset["input_ids"]), cfg.data.max_length)
    on_gpu = rec.view.get("hardware", "device_type") == "cuda" and not engaged.get("cpu_distributed")
    try:
        rec.set("predicted_memory", predicted_memory(model_config, cfg, engaged, on_gpu=on_gpu,
                                                     gradient_checkpointing=gradient_checkpointing,
                                                     weight_bytes=weight_bytes, seq_len=seq_len))
    except ValueError as e:
        logging.getLogger(__name__).warning("no memory prediction in run.json: %s", e)
        rec.set("predicted_memory", None)


def record_error(rec, host_lifetime_gib: float | None = None) -> None:
    """Once training ends: the relative error of the prediction against the measured training peaks."""
    predicted = rec.view.get("predicted_memory")
    if predicted is not None:
        rec.set("predicted_memory", add_error(predicted, rec.view.get("memory"), host_lifetime_gib))
