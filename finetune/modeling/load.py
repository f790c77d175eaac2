"""The model in and out: loading (hub id, local directory or the bundled default; full, LoRA or
QLoRA), a ZeRO-3-partitioned model outside the engine, and the final export. The precision policy
(finetune/precision.py, docs/precision.md) decides every dtype here.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from finetune.config.sections import BUNDLED_MODEL, MethodConfig, ModelConfig
from finetune.errors import UserError
from finetune.precision import Policy, dtype_name, torch_dtype
from finetune.storage import json_object

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
# torch is imported where it is used: `finetune train` reads model folders here before it launches, and a command
# that does not train imports no torch (docs/speed.md "Start-up")


def resolve_model_path(name_or_path: str) -> str:
    """The bundled model -> its converted cache dir (converted on first use); else unchanged."""
    if name_or_path == BUNDLED_MODEL:
        from finetune.modeling.bundled import ensure_bundled_model

        return str(ensure_bundled_model())
    if name_or_path.startswith("bundled:"):
        raise UserError(
            f"model.name_or_path: unknown bundled model {name_or_path!r}; the bundled model is {BUNDLED_MODEL!r}"
        )
    return name_or_path


def model_folder(name: str, revision: str | None = None) -> Path | None:
    """The directory holding a model's files on this machine: the bundled model's (once converted), a local directory,
    or a hub id's cached snapshot; None when they are not here."""
    if name == BUNDLED_MODEL:
        from finetune.modeling import bundled

        return bundled.model_dir() if bundled.is_prepared() else None
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if name.count("/") != 1 or name.startswith(("/", ".", "~")):
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(name, "config.json", revision=revision)
    except ValueError:
        return None
    return Path(cached).parent if isinstance(cached, str) else None


def hub_id(name: str) -> bool:
    """model.name_or_path names a hub model (its files in the Hugging Face cache), not a folder or the bundled one."""
    return name != BUNDLED_MODEL and name.count("/") == 1 and not Path(name).expanduser().exists()


def hub_cache() -> str:
    """Where a hub model's files are looked for, in words: the Hugging Face cache's folder, what sets it, and
    HF_HUB_OFFLINE when set."""
    from huggingface_hub import constants

    offline = ", HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else ""
    return f"the Hugging Face cache {constants.HF_HUB_CACHE} (HF_HUB_CACHE, else HF_HOME/hub){offline}"


def model_type(cfg: ModelConfig) -> str | None:
    """config.json's model_type of model.name_or_path, read from this machine (None: not here, or not said)."""
    folder = model_folder(cfg.name_or_path, cfg.revision)
    value = json_object(folder / "config.json").get("model_type") if folder else None
    return value if isinstance(value, str) else None


