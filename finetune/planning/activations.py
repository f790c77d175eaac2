"""What autograd keeps for backward in one training step, op by op: the decoder blocks' saved
tensors, the loss's buffers, and the dtype each has under a precision regime.

Units: bytes. T = tokens per micro-batch, h hidden, q = heads x head_dim, kv = kv_heads x head_dim, i intermediate, V
vocabulary, a = bytes per element of the tensor at hand. Every term is a tensor that transformers 5.23 / torch / peft
0.21 / bitsandbytes 0.50 allocate and autograd saves (library file:function in the comments).
tests/planning/test_activations.py counts the saved storages with torch.autograd.graph.saved_tensors_hooks and checks
these formulas to the byte for each regime; tests/planning/test_step_peak.py checks the whole step's peak with the
allocator events torch.profiler records.
"""

from __future__ import annotations

import math
from dataclasses import replace

from finetune.planning.regimes import B16, F32, Regime
from finetune.planning.shapes import GEMMA, NO_SDPA, Shape, Workload

INT64 = 8
# Mem-efficient attention pads the bias's last dimension to a multiple of 16 elements
# (aten/src/ATen/native/transformers/attention.cpp preprocess_mask / pad_bias) and its
# logsumexp rows to a multiple of 32 (kernel_forward.h: kAlignLSE).
MEM_EFFICIENT_BIAS_ALIGN = 16
MEM_EFFICIENT_LSE_ALIGN = 32


