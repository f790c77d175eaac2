"""What `training.loss_impl: auto` installs, and the chunk size: pure arithmetic, no torch, so the
planner and the loss module read the same rule. `auto` is not always chunked: when the output head
trains, the chunked loss keeps an fp32 weight-gradient accumulator (vocab x hidden x 4 bytes), which
outweighs the logits it saves for short micro-batches (docs/planning.md, docs/speed.md).
"""

from __future__ import annotations

# One chunk's fp32 logits stay within this many bytes. Why 256 MiB: it bounds the loss's working memory whatever the
# vocabulary (forward: the chunk's logits in the compute dtype and in fp32; backward: the recomputed fp32 softmax and
# its compute-dtype copy; so about chunk x V x (a + 4) bytes live at once, a = compute dtype bytes: <= 384 MiB in bf16),
# under 1% of a 40 GB device, while a chunk keeps >= 256 tokens for any vocabulary up to 262,144, enough rows for a
# full-speed GEMM (chunk x H x V). Measured on CPU (profiler allocator events, V 49,152, 8,192 tokens): loss peak 6,735
# MiB standard, 977 MiB chunked (docs/speed.md "Loss implementations").
CHUNK_LOGITS_BYTES = 256 * 2**20
MIN_CHUNK_TOKENS = 16
F32 = 4


def chunk_tokens(vocab_size: int, budget: int = CHUNK_LOGITS_BYTES) -> int:
    """Tokens per chunk: the largest power of two whose fp32 logits (tokens x vocab x 4 bytes) fit
    the budget, at least MIN_CHUNK_TOKENS. V 151,936 -> 256; 128,256 -> 512; 49,152 -> 1,024."""
    n = max(MIN_CHUNK_TOKENS, budget // (F32 * vocab_size))
    return 1 << (n.bit_length() - 1)


def loss_bytes(impl: str, *, tokens: int, vocab: int, hidden: int, head_trains: bool, chunk: int) -> int:
    """The loss's own bytes at backward's start (the moment of the step's peak when the loss holds it)."""
    if impl == "standard":
        return 3 * F32 * tokens * vocab
    return 2 * F32 * min(chunk, tokens) * vocab + (F32 * vocab * hidden if head_trains else 0)


def auto_choice(
    *, tokens: int, vocab: int, hidden: int, head_trains: bool, chunk: int | None = None
) -> tuple[str, str]:
    """("chunked" | "standard", why) for `auto`, given the tokens of one micro-batch (padded length x
    rows: an upper bound), the vocabulary, the hidden size and whether the head trains."""
    chunk = chunk or chunk_tokens(vocab)
    kw = dict(tokens=tokens, vocab=vocab, hidden=hidden, head_trains=head_trains, chunk=chunk)
    chunked, standard = loss_bytes("chunked", **kw), loss_bytes("standard", **kw)
    mib = 2**20
    if chunked < standard:
        return "chunked", f"chunked {chunked / mib:,.0f} MiB < standard {standard / mib:,.0f} MiB at {tokens} tokens"
    return "standard", (
        f"standard {standard / mib:,.0f} MiB <= chunked {chunked / mib:,.0f} MiB at {tokens} tokens "
        f"(the trainable head's fp32 weight-gradient accumulator outweighs the logits)"
    )