def resolve_dtype(name: str) -> torch.dtype:
    """model.dtype where no precision policy applies (the benchmark's workers): 'auto' = bfloat16
    where the accelerator supports it, else float32. Training runs load in the policy's dtype."""
    import torch

    if name != "auto":
        return torch_dtype(name)
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def load_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer

    path = resolve_model_path(cfg.tokenizer_name_or_path or cfg.name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(_load_problem("tokenizer", path, e)) from None
    if tok.pad_token is None:
        # Padding positions are masked out of the loss and attention, so any token will do.
        tok.pad_token = tok.eos_token
    return tok


def load_model(
    cfg: ModelConfig,
    method: MethodConfig,
    *,
    gradient_checkpointing: bool = False,
    policy: Policy | None = None,
    deepspeed: bool = False,
):
    """The model ready to train: full (all weights trainable), LoRA or QLoRA (peft).

    `policy` (finetune/precision.py) sets the dtypes; `deepspeed` says DeepSpeed will wrap the model,
    which keeps its own fp32 master and casts the module itself, so nothing is upcast here. Without a
    policy (the benchmark's workers) the model loads in model.dtype and nothing is cast."""
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.modeling import attention

    path = resolve_model_path(cfg.name_or_path)
    dtype = torch_dtype(policy.load_dtype(method.name)) if policy else resolve_dtype(cfg.dtype)
    kwargs = dict(
        revision=cfg.revision,
        trust_remote_code=cfg.trust_remote_code,
        attn_implementation=attention.for_family(model_type(cfg), cfg.attn_implementation)[0],
        dtype=dtype,
    )
    if method.name == "qlora":
        compute = torch_dtype(policy.compute_dtype) if policy else dtype
        kwargs["quantization_config"] = quantization_config(method, compute)
        from finetune.held_back import CPU_4BIT_NOTICE

        if not torch.cuda.is_available() and CPU_4BIT_NOTICE.held:  # 4-bit matmuls on CPU: it applies here
            log.warning("QLoRA on CPU: %s", CPU_4BIT_NOTICE.held[0])
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as e:
        raise UserError(_load_problem("model", path, e)) from None
    model.config.use_cache = False  # the KV cache is for generation; it only costs memory in training
    if method.name == "qlora":
        differentiable_4bit(model)
    if method.name == "full":
        if policy is not None and not deepspeed:
            # bf16-mixed: the checkpoint is loaded in bf16, as DeepSpeed's master starts from its bf16
            # module, so every strategy starts from the same weights (measured: an fp32 start
            # moved ZeRO's losses 1.8e-4 from DDP's); the fp32 copies below are the master weights.
            master = torch_dtype(policy.master_dtype)
            for p in model.parameters():  # in place: the optimizer is built later
                if p.requires_grad and p.is_floating_point() and p.dtype != master:
                    p.data = p.data.to(master)
        if gradient_checkpointing:
            # transformers 5.23 renamed gradient_checkpointing_enable (deprecated, removed in v6).
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return model
    # Adapters: fp32 (peft's autocast_adapter_dtype upcasts 16-bit ones) where the strategy keeps no
    # master of its own; under DeepSpeed they stay in the base dtype and DeepSpeed's fp32 partitions
    # are the master (ZeRO-3 would otherwise leave them fp32 in the module and compute them in fp32).
    adapters_fp32 = policy is None or (policy.adapters_fp32 and not deepspeed)
    model = add_lora(model, method, gradient_checkpointing=gradient_checkpointing, adapters_fp32=adapters_fp32)
    if policy is not None and method.name == "qlora" and not policy.adapters_fp32 and not deepspeed:
        # bf16-true: prepare_model_for_kbit_training made the unquantized frozen weights fp32
        # (peft/utils/other.py); the policy holds the frozen base in the compute dtype.
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point() and p.__class__.__name__ != "Params4bit":
                p.data = p.data.to(torch_dtype(policy.frozen_dtype))
    return model


def quantization_config(method: MethodConfig, dtype: torch.dtype):
    from transformers import BitsAndBytesConfig

    compute = dtype if method.compute_dtype == "auto" else torch_dtype(method.compute_dtype)
    # A float storage dtype equal to the compute dtype lets FSDP and ZeRO-3 shard the packed
    # 4-bit weights together with the rest (they only flatten tensors of one float dtype).
    storage = compute if method.quant_storage == "auto" else torch_dtype(method.quant_storage)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=method.quant_type,
        bnb_4bit_use_double_quant=method.double_quant,
        bnb_4bit_compute_dtype=compute,
        bnb_4bit_quant_storage=storage,
    )


