"""The training loss of a causal LM without its full (tokens x vocab) logits: `training.loss_impl`
(docs/speed.md "Loss implementations": the memory it saves, and why installing it as two forward
replacements works under peft, DDP, DeepSpeed ZeRO-3 and FSDP2).

    info = install(model, "auto", label_smoothing=0.0, use_liger_kernel=False, device_type="cuda")
"""

from __future__ import annotations

import functools
import importlib.util
import types

import torch
import torch.nn.functional as F
from torch import nn

from finetune.errors import ConfigError, UserError

# the chunk size and what `auto` picks: pure arithmetic the planner reads too
from finetune.modeling.loss_choice import CHUNK_LOGITS_BYTES, MIN_CHUNK_TOKENS, auto_choice, chunk_tokens  # noqa: F401

IGNORE_INDEX = (
    -100
)  # finetune/data/render.py IGNORE_INDEX: the label that carries no loss (data sits beside modeling, not below it)
LOSS_IMPLS = ("auto", "standard", "chunked", "liger")
# The number of positions the loss scores in this micro-batch, counted on the host by the trainer
# (finetune/training/trainer.py): a forward keyword the installed loss takes out, so the compaction
# below needs no host sync. Without it the count is read from the device (nonzero: one sync).
SCORED_TOKENS_KWARG = "finetune_scored_tokens"


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else t.dtype


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b into an fp32 accumulator, without rounding a @ b to a 16-bit dtype first."""
    if acc.device.type == "cuda" and a.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)  # torch >= 2.8, CUDA
    else:
        acc.addmm_(a.float(), b.float())


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of cross_entropy(hidden @ weight.T + bias, targets), targets -100 ignored;
    hidden [N, H], weight [V, H], bias [V] or None, targets [N]. Returns an fp32 scalar."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk: int, compute_dtype: torch.dtype):
        n = hidden.shape[0]
        lse = torch.empty(n, device=hidden.device, dtype=torch.float32)
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        w = weight.to(compute_dtype)
        b = bias.to(compute_dtype) if bias is not None else None
        with torch.autocast(hidden.device.type, enabled=False):  # explicit dtypes, same in the backward
            for s in range(0, n, chunk):
                t = targets[s : s + chunk]
                logits = F.linear(hidden[s : s + chunk].to(compute_dtype), w, b).float()
                lse_c = torch.logsumexp(logits, dim=-1)
                lse[s : s + chunk] = lse_c
                target_logit = logits.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
                total += torch.where(t != IGNORE_INDEX, lse_c - target_logit, 0.0).sum()
                del logits
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk, ctx.compute_dtype = chunk, compute_dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        chunk, cd = ctx.chunk, ctx.compute_dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        w = weight.to(cd)
        b = bias.to(cd) if bias is not None else None
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros(bias.shape, device=bias.device, dtype=torch.float32) if need_b else None
        g = grad_total.float()
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], chunk):
                t = targets[s : s + chunk]
                h = hidden[s : s + chunk].to(cd)
                p = F.linear(h, w, b).float()
                p.sub_(lse[s : s + chunk].unsqueeze(1)).exp_()  # softmax
                p[torch.arange(t.shape[0], device=t.device), t.clamp(min=0)] -= 1.0  # softmax - one-hot
                p.mul_((g * (t != IGNORE_INDEX)).unsqueeze(1))  # d total / d logits
                pc = p.to(cd)
                if need_h:
                    grad_h[s : s + chunk] = (pc @ w).to(hidden.dtype)  # chunks are disjoint rows
                if need_w:
                    _addmm_fp32(grad_w, pc.t(), h)
                if need_b:
                    grad_b += p.sum(0)
                del p, pc
        return (
            grad_h,
            grad_w.to(weight.dtype) if need_w else None,
            grad_b.to(bias.dtype) if need_b else None,
            None,
            None,
            None,
        )


def _head_forward(
    self: nn.Linear, input: torch.Tensor, targets: torch.Tensor | None = None, scored_tokens: int | None = None
):
    """nn.Linear's forward; with targets: (sum of the token losses, number of scored tokens).
    `scored_tokens`: how many targets are not IGNORE_INDEX, when the caller knows it on the host."""
    if targets is None:
        return F.linear(input, self.weight, self.bias)
    h = input.reshape(-1, input.shape[-1])
    t = targets.reshape(-1).to(h.device)
    scored = t != IGNORE_INDEX
    count = scored.sum()
    if not torch.compiler.is_compiling():  # data-dependent shapes: skipped under torch.compile
        # Only scored positions go through the head, in order. With the count known on the host: a
        # stable sort puts them first (no sync; a wrong count stops the run on the device); else
        # nonzero(), which waits for the device to say how many there are.
        if scored_tokens is not None:
            torch._assert_async(count == scored_tokens, "finetune_scored_tokens differs from the labels' count")
            idx = torch.argsort((~scored).to(torch.int32), stable=True)[:scored_tokens]
        else:
            idx = scored.nonzero().squeeze(1)
        h, t = h.index_select(0, idx), t.index_select(0, idx)
    cd = _compute_dtype(h)
    if self.finetune_loss_kernel == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        bias = self.bias.to(cd) if self.bias is not None else None
        total = liger_fused_linear_cross_entropy(
            h.to(cd), self.weight.to(cd), t, bias, reduction="sum", accum_dtype=torch.float32
        ).float()
    else:
        total = ChunkedLinearCrossEntropy.apply(h, self.weight, self.bias, t, self.finetune_chunk_tokens, cd)
    return total, count


def _make_forward(cls_forward):
    @functools.wraps(cls_forward)  # keeps the signature: generate() and Trainer inspect it
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        shift_labels = kwargs.pop("shift_labels", None)
        scored_tokens = kwargs.pop(SCORED_TOKENS_KWARG, None)  # counts labels[..., 1:] (not shift_labels)
        if shift_labels is not None:
            scored_tokens = None
        inputs = dict(  # what the backbone gets as given
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        if past_key_values is not None:  # passed on only when given: transformers 5.24 deprecates the name
            kwargs["past_key_values"] = past_key_values  # (a FutureWarning per call, even for None)
        if (labels is None and shift_labels is None) or logits_to_keep not in (0, None):
            if shift_labels is not None:
                kwargs["shift_labels"] = shift_labels
            return type(self).forward(self, **inputs, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        num_items = kwargs.pop("num_items_in_batch", None)
        return_dict = kwargs.pop("return_dict", None)
        out = getattr(self, self.base_model_prefix)(**inputs, **kwargs)
        if shift_labels is None:  # as transformers' ForCausalLMLoss: position t is scored against label t + 1
            shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        total, count = self.get_output_embeddings()(
            out.last_hidden_state, targets=shift_labels, scored_tokens=scored_tokens
        )
        if num_items is not None:  # gradient accumulation: Trainer's count over the whole step
            loss = total / (num_items.to(total.device) if torch.is_tensor(num_items) else num_items)
        else:
            loss = total / count  # mean over scored tokens (0/0 = nan, as the standard loss)
        # the key/value cache under its current name (`cache`; `past_key_values` before transformers 5.23
        # and deprecated since: reading it warns)
        cache_key = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
        result = CausalLMOutputWithPast(
            loss=loss,
            logits=None,
            hidden_states=out.hidden_states,
            attentions=out.attentions,
            **{cache_key: out.get(cache_key)},
        )
        return result.to_tuple() if return_dict is False else result

    return forward


def check_supported(model) -> list[str]:
    """Why the chunked loss cannot stand in for this model's own ([] = it can)."""
    problems = []
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        problems.append(
            f"the output head is {type(head).__name__}, not torch.nn.Linear (LoRA or quantization on the head?)"
        )
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for key in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier", "lm_head_multiplier"):
        if getattr(cfg, key, None) not in (None, 1, 1.0):
            problems.append(f"config.{key}={getattr(cfg, key)!r} transforms the logits")
    if getattr(cfg, "output_router_logits", False):
        problems.append("config.output_router_logits: the model's own forward adds a router loss")
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        problems.append("config.pretraining_tp > 1 splits the head")
    prefix = getattr(model, "base_model_prefix", "")
    if not prefix or not hasattr(model, prefix):
        problems.append(f"no backbone attribute {prefix!r} (the model's base_model_prefix)")
    return problems


