"""The model's own files, read before any weights load: is it a causal LM, are its weight files whole, and would loading
it run anything (the folder's own Python code without model.trust_remote_code, a pickle that names code)? And, once the
tokenizer and the data exist, does the model's embedding cover every token id the run will feed it?

    model_problems(cfg)                          # preflight: config.json and the weight files' headers
    check_vocabulary(model_cfg, tokenizer, bundle)   # the data phase, before the model loads

Only files on this machine are read (a local directory, or a hub id's cached snapshot).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from finetune.errors import UserError
from finetune.storage import read_json

# What from_pretrained reads, in its order of preference: the index (shards) or the single file.
_WEIGHTS = (
    ("model.safetensors.index.json", "safetensors"),
    ("model.safetensors", "safetensors"),
    ("pytorch_model.bin.index.json", "bin"),
    ("pytorch_model.bin", "bin"),
)
TRUST = (
    "finetune runs no code from a model folder unless told to: if you trust its author, set "
    "model.trust_remote_code: true (--model.trust_remote_code=true); otherwise use a model of an architecture "
    "transformers has"
)
_REFETCH = "copy or download the model again (a hub model: `hf download <id>`), or re-save it with save_pretrained"


def model_problems(cfg) -> list[str]:
    """model.name_or_path's config.json (a causal LM?) and weight files (whole?); [] when it is not on
    this machine (finetune/preflight/checks.py model_source says why)."""
    from finetune.config.sections import BUNDLED_MODEL
    from finetune.modeling.load import code_problem, model_folder
    from finetune.storage import json_object

    model = cfg.model
    tokenizer = model.tokenizer_name_or_path
    problems = []
    if tokenizer and tokenizer != model.name_or_path and tokenizer != BUNDLED_MODEL:
        folder = model_folder(tokenizer, model.revision)
        why = folder and code_problem(folder, model.trust_remote_code)
        problems += [f"model.tokenizer_name_or_path: {why}; {TRUST}"] if why else []
        problems += [f"model.tokenizer_name_or_path: {p}" for p in own_files_problems(folder)] if folder else []
        problems += [f"model.tokenizer_name_or_path: {p}" for p in [tokenizer_files_problem(tokenizer)] if p]
    elif model.name_or_path != BUNDLED_MODEL and (why := tokenizer_files_problem(model.name_or_path, weights=True)):
        problems.append(f"model.name_or_path: {why}")
    if model.name_or_path == BUNDLED_MODEL:
        from finetune.modeling import bundled

        folder = bundled.model_dir() if bundled.is_prepared() else None
        values = (json_object(folder / "config.json") or None) if folder else None
        return problems + [p for p in [positions_problem(cfg, values, "the bundled model")] if p]
    folder = model_folder(model.name_or_path, model.revision)
    config = folder / "config.json" if folder else None
    if config is None or not config.is_file():
        return problems
    try:
        values = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return [*problems, f"model.name_or_path: {config}: not a readable JSON file ({e}); {_REFETCH}"]
    found = [positions_problem(cfg, values, str(config))] if isinstance(values, dict) else []
    problems += [p for p in found if p]
    code = code_problem(folder, model.trust_remote_code)
    found = [f"{code}; {TRUST}" if code else None]
    found += [causal_lm_problem(values, config)] if isinstance(values, dict) else []
    found.append(weights_problem(folder))
    found += own_files_problems(folder)
    return problems + [f"model.name_or_path: {p}" for p in found if p]


# The folder's own JSON files transformers reads beside config.json. A broken generation_config.json is ignored by
# from_pretrained without a word (generation then runs with the model config's defaults, other stop tokens); a broken
# tokenizer_config.json fails the load with a JSONDecodeError that does not name the file.
_OWN_FILES = (
    *("generation_config.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.json"),
    *("added_tokens.json", "chat_template.json"),
)
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def own_files_problems(folder: Path) -> list[str]:
    """Each of the folder's own JSON files that does not read as the object transformers expects, named."""
    out = []
    for name in _OWN_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            values, why = read_json(path)
        except OSError as e:
            values, why = None, f"cannot be read ({e.strerror or e})"
        if why:
            out.append(f"{path}: {why}; {_REFETCH}")
        elif not isinstance(values, dict):
            out.append(f"{path}: a JSON {type(values).__name__}, where transformers reads an object; {_REFETCH}")
        elif name == "generation_config.json":
            out += [f"{path}: {p}" for p in _generation_problems(values)]
    return out


# What AutoTokenizer reads a tokenizer from: its fast file, its config, or a vocabulary (sentencepiece, BPE, WordPiece,
# tiktoken, Mistral's tekken); a folder with none of them has no tokenizer.
_TOKENIZER_FILES = ("tokenizer*", "vocab*", "merges.txt", "*.model", "*.tiktoken", "tekken.json")


