"""The model `finetune plan` plans: its config.json only, never weights, read without transformers (whose
import brings torch: seconds). Tried in order, each named in the error when none has it: a local file or
directory, the bundled model, the Hugging Face cache, the shipped table of published configs
(finetune/model_configs/models.json), and the Hub's config.json when online (HF_HUB_OFFLINE honoured;
HF_ENDPOINT, HF_HUB_CACHE and HF_TOKEN as huggingface_hub reads them; a short timeout; nothing written)."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from functools import cache
from pathlib import Path

from finetune import resources
from finetune.errors import UserError

TABLE = resources.MODEL_CONFIGS / "models.json"
HUB_TIMEOUT_S = 5  # seconds per connection step: a machine without network answers in seconds, not minutes
MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KiB; more is not one
INVALID_ID = "not a valid hub id"

# What transformers' config classes give a key the file leaves out (their __init__ defaults), for the keys the
# arithmetic reads; the shapes themselves (hidden size, layers, heads, intermediate, vocabulary) must be in the file.
DEFAULTS = {
    "llama": {"tie_word_embeddings": False, "attention_bias": False},
    "mistral": {"tie_word_embeddings": False},
    "qwen2": {"tie_word_embeddings": False},
    "qwen3": {"tie_word_embeddings": False, "attention_bias": False},
    "phi3": {"tie_word_embeddings": False},
    "gemma2": {"tie_word_embeddings": True},
    "gemma3_text": {"tie_word_embeddings": True},
    "gpt2": {"tie_word_embeddings": True, "n_inner": None},
}
REQUIRED = {
    "gpt2": ("n_embd", "n_layer", "n_head", "n_positions", "vocab_size"),
    "*": ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"),
}
# Image-text models whose language model is a text_config of a type the arithmetic has (Gemma 3 4B-27B).
TEXT_MODEL_TYPES = {"gemma3": "gemma3_text"}


class ModelConfig:
    """A config.json's values as attributes (what the planner's shapes read), with transformers' defaults for
    the keys it may leave out, and where it came from (`source`)."""

    def __init__(self, values: dict, source: str, where: str):
        values = dict(values)
        note = values.pop("note", "")  # the shipped table's word on a row
        if "text_config" in values and values.get("model_type") in TEXT_MODEL_TYPES:
            kind = TEXT_MODEL_TYPES[values["model_type"]]
            values = {"model_type": kind, **DEFAULTS.get(kind, {}), **values["text_config"]}
            note = "the language model of an image-text model (its vision tower is not counted)"
        kind = values.get("model_type")
        if not isinstance(kind, str):
            raise UserError(f"--model: {where} is not a transformers config.json: it has no model_type")
        if kind not in DEFAULTS and isinstance(values.get("auto_map"), dict):
            code = ", ".join(f"{auto} -> {ref}" for auto, ref in values["auto_map"].items())
            raise UserError(
                f"--model: {where}: its auto_map asks for the model's own Python code ({code}); `finetune plan` runs "
                f"no model code and has arithmetic for model_type {', '.join(DEFAULTS)}"
            )
        missing = [k for k in REQUIRED.get(kind, REQUIRED["*"]) if not isinstance(values.get(k), int)]
        if missing and kind in DEFAULTS:
            raise UserError(
                f"--model: {where} (model_type {kind!r}) lacks {', '.join(missing)}: a config.json from the model's "
                f"repository has them"
            )
        self.values = {**DEFAULTS.get(kind, {}), **values}
        self.source = source
        self.note = note

    def __getattr__(self, name: str):
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None


def read_config(name: str, revision: str | None = None) -> ModelConfig:
    """The config of `name` from the first place that has it; a UserError naming every place tried and what
    each said otherwise. `revision`: the recipe's model.revision (cache and Hub), else main."""
    from finetune.config.sections import BUNDLED_MODEL

    if name == BUNDLED_MODEL:
        from finetune.modeling import bundled

        if not bundled.is_prepared():
            raise UserError(
                "--model: the bundled model is not prepared yet: run `finetune prepare-model` once, or pass "
                "--model DIR_OR_CONFIG_JSON, a hub id, or a model of the shipped table (" + ", ".join(names()) + ")"
            )
        name = str(bundled.model_dir())
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"--model: directory {path} has no config.json; " + _no_config_fix(path))
        path = path / "config.json"
    if path.is_file():
        return ModelConfig(_json_file(path), f"local file {path}", str(path))
    tried = [f"not a local file or directory ({path.resolve()})"]
    cached, why = _cached(name, revision)
    if cached is not None:
        return ModelConfig(_json_file(cached), f"Hugging Face cache ({cached})", str(cached))
    tried.append(why)
    row = published().get(name.lower())
    if row is not None:
        repo = row.pop("repo")
        return ModelConfig(row, f"shipped table ({TABLE.name}: the published config.json of {repo})", repo)
    tried.append(f"not in the shipped table ({TABLE.name})")
    if not why.startswith(INVALID_ID):  # a name the Hub cannot have is not asked for
        fetched, why = fetch_from_hub(name, revision)
        if fetched is not None:
            return ModelConfig(fetched, why, why)
        tried.append(why)
    raise UserError(
        f"--model: no config.json found for {name!r}: " + "; ".join(tried) + ". Pass a local directory or "
        "config.json (--model path/to/config.json), a hub id, or a model of the shipped table: " + ", ".join(names())
    )