def _up(n: int, k: int) -> int:
    return -(-n // k) * k


def attention_kind(w: Workload, a: int) -> str:
    """The attention kernel that runs on CUDA for SDPA inputs of `a` bytes/element.

    transformers' sdpa_attention_forward passes enable_gqa=True only without a mask
    (integrations/sdpa_attention.py use_gqa_in_sdpa); flash and cuDNN need 16-bit inputs and no
    mask; mem-efficient takes masks and fp32 but not enable_gqa (torch sdp_utils); what is left
    (fp32 without a mask, GQA) is the math kernel, which keeps the b x heads x s x s softmax."""
    impl = w.attn_implementation
    if impl == "eager":
        return "eager"
    if impl.startswith("flash_attention"):
        return "flash"
    if w.attention_mask:
        return "efficient"
    return "flash" if a == B16 else "math"


class DtypeFlow:
    """Bytes per element of the tensors a block passes along (see activations())."""

    def __init__(self, w: Workload, p: Regime):
        full = w.method == "full"
        if w.method == "qlora":
            self.stream = p.frozen_compute  # embedding output; prepare_model_for_kbit_training: fp32
            self.lin_out = self.stream  # bitsandbytes Linear4bit returns its input's dtype (nn/modules.py forward)
        elif full:
            self.stream = p.param_compute  # the embedding runs outside autocast: the weights' dtype
            self.lin_out = B16 if p.autocast else p.param_compute
        else:
            self.stream = p.frozen_compute
            self.lin_out = B16 if p.autocast else p.frozen_compute  # peft: result.to(the base result's dtype)
        self.norm_weight = p.param_compute if full else p.frozen_compute
        self.adapter = p.param_compute  # LoRA weights as the forward reads them
        self.autocast = p.autocast


def forward_temporaries(sh: Shape, w: Workload, p: Regime, per: dict, *, cpu: bool = False) -> dict:
    """The largest short-lived bytes inside the last block's forward beyond what it keeps, less what
    the block has not saved yet at that moment ({"forward": ..., "recompute": ...}: the same block
    re-run by checkpointing inside the backward).

    * Python locals the forward holds while the block runs, when nothing saves them: the embedding
      output (LlamaModel.forward's inputs_embeds), the block's input (the call's args), the residual
      after attention and the post-attention norm's output (LlamaDecoderLayer.forward).
    * peft's adapter path at up_proj and down_proj (lora/layer.py Linear.forward:
      `result + lora_B(lora_A(x)) * scaling` holds the base result, the scaled adapter output and
      their sum in the wider dtype at once; under autocast the cast of x to the adapter dtype stays
      in a local until the method returns; lora/bnb.py Linear4bit.forward clones the base result).
      On CPU, an add of two dtypes also makes a cast copy of the narrower operand (TensorIterator
      promotes CPU inputs by copying; CUDA kernels cast while they load).
    * the math attention kernel's pre-softmax scores (b x heads x s x s) and its causal mask."""
    f = DtypeFlow(w, p)
    T, h, i = w.tokens, sh.hidden, sh.intermediate
    full = w.method == "full"
    saved_as_is = f.stream == F32  # the norms save an fp32 input itself (to(float32) is a no-op)
    first_needs_grad = full or w.gradient_checkpointing
    emb = 0 if (saved_as_is and first_needs_grad) or sh.layers == 1 else f.stream * T * h
    unsaved = 0 if saved_as_is else f.stream * T * h
    norm_out_saved = per["mlp_inputs"] == f.stream * T * h  # shared by the linears that read it
    locals_ = 2 * unsaved + (0 if norm_out_saved else f.stream * T * h)
    best = 0
    if w.method != "full":
        targets = {name for name, _, _ in sh.targeted(w.lora_targets)}
        out_b = B16 if f.autocast else f.adapter  # the adapter path's output dtype
        g = f.lin_out

        def at_add(n_out: int, x_b: int, n_in: int) -> int:
            wide = max(g, out_b)
            held = g * T * n_out + out_b * T * n_out + wide * T * n_out
            if w.method == "qlora":
                held += g * T * n_out  # result.clone() beside the base result
            if cpu and g != out_b:
                held += wide * T * n_out
            if f.autocast and x_b != f.adapter and w.method != "qlora":
                held += f.adapter * T * n_in  # _cast_input_dtype's copy, alive in the local x
            return held

        rb = B16 if f.autocast else f.adapter
        up = sh.readers("mlp")[-1]
        if (
            up in targets
        ):  # not saved yet: up itself (phi3: gate too), the product's adapter input, down's lora_A output
            tail = (
                per["mlp"] - (0 if sh.fused else 2 * g * T * i) + (rb * T * w.lora_r if "down_proj" in targets else 0)
            )
            best = max(best, at_add(i * (2 if sh.fused else 1), f.stream, h) - tail)
        if "down_proj" in targets:
            best = max(best, at_add(h, g, i))
    return {"forward": emb + unsaved + locals_ + best, "recompute": locals_ + best}


class BlockSaves:
    """What a decoder block's ops save for their inputs, in bytes, for the regime's dtype flow."""

    def __init__(self, sh: Shape, w: Workload, f: DtypeFlow):
        self.w, self.f, self.T = w, f, w.tokens
        self.full = w.method == "full"
        self.targets = {name for name, _, _ in sh.targeted(w.lora_targets)} if not self.full else set()
        h = sh.hidden
        self.feat = {"o_proj": sh.q, "down_proj": sh.intermediate}  # input features of each linear
        self.feat |= {name: h for part in ("attn", "mlp") for name in sh.readers(part)}
        self.gemma = sh.model_type in GEMMA

    def linear_inputs(self, x_b: int, names: list[str]) -> tuple[int, bool]:
        """Bytes saved for the input of the linears that read one tensor of x_b bytes/element,
        and whether that is the tensor itself (shared with whoever else saved it)."""
        f, w, T, n = self.f, self.w, self.T, self.feat[names[0]]
        if self.full:
            if f.autocast and x_b != B16:
                return len(names) * B16 * T * n, False  # autocast casts the input once per linear call
            return x_b * T * n, True  # one tensor, saved by every linear that reads it
        tgt = [m for m in names if m in self.targets]
        if not tgt:
            return 0, False  # a frozen linear saves nothing for its input
        if w.lora_dropout > 0:  # peft: lora_A(dropout(x)); CUDA's fused native_dropout saves a bool mask
            return len(tgt) * ((B16 if f.autocast else f.adapter) + 1) * T * n, False
        if f.autocast:
            # peft casts x to the adapter's dtype (lora/layer.py _cast_input_dtype; bnb.py skips it under
            # autocast), then autocast casts it to bf16 for lora_A: one copy per adapter unless x is bf16
            # already and nothing cast it (the QLoRA path)
            if w.method == "qlora" and x_b == B16:
                return x_b * T * n, True
            return len(tgt) * B16 * T * n, False
        if f.adapter == x_b:
            return x_b * T * n, True  # no cast: the adapters share the input
        return len(tgt) * f.adapter * T * n, False  # one cast copy per adapter (peft _cast_input_dtype)

    def norm(self, width: int, rows_per_token: int, weight: int = 0) -> int:
        """transformers LlamaRMSNorm.forward: hidden.to(fp32) (saved by pow and mul; a copy when 16-bit), rsqrt (fp32,
        one per row), and weight * xn.to(input dtype) saves xn only when the weight trains. Gemma's RMSNorm
        (modeling_gemma2.py Gemma2RMSNorm) multiplies in fp32, `xn * (1.0 + weight.float())`: that saves the fp32
        (1 + weight) (`weight` elements, the width by default) and, when the weight trains, the fp32 xn."""
        T = self.T
        if self.gemma:
            return (
                F32 * T * width
                + F32 * T * rows_per_token
                + F32 * (weight or width)
                + (F32 * T * width if self.full else 0)
            )
        return F32 * T * width + F32 * T * rows_per_token + (self.f.stream * T * width if self.full else 0)


def attention_saved(sh: Shape, w: Workload, attn_b: int, kind: str, kv_b: tuple = ()) -> tuple[int, bool]:
    """(bytes the attention kernel saves, whether o_proj reads a copy of its output rather than the
    output itself), for inputs of attn_b bytes/element; kv_b: the bytes/element of k and v before the
    kernel's cast (default attn_b)."""
    T, q, kv, H = w.tokens, sh.q, sh.kv, sh.heads
    n_rep = H // sh.kv_heads
    # Ulysses (sp > 1): after its all-to-all a rank attends over the whole row with heads / sp (q: the
    # same elements as its shard x every head); k and v keep kv_heads / sp heads, at least one (each
    # rank's copy of a replicated kv head: UlyssesSPAttentionHF kv_replication_factor)
    rows, s, Ha = w.rows, w.row_len * w.sp, H // w.sp
    kv_att = kv if w.sp == 1 else w.sp * max(1, sh.kv_heads // w.sp) * sh.head_dim
    if kind in ("flash", "efficient"):
        # saved: q, k, v, the output and an fp32 logsumexp per row and head. With a mask,
        # transformers repeats k and v to every head (repeat_kv: a copy unless kv_heads == 1, where it
        # is an expand; autocast's cast of an expanded fp32 k or v to bf16 materialises it all the same)
        # and SDPA converts the bool mask to a float bias per call, saved (convert_boolean_attn_mask)
        rep = w.attention_mask and n_rep > 1
        kvw = [q if rep and (sh.kv_heads > 1 or b != attn_b) else kv_att for b in (kv_b or (attn_b, attn_b))]
        lse_len = _up(s, MEM_EFFICIENT_LSE_ALIGN) if kind == "efficient" else s
        saved = attn_b * T * (q + sum(kvw)) + attn_b * T * q + F32 * rows * Ha * lse_len
        if w.attention_mask and kind == "efficient":
            saved += attn_b * rows * s * _up(s, MEM_EFFICIENT_BIAS_ALIGN)
        # the kernels write (b, s, heads, d): transpose(1, 2).contiguous() is a view; Ulysses sends the
        # output through its all-to-all, so o_proj reads (and saves) a new tensor
        return saved, w.sp > 1
    if kind == "math":
        # aten _scaled_dot_product_attention_math: q * sqrt(scale), repeated k * sqrt(scale), repeated v,
        # and the softmax output (b x heads x s x s)
        return attn_b * T * q * 3 + attn_b * rows * Ha * s * s, True
    # transformers eager_attention_forward: q, repeat_kv'd k and v, softmax in fp32 (saved) and
    # its cast back to the query's dtype (saved by the second matmul; none when fp32); Gemma 2's
    # soft-capping, tanh(scores / cap) * cap, saves tanh's output. repeat_kv's expand is a view when
    # kv_heads == 1, but matmul's reshape of it to 3-D copies it: k and v are saved at q's width either way
    kvw = q if n_rep > 1 else kv
    scores = F32 + (attn_b if attn_b != F32 else 0) + (attn_b if sh.attn_softcap else 0)
    return attn_b * T * (q + 2 * kvw) + scores * rows * Ha * s * s, True


def repeats_kv(sh: Shape, w: Workload, kind: str) -> bool:
    """Whether the attention gets copies of k and v repeated to every head rather than v itself."""
    n_rep = sh.heads // sh.kv_heads
    if kind in ("math", "eager"):
        return n_rep > 1  # math: enable_gqa's repeat_interleave; eager: attention_saved
    return n_rep > 1 and sh.kv_heads > 1 and w.attention_mask  # (v is not cast when this is asked)


def layer_workload(sh: Shape, w: Workload, layer_type: str) -> Workload:
    """The workload as one layer's attention sees it: Gemma 2 has no SDPA (eager instead, as the run loads it),
    and under SDPA a sliding-window layer gets a mask once a row reaches the window (transformers
    masking_utils _ignore_causal_mask_sdpa: skipped only while kv_length < the window)."""
    if sh.model_type in NO_SDPA and w.attn_implementation == "sdpa":
        w = replace(w, attn_implementation="eager")
    window = layer_type == "sliding_attention" and sh.sliding_window and w.row_len * w.sp >= sh.sliding_window
    return replace(w, masked=True) if window and w.attn_implementation == "sdpa" else w


def block_parts(sh: Shape, w: Workload, f: DtypeFlow, saves: BlockSaves, wa: Workload) -> tuple[dict, str, int]:
    """(bytes one decoder block saves, by part; the attention kernel; its bytes/element). `wa`: the workload as
    this layer's attention sees it (layer_workload)."""
    T, h, q, kv, i, H = w.tokens, sh.hidden, sh.q, sh.kv, sh.intermediate, sh.heads
    per = {"norms": (4 if saves.gemma else 2) * saves.norm(h, 1)}  # Gemma: before and after attention and MLP
    y = f.stream  # a norm's output: weight * xn.to(input dtype) (Gemma: .type_as(input)) -> the stream's dtype
    per["qkv_inputs"], _ = saves.linear_inputs(y, sh.readers("attn"))
    per["mlp_inputs"], _ = saves.linear_inputs(y, sh.readers("mlp"))
    q_src = f.lin_out
    if sh.model_type == "qwen3":
        # q_norm / k_norm: RMSNorm over head_dim of the q and k projections (modeling_qwen3.py)
        qn = F32 * T * (q + kv) + F32 * T * (H + sh.kv_heads) + (f.lin_out * T * (q + kv) if saves.full else 0)
        per["qk_norms"] = qn
        q_src = max(f.lin_out, f.norm_weight)
    if sh.model_type == "gemma3_text":  # Gemma's RMSNorm over head_dim, back in the projection's dtype
        per["qk_norms"] = saves.norm(q + kv, H + sh.kv_heads, weight=2 * sh.head_dim)
    qrot = max(q_src, f.stream)  # q * cos, cos in the stream's dtype (LlamaRotaryEmbedding: .to(x.dtype))
    attn_b = B16 if f.autocast else qrot  # SDPA is on autocast's lower-precision list
    kind = attention_kind(wa, attn_b)
    per["attention"], out_copy = attention_saved(sh, wa, attn_b, kind, (qrot, f.lin_out))  # k rotated like q
    if sh.fused:
        # phi3 (modeling_phi3.py Phi3Attention): q, k, v are views of qkv_proj's output. Rotary makes new q and k
        # (torch.cat), so a kernel given v itself keeps the whole fused output alive, its q and k columns too;
        # the kernel writes its output in q's (b, heads, s, d) layout, so transpose(1, 2).contiguous() copies it
        # and o_proj reads the copy (measured on CPU: tests/planning/test_activations.py)
        if attn_b == f.lin_out and not repeats_kv(sh, wa, kind):
            per["attention"] += f.lin_out * T * (q + kv)
        out_copy = True
    o_in, o_shared = saves.linear_inputs(attn_b, ["o_proj"])
    per["o_input"] = 0 if (o_shared and not out_copy) else o_in  # the kernel's own output when not copied
    g = f.lin_out
    per["mlp"] = 3 * g * T * i  # SiLU (Gemma: GELU) saves gate; the product saves act and up
    per["mlp"] += saves.linear_inputs(g, ["down_proj"])[0]
    if not saves.full:
        rb = B16 if f.autocast else f.adapter
        per["lora_A_out"] = len(saves.targets) * rb * T * w.lora_r  # saved by lora_B
    return per, kind, attn_b


def weight_casts(sh: Shape, w: Workload, p: Regime, targets: set) -> tuple[int, int, int]:
    """(per layer, layer 0, the head): the weight copies autocast makes and autograd saves."""
    h, full, lora = sh.hidden, w.method == "full", w.method != "full"
    cast_layer = cast_head = 0
    if p.autocast and full and p.param != B16:
        # autocast caches one bf16 copy of every fp32 weight a linear reads (leaf tensors that require
        # grad, aten/src/ATen/autocast_mode.cpp cached_cast), and autograd saves it for backward
        cast_layer, cast_head = B16 * sh.layer_linear_params, B16 * sh.vocab * h
    if p.autocast and lora:
        if p.param != B16:
            cast_layer = B16 * sh.lora_params(w.lora_r, w.lora_targets) // sh.layers
        if p.frozen != B16:  # a frozen fp32 head is cast at every call (not cached) and the copy saved
            cast_head = B16 * sh.vocab * h
    cast_first = cast_layer
    if p.autocast and lora and p.param != B16 and not w.gradient_checkpointing:
        # layer 0's q/k/v read a norm output that needs no grad: lora_A keeps no weight copy for it
        cast_first -= B16 * w.lora_r * h * len(targets & set(sh.readers("attn")))
    return cast_layer, cast_first, cast_head


def activations(sh: Shape, w: Workload, p: Regime, *, cpu: bool = False) -> dict:
    """Bytes autograd keeps at the end of the forward pass (the loss's own buffers excluded:
    loss_buffers), by component; plus what the backward phases need to know."""
    sh.check_block_mechanism()
    f = DtypeFlow(w, p)
    saves = BlockSaves(sh, w, f)
    T, h, lora, targets = w.tokens, sh.hidden, not saves.full, saves.targets
    types = sh.layer_types or ("full_attention",) * sh.layers
    by_type = {t: block_parts(sh, w, f, saves, layer_workload(sh, w, t)) for t in dict.fromkeys(types)}
    per, kind, attn_b = max(by_type.values(), key=lambda v: sum(v[0].values()))  # the largest layer's
    layers = [sum(by_type[t][0].values()) for t in types]
    # LoRA/QLoRA: layer 0's input norm sees no grad (a frozen embedding), unless checkpointing made
    # the embedding's output require grad (enable_input_require_grads)
    first = layers[0] - (saves.norm(h, 1) if lora and not w.gradient_checkpointing else 0)
    if lora and not w.gradient_checkpointing and w.lora_dropout > 0:  # no grad into q/k/v's dropout: no mask kept
        first -= T * h * len(targets & set(sh.readers("attn")))
    kept = sh.layers * f.stream * T * h  # non-reentrant checkpoint: each block's input
    blocks = kept if w.gradient_checkpointing else first + sum(layers[1:])
    # the final norm, and lm_head's input when it trains (under autocast a bf16 cast of it)
    y = f.stream
    head_in = ((B16 if f.autocast and y != B16 else y) * T * h) if saves.full else 0
    final = saves.norm(h, 1) + head_in
    # cos/sin follow position_ids: (1 or b, s, rotated dims); sequence-parallel batches carry position_ids.
    # Saved by the first layer that multiplies by them: Gemma 3 has one table for sliding layers, one for full
    pos_rows = w.rows if (w.layout != "padded" or w.sp > 1 or w.cp > 1) else 1
    table = 2 * pos_rows * w.row_len * (sh.rotary_dim or sh.head_dim) * f.stream
    tables = {t: types.index(t) for t in (dict.fromkeys(types) if sh.model_type == "gemma3_text" else types[:1])}
    rotary = table * len(tables)
    indices = INT64 * T  # the loss's shifted targets (ForCausalLMLoss: a contiguous copy, saved by nll_loss)
    # Gemma 2's logits soft-capping, tanh(logits / cap) * cap (Gemma2ForCausalLM.forward): tanh saves its output
    softcap = logits_bytes(w, p) * T * sh.vocab if sh.logit_softcap else 0
    cast_layer, cast_first, cast_head = weight_casts(sh, w, p, targets)
    casts = (sh.layers - 1) * cast_layer + cast_first + cast_head
    return {
        "per_layer": max(layers),
        "layers": [first, *layers[1:]] if not w.gradient_checkpointing else [f.stream * T * h] * sh.layers,
        "first_layer": first if not w.gradient_checkpointing else f.stream * T * h,
        "parts": per,
        "blocks": blocks,
        "final": final,
        "rotary": rotary,
        "rotary_layers": {k: table for k in tables.values()},
        "indices": indices,
        "logit_softcap": softcap,
        "weight_casts": casts,
        "weight_casts_layer": cast_layer,
        "weight_casts_first": cast_first,
        "weight_casts_head": cast_head,
        "kept_inputs": kept if w.gradient_checkpointing else 0,
        "forward_temporaries": forward_temporaries(sh, w, p, per, cpu=cpu),
        "attn_kind": kind,
        "layer_kinds": [by_type[t][1] for t in types],
        "attn_bytes": attn_b,
        "stream": f.stream,
        "lin_out": f.lin_out,
        "head_input": head_in,
        "total": blocks + final + rotary + indices + softcap + casts,
    }


def logits_bytes(w: Workload, p: Regime) -> int:
    """Bytes per element of the head's output: bf16 under autocast, else the head weight's dtype."""
    if p.autocast:
        return B16
    return p.param_compute if w.method == "full" else p.frozen_compute


def loss_buffers(sh: Shape, w: Workload, p: Regime, chunk: int) -> dict:
    """Live bytes of the loss at the end of the forward pass and when backward starts, per loss_impl (the table and its
    derivation: docs/planning.md "The loss"). Sources: transformers 5.23 loss/loss_utils.py ForCausalLMLoss (standard;
    _log_softmax_backward_data at backward start); finetune/modeling/loss.py ChunkedLinearCrossEntropy (chunked; checked
    on CPU: tests/planning/test_loss_memory.py); liger_kernel/ops/fused_linear_cross_entropy.py
    fused_linear_cross_entropy_forward (liger: grads made in the forward, logits overwritten in place)."""
    T, V, h = w.tokens, sh.vocab, sh.hidden
    lb = logits_bytes(w, p)
    head_trains = w.method == "full"
    head_w = p.param if head_trains else p.frozen
    if w.loss_impl == "standard":
        return {"forward": T * V * (lb + (F32 if lb != F32 else 0) + F32), "backward": 3 * F32 * T * V}
    a = DtypeFlow(w, p).stream
    if w.loss_impl == "chunked":
        c = min(chunk, T)
        cast = V * h * lb if head_w != lb else 0  # weight.to(compute dtype), in forward and again in backward
        saved = a * T * h + F32 * T  # hidden (instead of lm_head's saved input) + fp32 log-sum-exp
        # forward, per chunk: the logits made fp32 (the compute-dtype ones are freed as .float() returns)
        # and logsumexp's temporary (aten logsumexp: (x - max).exp_())
        fwd = saved + c * V * (F32 + F32) + cast
        grads = a * T * h + (F32 * V * h if head_trains else 0)  # grad_h, the fp32 grad_w accumulator
        # per chunk: recomputed logits made fp32 and their compute-dtype copy; at the end grad_w cast
        # to the weight's dtype beside the accumulator
        last = head_w * V * h if (head_trains and head_w != F32) else 0
        bwd = saved + grads + cast + max(c * V * (F32 + (lb if lb != F32 else 0)), last)
        return {"forward": fwd, "backward": bwd}
    if w.loss_impl == "liger":
        # liger_fused_linear_cross_entropy(h, weight.to(cd), ..., accum_dtype=fp32) computes grad_input and
        # an fp32 grad_weight in the forward, chunk by chunk (liger_kernel/ops/fused_linear_cross_entropy.py);
        # derived from its source, not measured (Triton kernels: no CPU)
        c = 1 << max(0, math.ceil(math.log2(max(1, -(-T // -(-V // h))))))
        cast = V * h * lb if head_w != lb else 0
        grads = a * T * h + (F32 * V * h if head_trains else 0)
        return {"forward": grads + cast + 2 * c * V * lb, "backward": grads}
    raise ValueError(f"training.loss_impl {w.loss_impl!r}: the planner knows standard, chunked, liger")