def tokenizer_files_problem(name: str, *, weights: bool = False) -> str | None:
    """A local folder that holds no tokenizer file (with `weights`: one that holds a model's weights, a model saved
    without its tokenizer), named before launch; transformers fails inside the run, speaking of sentencepiece."""
    folder = Path(name).expanduser()
    if not folder.is_dir() or any(next(folder.glob(g), None) for g in _TOKENIZER_FILES):
        return None
    if weights and not any((folder / f).is_file() for f, _ in _WEIGHTS):
        return None
    return (
        f"{folder}: no tokenizer file (tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json, ...): "
        "the model was saved without its tokenizer; save it beside the model (tokenizer.save_pretrained(FOLDER)) or "
        "set model.tokenizer_name_or_path to the folder or hub id of the tokenizer it was trained with"
    )


def _generation_problems(values: dict) -> list[str]:
    """generation_config.json's token ids and the values transformers' own validation refuses."""
    import warnings

    from transformers import GenerationConfig

    def token_id(key, v) -> bool:
        ok = isinstance(v, int) and not isinstance(v, bool) and v >= 0
        return ok or (key == "eos_token_id" and isinstance(v, list) and all(token_id(key, x) for x in v) and bool(v))

    bad = [
        f"{k} {values[k]!r} is not a token id (an integer >= 0; eos_token_id may be a list of them)"
        for k in _TOKEN_IDS
        if values.get(k) is not None and not token_id(k, values[k])
    ]
    try:
        with warnings.catch_warnings():  # its minor remarks are warnings: not ours to repeat
            warnings.simplefilter("ignore")
            GenerationConfig.from_dict(dict(values)).validate()
    except (ValueError, TypeError) as e:
        bad.append(f"transformers refuses its values ({e})")
    return bad


def positions_problem(cfg, values: dict | None, source: str) -> str | None:
    """data.max_length above the model's positions (config.json max_position_embeddings, or its
    text_config's): positions past them have no trained embedding (or RoPE scaling), so refuse."""
    if not values:
        return None
    positions = (values.get("text_config") or {}).get("max_position_embeddings") or values.get(
        "max_position_embeddings"
    )
    if not isinstance(positions, int) or cfg.data.max_length <= positions:
        return None
    return (
        f"data.max_length: {cfg.data.max_length} is more than the {positions} positions the model has ({source} "
        f"max_position_embeddings); set data.max_length to {positions} or less, or use a model with a longer context"
    )


