"""The planner's inputs: the model's shape (from its transformers config, no weights) and the workload (from the recipe:
method, batch, sequence, layout, precision policy, loss, checkpointing). finetune/planning/memory.py turns them into
bytes. Parameter counts come from config arithmetic, and model-state bytes as the ZeRO paper counts them (Rajbhandari et
al. 2020, §3); DeepSpeed's own estimators differ deliberately and are called where needed (docs/planning.md)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class ParamCount:
    total: int
    embedding: int  # input embedding table
    lm_head: int  # 0 when tied to the embedding
    per_layer: int
    layers: int


def count_parameters(config) -> ParamCount:
    """Parameters of a decoder-only model from its transformers config (or finetune/planning/model_source.py's):
    the Llama family (RMSNorm, gated MLP, optional q/k/v bias, GQA: llama, mistral, qwen2, qwen3 with q/k norms;
    phi3 with fused qkv and gate/up projections; gemma2 and gemma3_text with four norms per layer, gemma3_text
    with q/k norms) and GPT-2 (LayerNorm with bias, learned positions, 4x MLP with bias). Raises ValueError for
    other model types."""
    kind = getattr(config, "model_type", "")
    if kind == "gpt2":
        h, layers, vocab = config.n_embd, config.n_layer, config.vocab_size
        inner = config.n_inner or 4 * h
        per_layer = (2 * h) + (h * 3 * h + 3 * h) + (h * h + h) + (2 * h) + (h * inner + inner) + (inner * h + h)
        embedding = vocab * h
        total = embedding + config.n_positions * h + layers * per_layer + 2 * h  # + final LayerNorm
        lm_head = 0 if getattr(config, "tie_word_embeddings", True) else vocab * h
        return ParamCount(total + lm_head, embedding, lm_head, per_layer, layers)
    if kind not in DECODERS:
        raise ValueError(f"no parameter arithmetic for model_type {kind!r} (supported: {', '.join(DECODERS)}, gpt2)")
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    q, k = heads * head_dim, (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    norms, qk_norms = DECODERS[kind]
    per_layer = sum(i * o for _, i, o in decoder_linears(config)) + norms * h + qk_norms * 2 * head_dim
    if kind == "qwen2" or getattr(config, "attention_bias", False):
        per_layer += q + 2 * k  # q/k/v biases
    embedding = vocab * h
    lm_head = 0 if getattr(config, "tie_word_embeddings", False) else vocab * h
    total = embedding + lm_head + layers * per_layer + h  # + final norm
    return ParamCount(total, embedding, lm_head, per_layer, layers)


# model_type: (RMSNorms of hidden size per layer, whether q and k have an RMSNorm over head_dim). Gemma 2/3 put a
# norm before and after both attention and MLP (modeling_gemma2.py Gemma2DecoderLayer).
DECODERS = {
    "llama": (2, False),
    "mistral": (2, False),
    "qwen2": (2, False),
    "qwen3": (2, True),
    "phi3": (2, False),
    "gemma2": (4, False),
    "gemma3_text": (4, True),
}


def decoder_linears(config) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of every linear layer of one decoder block. phi3 fuses q/k/v into
    qkv_proj and gate/up into gate_up_proj (modeling_phi3.py); the others have Llama's seven."""
    h, heads = config.hidden_size, config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or h // heads
    inter = config.intermediate_size
    if config.model_type == "phi3":
        return [
            ("qkv_proj", h, (heads + 2 * kv) * hd),
            ("o_proj", heads * hd, h),
            ("gate_up_proj", h, 2 * inter),
            ("down_proj", inter, h),
        ]
    return [
        ("q_proj", h, heads * hd),
        ("k_proj", h, kv * hd),
        ("v_proj", h, kv * hd),
        ("o_proj", heads * hd, h),
        ("gate_proj", h, inter),
        ("up_proj", h, inter),
        ("down_proj", inter, h),
    ]


# Architectures whose decoder block the activation arithmetic follows op by op (RMSNorm, rotary,
# SDPA, gated MLP: transformers' LlamaDecoderLayer and its copies; qwen3 adds q/k RMSNorms).
BLOCK_MECHANISM = ("llama", "mistral", "qwen2", "qwen3")
# The shipped table's other families: what their blocks save that the Llama block does not (phi3: saved-tensor
# hooks on CPU, bf16, one layer: 2q + kv more bytes x 2 per token than the Llama formula).
NOT_YET = {
    "phi3": "v is a view of the fused qkv output, which it keeps alive whole, and o_proj saves a copy of its input",
    "gemma2": "four norms per block (Gemma's RMSNorm), logit soft-capping, sliding-window masks",
    "gemma3_text": "four norms per block and q/k norms (Gemma's RMSNorm), sliding-window masks",
}


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
    def tied(self) -> bool:
        return self.params.lm_head == 0

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_linear_params(self) -> int:
        return sum(i * o for _, i, o in self.linears)

    @property
    def block_linear_params(self) -> int:
        return self.layers * self.layer_linear_params

    @property
    def embedding(self) -> int:
        return self.vocab * self.hidden

    @property
    def outside_layers(self) -> int:
        """Embedding, untied head and final norm: the parameters no decoder block owns."""
        return self.params.total - self.layers * self.params.per_layer

    def parameter_numels(self) -> list[int]:
        """Elements of every parameter tensor of a Llama-family model (biases and q/k norms folded
        into each layer's remainder), for allocators that round tensor by tensor."""
        rest = self.params.per_layer - self.layer_linear_params  # norms (+ biases, q/k norms)
        per_layer = [i * o for _, i, o in self.linears] + [rest]
        outside = [self.embedding] + ([self.params.lm_head] if self.params.lm_head else [])
        outside.append(self.outside_layers - sum(outside))
        return [x for x in per_layer * self.layers + outside if x > 0]

    def lora_params(self, r: int, targets) -> int:
        """LoRA A (r x in) + B (out x r) per targeted linear of every block. "all-linear" is every
        linear of the blocks (peft leaves the output head alone)."""
        return self.layers * sum(r * (i + o) for _, i, o in self.targeted(targets))

    def targeted(self, targets) -> list:
        if targets == "all-linear":
            return list(self.linears)
        names = set(targets)
        return [t for t in self.linears if t[0] in names or t[0].rsplit(".", 1)[-1] in names]

    def tp_local(self, tp: int) -> Shape:
        """One tensor-parallel rank's share of the blocks (AutoTP over the model's tp plan: q/k/v and
        gate/up split by output, o/down by input; heads and the intermediate width split with them).
        Norms, the embedding and the head stay whole on every rank; so does the residual stream."""
        if tp == 1:
            return self
        split = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "qkv_proj": 1, "gate_proj": 1, "up_proj": 1, "gate_up_proj": 1}
        split |= {"o_proj": 0, "down_proj": 0}
        linears = [
            (n, i // tp if split.get(n) == 0 else i, o // tp if split.get(n) == 1 else o) for n, i, o in self.linears
        ]
        saved = self.layer_linear_params - sum(i * o for _, i, o in linears)  # per layer, on other ranks
        params = replace(
            self.params, per_layer=self.params.per_layer - saved, total=self.params.total - self.layers * saved
        )
        return replace(
            self,
            params=params,
            heads=self.heads // tp,
            kv_heads=max(1, self.kv_heads // tp),
            intermediate=self.intermediate // tp,
            linears=linears,
        )

    def check_block_mechanism(self) -> None:
        if self.model_type not in BLOCK_MECHANISM:
            why = NOT_YET.get(self.model_type)
            known = f"; its {self.params.total:,} parameters are counted, its block is not: {why}" if why else ""
            raise ValueError(
                f"no activation arithmetic for model_type {self.model_type!r} (the planner follows the "
                f"decoder blocks of {', '.join(BLOCK_MECHANISM)} op by op){known}"
            )


def shape_of(config) -> Shape:
    count = count_parameters(config)  # raises ValueError naming unsupported model types
    if config.model_type == "gpt2":
        h, inner = config.n_embd, config.n_inner or 4 * config.n_embd
        linears = [("c_attn", h, 3 * h), ("attn.c_proj", h, h), ("c_fc", h, inner), ("mlp.c_proj", inner, h)]
        heads = config.n_head  # no grouped-query attention: kv heads = heads
        return Shape("gpt2", count, h, config.n_layer, heads, heads, h // heads, inner, config.vocab_size, linears)
    h, heads = config.hidden_size, config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or h // heads
    linears = decoder_linears(config)
    return Shape(
        config.model_type,
        count,
        h,
        config.num_hidden_layers,
        heads,
        kv,
        hd,
        config.intermediate_size,
        config.vocab_size,
        linears,
    )


@dataclass
class Workload:
    """The recipe's side of the arithmetic. Tokens per micro-batch T = micro_batch x seq_len."""

    method: str  # full | lora | qlora
    micro_batch: int
    seq_len: int  # the longest row (padded layout), the packed row length, or each example's cap
    grad_accum: int = 1
    gradient_checkpointing: bool = False
    # precision policy, resolved: bf16-mixed | bf16-true | 16-mixed | 32-true, or
    # "legacy" for what the project did before the policy (finetune/planning/regimes.py)
    precision: str = "bf16-mixed"
    lora_r: int = 16
    lora_targets: object = "all-linear"
    lora_dropout: float = 0.0
    double_quant: bool = True
    attn_implementation: str = "sdpa"
    # padded: rows padded to seq_len, with an attention mask when some row is shorter (`masked`);
    # packed: rows of seq_len with position_ids (transformers builds a block-diagonal mask);
    # padding_free: the batch as ONE row of T tokens with position_ids (data.padding_free)
    layout: str = "padded"
    masked: bool = False  # padded layout: some batch carries padding (an attention mask reaches SDPA)
    loss_impl: str = "standard"  # standard | chunked | liger (training.loss_impl)
    loss_chunk_tokens: int | None = None  # None: the automatic chunk (memory.chunk_tokens)
    optimizer: str = "fused"  # adamw_torch_fused (Trainer's default with torch >= 2.8) | foreach
    legacy_model_dtype: str = "auto"  # model.dtype, only read by the "legacy" precision
    # the mesh (finetune/mesh.py): sequence shards (Ulysses), tensor-parallel ranks, context shards
    sp: int = 1
    tp: int = 1
    cp: int = 1

    @property
    def tokens(self) -> int:
        """Tokens of the micro-batch on one rank: sequence and context parallelism split every row."""
        return self.micro_batch * self.seq_len // (self.sp * self.cp)

    @property
    def rows(self) -> int:
        return 1 if self.layout == "padding_free" else self.micro_batch

    @property
    def row_len(self) -> int:
        """Positions of a row on one rank."""
        return self.tokens if self.layout == "padding_free" else self.seq_len // (self.sp * self.cp)

    @property
    def attention_mask(self) -> bool:
        """Whether SDPA gets a mask: padding, or the block-diagonal mask of packed rows. Ulysses and
        ring attention drop it (causal over the whole row: the padding is at the end)."""
        if self.attn_implementation.startswith("flash_attention") or self.sp > 1 or self.cp > 1:
            return False  # varlen kernels: no mask tensor
        return self.layout in ("packed", "padding_free") or self.masked