def differentiable_4bit(model):
    """Every bitsandbytes 4-bit layer of `model` kept on the one computation QLoRA trains with: the weights dequantized
    to the compute dtype, then the matmul. bitsandbytes 0.50 (nn/modules.py Linear4bit.forward) otherwise repacks a
    layer's weights in place for its AVX512-BF16 CPU kernel at the layer's first forward in eval mode without gradients
    (the exact match before training, an evaluation, the export check's forward), and every later forward of that layer,
    in training too, goes through that kernel (functional.py gemv_4bit): bf16 arithmetic, and no autograd, so the
    layers below it got no gradient through it (measured on the tiny model: step 1's grad norm 0.49 instead of 1.25)
    and the saved model computed other figures than the live one. Returns `model`."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def add_lora(model, method: MethodConfig, *, gradient_checkpointing: bool, adapters_fp32: bool = True):
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if method.name == "qlora":
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    elif gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()  # frozen embeddings: checkpointed blocks need a grad input
    if isinstance(method.target_modules, list):
        # peft only complains when *no* name matches; a typo next to a valid name would silently
        # leave that layer without an adapter.
        names = [name for name, _ in model.named_modules()]
        unmatched = [t for t in method.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
        if unmatched:
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
            raise UserError(
                f"method.target_modules: no module of the model is named "
                f"{', '.join(map(repr, unmatched))}; its linear layers are {', '.join(linear)} "
                f"(or use 'all-linear')"
            )
    lora = LoraConfig(
        r=method.lora_r,
        lora_alpha=method.lora_alpha,
        lora_dropout=method.lora_dropout,
        target_modules=method.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, lora, autocast_adapter_dtype=adapters_fp32)
    except ValueError as e:
        raise UserError(f"method.target_modules: {e}") from None


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameters; 4-bit packed weights counted as their logical size, and
    ZeRO-3-partitioned ones at their full size: under zero3_init_flag from_pretrained loads each
    weight straight into its shard and leaves an empty placeholder (numel 0) whose full element
    count DeepSpeed keeps in `ds_numel` (deepspeed/runtime/zero/partition_parameters.py)."""
    trainable = total = 0
    for p in model.parameters():
        n = getattr(p, "ds_numel", None) or p.numel()
        if p.__class__.__name__ == "Params4bit":
            n = n * 2 * p.element_size()  # two 4-bit values per byte of storage
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total


def parameters_section(model) -> dict:
    """run.json `parameters`: count_parameters' figures."""
    trainable, total = count_parameters(model)
    return {"trainable": trainable, "total": total}


def code_problem(folder: Path, trust: bool) -> str | None:
    """The folder's config.json or tokenizer_config.json asks for Python code of its own (auto_map)
    that transformers has no class in place of, and model.trust_remote_code is not true: loading
    would have to run it. (A known model_type loads transformers' own class; nothing runs then.)"""
    if trust:
        return None
    files = {name: json_object(folder / name) for name in ("config.json", "tokenizer_config.json")}
    model_type = files["config.json"].get("model_type")
    needed = []
    for name, values in files.items():
        auto_map = values.get("auto_map")
        if isinstance(auto_map, list):  # the old form of a tokenizer's: [slow, fast]
            auto_map = {"AutoTokenizer": auto_map}
        for auto, ref in auto_map.items() if isinstance(auto_map, dict) else ():
            if auto in ("AutoConfig", "AutoModelForCausalLM", "AutoTokenizer") and not _has_class(
                auto, model_type, values.get("tokenizer_class")
            ):
                refs = [r for r in (ref if isinstance(ref, list) else [ref]) if isinstance(r, str)]
                needed += [(folder / name, auto, r) for r in refs]
    if not needed:
        return None
    code = "; ".join(
        f"{auto} -> {ref} ({folder / (ref.split('--')[-1].rsplit('.', 1)[0] + '.py')})" for _, auto, ref in needed
    )
    return (
        f"{needed[0][0]}: its auto_map asks for the folder's own Python code ({code}), which loading it would run "
        f"(transformers has no class of its own for model_type {model_type!r})"
    )