def causal_lm(model):
    """The transformers causal LM inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def resolve(
    requested: str,
    model,
    *,
    label_smoothing: float = 0.0,
    use_liger_kernel: bool = False,
    device_type: str = "cpu",
    tokens: int | None = None,
    chunk: int | None = None,
    tensor_parallel: int = 1,
) -> tuple[str, str | None]:
    """(the implementation to install, why `auto` fell back to standard or None). Explicit choices that cannot be
    honoured raise: ConfigError for the model/options, UserError for the machine. `auto` = chunked; liger when
    training.use_liger_kernel chose Liger; standard (with the reason) where the chunked loss cannot stand in, or where
    it would hold more memory than the standard loss for micro-batches of `tokens` tokens (loss_choice.auto_choice: a
    trainable head's fp32 weight-gradient accumulator against the logits; `tokens` None: not weighed, chunked)."""
    if requested not in LOSS_IMPLS:
        raise ConfigError([f"training.loss_impl: got {requested!r}; allowed: {', '.join(LOSS_IMPLS)}"])
    if requested == "standard":
        return "standard", None
    why = check_supported(causal_lm(model))
    if label_smoothing:  # Trainer then takes the labels out of the batch and needs the logits
        why.append(f"training.label_smoothing_factor {label_smoothing} needs the full logits")
    if tensor_parallel > 1:  # DeepSpeed builds its engine after the loss is installed
        why.append(
            f"parallel.tp_size {tensor_parallel}: AutoTP replaces the output head with its own split layer, "
            f"which the chunked loss cannot drive"
        )
    if requested == "auto":
        if why:
            return "standard", "; ".join(why)
        if use_liger_kernel:
            requested = "liger"
        else:
            head = causal_lm(model).get_output_embeddings()
            if tokens is not None:
                choice, why_choice = auto_choice(
                    tokens=tokens,
                    vocab=head.out_features,
                    hidden=head.in_features,
                    head_trains=head.weight.requires_grad,
                    chunk=chunk,
                )
                if choice == "standard":
                    return "standard", why_choice
            requested = "chunked"
    elif why:
        raise ConfigError([f"training.loss_impl: {requested} cannot replace this model's loss: {w}" for w in why])
    if requested == "liger":
        if importlib.util.find_spec("liger_kernel") is None:
            raise UserError(
                "training.loss_impl: liger needs the liger-kernel package, which is not installed; "
                "pip install 'finetune[liger]', or use loss_impl: chunked"
            )
        if device_type != "cuda":
            raise UserError(
                "training.loss_impl: liger runs Triton GPU kernels and needs a CUDA device; this run "
                "has none (use loss_impl: chunked)"
            )
    return requested, None


def install(model, requested: str = "auto", **options) -> dict:
    """Install the loss on the loaded (possibly LoRA-wrapped) model, before Trainer wraps it; `options` are resolve()'s
    (`chunk` also sets the chunk size). Returns run.json `speed.loss_impl`."""
    resolved, reason = resolve(requested, model, **options)
    chunk = options.get("chunk")
    lm = causal_lm(model)
    head = lm.get_output_embeddings()
    info = {
        "requested": requested,
        "resolved": resolved,
        "reason": reason,
        "chunk_tokens": None,
        "compact": False,
        "logits_materialised": resolved == "standard",
    }
    if resolved != "standard":
        if chunk is not None and chunk < 1:
            raise ConfigError([f"training.loss_chunk_tokens: must be >= 1 or null, got {chunk}"])
        head.finetune_chunk_tokens = chunk or chunk_tokens(head.out_features)
        head.finetune_loss_kernel = resolved
        head.forward = types.MethodType(_head_forward, head)
        lm.forward = types.MethodType(_make_forward(type(lm).forward), lm)
        info.update(chunk_tokens=head.finetune_chunk_tokens if resolved == "chunked" else None, compact=True)
    lm.finetune_loss = info
    return info


def installed(model) -> dict | None:
    """What install() put on this model (None: nothing was installed)."""
    return getattr(causal_lm(model), "finetune_loss", None)