def causal_lm_problem(config: dict, source: Path) -> str | None:
    """Why config.json's model cannot be fine-tuned as a causal LM, or None. Accepted: what transformers'
    MODEL_FOR_CAUSAL_LM_MAPPING loads as a decoder (or the model's own AutoModelForCausalLM code)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    if "AutoModelForCausalLM" in (config.get("auto_map") or {}):
        return None  # its own code (model.trust_remote_code)
    model_type, archs = config.get("model_type"), config.get("architectures") or []
    accepted = (
        f"accepted: decoder-only models with a causal-LM class in transformers (MODEL_FOR_CAUSAL_LM_MAPPING: "
        f"llama, mistral, qwen2, gemma, phi3, gpt2 and {len(CAUSAL) - 6} more)"
    )
    what = f"{source}: model_type {model_type!r}" + (f" ({', '.join(archs)})" if archs else "")
    if not isinstance(model_type, str):  # transformers picks the architecture by it
        types = [t for t, cls in CAUSAL.items() if cls in archs]  # llama first for LlamaForCausalLM, then aliases
        types.sort(key=lambda t: not archs[0].lower().startswith(t.replace("_", "")))
        fix = f'add "model_type": "{types[0]}" (the type of {archs[0]})' if types else "add the model's model_type"
        return f"{source}: has no model_type, which transformers needs to choose the architecture; {fix}, or {_REFETCH}"
    if model_type not in CAUSAL:
        return f"{what} has no causal-LM class in transformers, so it cannot be fine-tuned here; {accepted}"
    config_class = CONFIG_MAPPING[model_type]
    if config.get("is_encoder_decoder", getattr(config_class, "is_encoder_decoder", False)):
        return (
            f"{what} is an encoder-decoder (seq2seq) model: as a causal LM its decoder would train alone, without "
            f"the encoder it was trained with; {accepted}"
        )
    causal_classes = set(CAUSAL.values())
    if config.get("is_decoder", getattr(config_class, "is_decoder", True)) is False and not (
        set(archs) & causal_classes
    ):
        return (
            f"{what} is an encoder (is_decoder: false): its attention sees every position, the answer included, "
            f"so trained as a causal LM it would learn to copy, not to predict; {accepted}"
        )
    return None


def weights_problem(folder: Path) -> str | None:
    """The first weight file from_pretrained would read that is not whole, named with what is wrong."""
    for name, kind in _WEIGHTS:
        path = folder / name
        if not path.is_file():
            continue
        if not name.endswith(".index.json"):
            return _file_problem(path, kind)
        try:
            shards = sorted(set(json.loads(path.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return f"{path}: not a readable shard index ({type(e).__name__}: {e}); {_REFETCH}"
        for shard in shards:
            if not (folder / shard).is_file():
                return f"{folder / shard}: missing (listed in {name}); {_REFETCH}"
            why = _file_problem(folder / shard, kind)
            if why:
                return why
        return None
    return None  # no weight file of these: from_pretrained names what it looked for


def _file_problem(path: Path, kind: str) -> str | None:
    size = path.stat().st_size
    if kind == "bin":
        try:  # a zip archive (torch.save since 1.6): its directory is at the end, so a cut file has none
            zipfile.ZipFile(path).close()
        except zipfile.BadZipFile:
            with open(path, "rb") as f:
                if f.read(2) == b"PK":
                    return f"{path}: {size} bytes and no zip directory at its end: cut short (truncated); {_REFETCH}"
        return pickle_problem(path)
    with open(path, "rb") as f:
        head = f.read(8)
        declared = int.from_bytes(head, "little") if len(head) == 8 else -1
        if declared < 0 or declared > size - 8:
            return f"{path}: {size} bytes, too short for the safetensors header it starts with (truncated); {_REFETCH}"
        try:
            header = json.loads(f.read(declared))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return f"{path}: the safetensors header does not parse (a damaged or foreign file); {_REFETCH}"
    expected = 8 + declared + end
    if size != expected:
        cut = "cut short (truncated)" if size < expected else "longer than its header says (damaged)"
        return f"{path}: {size:,} bytes, but its header describes {expected:,}: {cut}; {_REFETCH}"
    return None


def pickle_problem(path: Path) -> str | None:
    """A pickled weight file (pytorch_model.bin) that names code (functions, classes) outside torch's
    weights-only allowlist: transformers' weights-only load refuses it, and loading it any other way
    would import and call them. Read without unpickling (the opcodes, as torch's own check does)."""
    import pickletools

    import torch
    from torch import _weights_only_unpickler as weights_only

    if zipfile.is_zipfile(path):
        try:
            unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
        except (ValueError, RuntimeError, KeyError):
            return None  # no torch.save archive: the loader names it
    else:  # the legacy format: pickles of the magic number, protocol, system info, then the object
        found: set[str] = set()
        with open(path, "rb") as f:
            for _ in range(4):
                strings: list[str] = []
                try:
                    for op, arg, _pos in pickletools.genops(f):
                        if op.name == "GLOBAL":
                            found.add(arg.replace(" ", "."))
                        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                            found.add(f"{strings[-2]}.{strings[-1]}")
                        elif isinstance(arg, str):
                            strings.append(arg)
                except ValueError:  # no further pickle (the storages follow the object)
                    break
        allowed = set(weights_only._get_allowed_globals()) | set(weights_only._get_user_allowed_globals())
        unsafe = found - allowed
    if not unsafe:
        return None
    return (
        f"{path}: a pickle that names code outside torch's weights-only allowlist ({', '.join(sorted(unsafe))}); "
        f"loading it would import and call that, so weights-only loading refuses it and finetune does not unpickle "
        f"it. Use a copy of the model in safetensors (model.safetensors), or convert this file where you trust "
        f"it: torch.load(..., weights_only=False), then safetensors.torch.save_file(state_dict, 'model.safetensors')"
    )


def check_vocabulary(model_cfg, tokenizer, bundle) -> None:
    """Every token id the run feeds the model (the data's, the pad id) must have an embedding row;
    an id past the embedding is an IndexError at step 1. Read from config.json, before the weights."""
    from transformers import AutoConfig

    from finetune.modeling.load import resolve_model_path

    path = resolve_model_path(model_cfg.name_or_path)
    config = AutoConfig.from_pretrained(
        path, revision=model_cfg.revision, trust_remote_code=model_cfg.trust_remote_code
    )
    rows = getattr(config.get_text_config(), "vocab_size", None)
    if not isinstance(rows, int):
        return
    ids = [_highest_id(split) for split in (bundle.train, bundle.eval) if split is not None]
    highest = max([*ids, tokenizer.pad_token_id or 0])
    if highest < rows:
        return
    tok = model_cfg.tokenizer_name_or_path or model_cfg.name_or_path
    raise UserError(
        f"model.name_or_path: {model_cfg.name_or_path}: the model's embedding has {rows:,} rows (config.json "
        f"vocab_size) but the tokenizer ({tok}, {len(tokenizer):,} tokens) gives token id {highest:,} "
        f"({tokenizer.convert_ids_to_tokens(highest)!r}) to this run: training would stop at step 1 with an "
        f"IndexError. Use the tokenizer that belongs to this model (model.tokenizer_name_or_path), or resize "
        f"the model's embeddings to the tokenizer (model.resize_token_embeddings(len(tokenizer)), then "
        f"save_pretrained) and fine-tune that"
    )


def _highest_id(dataset) -> int:
    """The highest token id of a memory-mapped dataset, a chunk at a time (no Python list of its rows)."""
    import numpy as np

    return max(int(np.asarray(c.flatten()).max()) for c in dataset.data.column("input_ids").chunks if len(c.flatten()))