def _no_config_fix(path: Path) -> str:
    """How to give `finetune plan` a model instead of `path`, a directory without config.json: the base model of a
    LoRA adapter saved there, a folder below that has one, else the forms --model takes."""
    try:
        base = json.loads((path / "adapter_config.json").read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    if base:
        return f"it holds a LoRA adapter: plan its base model, --model {base}"
    below = sorted(str(p.parent) for p in path.glob("*/config.json"))[:3]
    if below:
        return f"a folder in it has one: --model {' or '.join(below)}"
    return (
        "pass the folder that holds the model's config.json (next to its weights, e.g. what `hf download ORG/NAME "
        f"config.json --local-dir {path}` fetches), the config.json itself, a hub id, or a model of the shipped table: "
        + ", ".join(names())
    )


def _json_file(path: Path) -> dict:
    try:
        values = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"--model: {path} is not a readable JSON file: {type(e).__name__}: {e}") from None
    if not isinstance(values, dict):
        raise UserError(f"--model: {path} holds no JSON object (a config.json is one)")
    return values


def _cached(repo_id: str, revision: str | None) -> tuple[Path | None, str]:
    """(config.json in the Hugging Face cache, or None and why not)."""
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    except ValueError as e:  # huggingface_hub's HFValidationError
        return None, f"{INVALID_ID} ({e})"
    if isinstance(found, str):
        return Path(found), ""
    return None, f"not in the Hugging Face cache ({constants.HF_HUB_CACHE})"


class _NoCredentialsAcrossHosts(urllib.request.HTTPRedirectHandler):
    """Follows a redirect, without the token when it leads to another host."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc:
            new.remove_header("Authorization")
        return new


def fetch_from_hub(repo_id: str, revision: str | None = None) -> tuple[dict | None, str]:
    """(the Hub's config.json of `repo_id`, where it came from) or (None, why not): what the Hub answered,
    or that it was not tried (HF_HUB_OFFLINE)."""
    from huggingface_hub import constants, get_token

    if constants.HF_HUB_OFFLINE:
        return None, "the Hub not tried: HF_HUB_OFFLINE is set"
    ref = urllib.parse.quote(revision or "main", safe="")
    url = f"{constants.ENDPOINT.rstrip('/')}/{urllib.parse.quote(repo_id)}/resolve/{ref}/config.json"
    request = urllib.request.Request(url, headers={"User-Agent": "finetune-plan"})
    token = get_token()
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    opener = urllib.request.build_opener(_NoCredentialsAcrossHosts)
    try:
        with opener.open(request, timeout=HUB_TIMEOUT_S) as response:
            body = response.read(MAX_CONFIG_BYTES + 1)
    except urllib.error.HTTPError as e:
        why = {
            401: "gated or private: accept its license on the Hub and log in (`hf auth login`) or set HF_TOKEN",
            403: "gated: accept its license on the model's Hub page with the account of your token",
            404: "no such repository or revision, or no config.json in it",
        }.get(e.code, e.reason)
        return None, f"the Hub answered {e.code} for {url} ({why})"
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        return None, f"the Hub ({constants.ENDPOINT}) could not be reached within {HUB_TIMEOUT_S} s ({reason})"
    try:
        values = json.loads(body[:MAX_CONFIG_BYTES])
    except ValueError as e:
        return None, f"the Hub's {url} is not JSON ({e})"
    if not isinstance(values, dict) or len(body) > MAX_CONFIG_BYTES:
        return None, f"the Hub's {url} is not a config.json"
    return values, f"the Hub ({url})"


@cache
def _table() -> tuple[list[str], list[list]]:
    data = json.loads(TABLE.read_text(encoding="utf-8"))
    return data["columns"], data["rows"]


def published() -> dict[str, dict]:
    """Every name of the shipped table (each repository id and its name without the organisation, lower case)
    -> that model's config values and `repo`, the repository whose config.json they are."""
    columns, rows = _table()
    out = {}
    for row in rows:
        values = dict(zip(columns, row))
        repos, extra = values.pop("repos"), values.pop("extra")
        for repo in repos:
            for key in (repo.lower(), repo.split("/")[-1].lower()):
                out.setdefault(key, {**values, **extra, "repo": repos[0]})
    return out


def names() -> list[str]:
    """The shipped table's models by their shortest names (a repository without its organisation)."""
    _, rows = _table()
    return [min((repo.split("/")[-1] for repo in row[0]), key=len) for row in rows]