def _has_class(auto: str, model_type, tokenizer_class) -> bool:
    """Whether transformers loads `auto` for these files with a class of its own (its Auto* logic)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    if auto == "AutoConfig":
        return model_type in CONFIG_MAPPING_NAMES
    if auto == "AutoModelForCausalLM":
        return model_type in CAUSAL
    if model_type in TOKENIZER_MAPPING_NAMES:
        return True
    return isinstance(tokenizer_class, str) and any(
        tokenizer_class_from_name(n) is not None for n in (tokenizer_class, tokenizer_class.removesuffix("Fast"))
    )


def _load_problem(what: str, path: str, err: Exception) -> str:
    if not Path(path).exists():
        hint = "no such local directory, and hub ids need network access"
    elif not (Path(path) / "config.json").is_file():
        hint = "the directory exists but is not a transformers model directory: it has no config.json"
    else:
        hint = "transformers refused its files"
    return f"model.name_or_path: cannot load the {what} from {path!r} ({hint}): {err}"


# ---- A ZeRO-3-partitioned model outside the DeepSpeed engine. With `zero3_init_flag: true`,
# `from_pretrained` loads every weight straight into its shard, so until Trainer builds the engine
# (whose hooks gather each layer's parameters for its forward) the parameters are empty placeholders
# and generate() fails ("Padding_idx must be within num_embeddings").


@contextlib.contextmanager
def full_parameters(model):
    """Inside: every parameter of a ZeRO-3-partitioned, not yet wrapped model is whole (the exact-match evaluation
    before training). Gathered read-only (modifier_rank=None) on every rank: the full model's memory on each rank for a
    moment. A no-op for other strategies, which shard only when Trainer wraps the model."""
    partitioned = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not partitioned:
        yield model
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield model


def check_init_dtype(model, requested) -> None:
    """Refuse a model that ZeRO-3's `zero.Init` created in another dtype than it was loaded in: zero.Init
    creates every float parameter in the DeepSpeed config's dtype whatever `dtype=` asked
    (deepspeed runtime/zero/partition_parameters.py Init._set_dtype), so a bf16 model under a config
    left at bf16 false silently trains in fp32 (docs/speed.md "DeepSpeed ZeRO-3 settings": 7x slower)."""
    import torch

    got = {
        p.ds_tensor.dtype
        for p in model.parameters()
        if hasattr(p, "ds_tensor") and p.ds_tensor.dtype.is_floating_point and type(p).__name__ != "Params4bit"
    }
    wrong = sorted(dtype_name(d) for d in got if d != requested)
    if wrong and requested in (torch.bfloat16, torch.float16, torch.float32):
        want = dtype_name(requested)
        raise UserError(
            f"ZeRO-3 created the model's parameters in {', '.join(wrong)}, not the {want} it was loaded in "
            f"(model.dtype): zero.Init (accelerate's zero3_init_flag) takes the dtype from the DeepSpeed config, "
            f"whose bf16.enabled/fp16.enabled the precision policy fills (training.precision, docs/precision.md). "
            f'Training would run in {wrong[0]}. Check that the DeepSpeed config leaves bf16/fp16 "enabled" '
            f'to "auto" (or matches the policy), or load the model in {wrong[0]} on purpose (model.dtype: {wrong[0]})'
        )


# ---- The final export (`runs/<name>/model/`): a LoRA adapter or one consolidated model that loads in
# a single plain process, under every strategy. `Trainer.save_model` (transformers 5.23) writes
# nothing for FSDP with SHARDED_STATE_DICT, which FSDP2 checkpoints should use, so the export gathers
# a full state dict instead: Accelerate's `get_state_dict` on FSDP2 is `get_model_state_dict(
# full_state_dict=True, cpu_offload=True)`, a collective every rank joins. ZeRO-3 gathers 16-bit
# weights inside `save_model` (stage3_gather_16bit_weights_on_model_save in ds_configs/zero3*.json).
# The export is then checked for weights, so a strategy that silently saves nothing fails the run.
WEIGHT_FILES = tuple(
    "adapter_model.safetensors model.safetensors model.safetensors.index.json adapter_model.bin pytorch_model.bin".split()
)


def save_final_model(trainer, model_dir: str | Path) -> None:
    """Save the trained model on every rank's behalf (call on all ranks)."""
    model_dir = str(model_dir)
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None) if trainer.is_fsdp_enabled else None
    if plugin is not None and "FULL_STATE_DICT" not in str(plugin.state_dict_type):
        state_dict = trainer.accelerator.get_state_dict(trainer.model)  # collective: full, on CPU
        if trainer.args.should_save:
            trainer._save(model_dir, state_dict=state_dict)
        trainer.accelerator.wait_for_everyone()
    else:
        trainer.save_model(model_dir)
    if trainer.args.should_save and not any((Path(model_dir) / f).is_file() for f in WEIGHT_FILES):
        raise RuntimeError(
            f"the export in {model_dir} holds no weights (looked for {', '.join(WEIGHT_FILES)}); "
            f"strategy {trainer.accelerator.distributed_type.value} saved nothing"
        )
