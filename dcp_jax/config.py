"""Frozen configuration: the model (HF `config.json` fields), the parallel layout and the engine.

No jax here. Variants are made with `dataclasses.replace`; derived values are properties.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any


# The two kinds of a DSA layer (HF's `indexer_types`): "full" runs its own indexer; "shared" (GLM-5.2's IndexShare)
# has none and attends to the selection of the most recent full layer of the same step.
INDEXER_TYPES = ("full", "shared")


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    """DSA's lightning indexer (HF's `index_n_heads`, `index_head_dim`, `index_topk`): `heads` index heads of
    `head_dim` score every cached token; each query attends to the `topk` best. `rope_interleave`: the RoPE of the
    indexer's first qk_rope_head_dim dims rotates interleaved pairs (GLM) rather than half-split ones (DeepSeek-V3.2).
    `layer_types`: each decoder layer's kind (`INDEXER_TYPES`, HF's `indexer_types`); None: every layer full."""

    heads: int
    head_dim: int
    topk: int
    rope_interleave: bool = False
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self):
        types = self.layer_types
        if types is not None and (not types or types[0] != "full" or set(types) - set(INDEXER_TYPES)):
            raise ValueError(f"indexer_types must be 'full' or 'shared' per layer, layer 0 'full'; got {types}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A DeepSeek-family model's shape, spelled with the HF config field names (`model/architecture.py` reads it
    from config.json and writes it back). `architecture` is the HF architecture name (config.json's
    `architectures`) whose registry entry runs it; `indexer` is None for a model without sparse attention."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    first_k_dense_replace: int
    num_attention_heads: int
    q_lora_rank: int | None  # None: no low-rank query (HF's q_proj instead of q_a_proj, its norm and q_b_proj)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    indexer: IndexerConfig | None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None for default RoPE; else HF `rope_parameters` / `rope_scaling` with rope_type "yarn".
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 4096
    # Multi-token-prediction layers after the decoder layers (the speculative decoding draft).
    num_nextn_predict_layers: int = 0
    bos_token_id: int = 0
    eos_token_id: int = 1
    # The checkpoint's dtype (HF `torch_dtype`, or `dtype` in newer files); None for a preset.
    torch_dtype: str | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def query_input_dim(self) -> int:
        """Width of what the per-head query projection (wq_b) reads: q_lora_rank, or hidden_size without it."""
        return self.hidden_size if self.q_lora_rank is None else self.q_lora_rank

    @property
    def latent_dim(self) -> int:
        """Width of one cached MLA entry: latent c then roped key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def rope(self) -> dict[str, Any]:
        return dict(self.rope_scaling) if self.rope_scaling else {"rope_type": "default"}

    @property
    def softmax_scale(self) -> float:
        """`qk_head_dim^-0.5`, times YaRN mscale^2 when YaRN scaling applies."""
        scale = self.qk_head_dim**-0.5
        rope = self.rope
        if rope.get("rope_type") == "yarn":
            factor = float(rope["factor"])
            mscale_all_dim = float(rope.get("mscale_all_dim", 0.0) or 0.0)
            if mscale_all_dim and factor > 1:
                mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
                scale *= mscale * mscale
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace

    def __post_init__(self):
        types = self.indexer.layer_types if self.indexer is not None else None
        if types is not None and len(types) < self.num_hidden_layers:
            raise ValueError(f"indexer_types names {len(types)} layers, the model has {self.num_hidden_layers}")

    def shares_index_selection(self, layer: int) -> bool:
        """Whether decoder layer `layer` is a shared DSA layer (`IndexerConfig.layer_types`): no indexer of its own,
        the selection of the most recent full layer. The MTP layer (`layer` = num_hidden_layers) is full."""
        types = self.indexer.layer_types if self.indexer is not None else None
        return types is not None and layer < self.num_hidden_layers and types[layer] == "shared"

    def with_indexer(self, **changes) -> ModelConfig:
        """This config with its indexer's fields changed (`IndexerConfig` names: heads, head_dim, topk)."""
        if self.indexer is None:
            raise ValueError(f"{self.architecture} has no indexer to change")
        return dataclasses.replace(self, indexer=dataclasses.replace(self.indexer, **changes))


# The random preset the tests serve (and `LLM`'s and `Engine`'s default): runs on simulated CPU devices in
# seconds. Eight index heads keep exact score ties rare (see the oracle notes). A 128-column latent is one tile of
# the fp8 latent cache. One MTP layer, as DeepSeek-V3.2 has (`model/mtp.py`; the speculative decoding draft).
TINY = ModelConfig(
    architecture="DeepseekV32ForCausalLM",
    vocab_size=512,
    hidden_size=256,
    intermediate_size=256,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    num_attention_heads=8,
    q_lora_rank=64,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    indexer=IndexerConfig(heads=8, head_dim=32, topk=16),
    max_position_embeddings=4096,
    num_nextn_predict_layers=1,
)

# The tiny preset as a dense-MLA model (DeepSeek-V3's architecture: no indexer, every cached token attended).
TINY_MLA = dataclasses.replace(TINY, architecture="DeepseekV3ForCausalLM", indexer=None)

_DEEPSEEK_V32_YARN = (
    ("beta_fast", 32),
    ("beta_slow", 1),
    ("factor", 40),
    ("mscale", 1.0),
    ("mscale_all_dim", 1.0),
    ("original_max_position_embeddings", 4096),
    ("rope_type", "yarn"),
)

DEEPSEEK_V32 = ModelConfig(
    architecture="DeepseekV32ForCausalLM",
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    first_k_dense_replace=3,
    num_attention_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    indexer=IndexerConfig(heads=64, head_dim=128, topk=2048),
    rope_scaling=_DEEPSEEK_V32_YARN,
    max_position_embeddings=163840,
    num_nextn_predict_layers=1,
)



def indexer_layer_types(num_layers: int, freq: int, offset: int) -> tuple[str, ...]:
    """HF's IndexShare schedule (GlmMoeDsaConfig without `indexer_types`): layer i is "full" iff
    max(i - offset + 1, 0) % freq == 0, else "shared"."""
    freq = max(freq, 1)
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))


# GLM-5 / GLM-5.1 (`GlmMoeDsaForCausalLM`, zai-org/GLM-5's config.json): V3.2's DSA with GLM's shapes, one expert
# group, plain RoPE (theta 1e6), RoPE interleaved in the indexer too, one MTP layer.
GLM5 = dataclasses.replace(
    DEEPSEEK_V32,
    architecture="GlmMoeDsaForCausalLM",
    vocab_size=154880,
    hidden_size=6144,
    intermediate_size=12288,
    num_hidden_layers=78,
    num_attention_heads=64,
    q_lora_rank=2048,
    qk_nope_head_dim=192,
    v_head_dim=256,
    n_group=1,
    topk_group=1,
    indexer=IndexerConfig(heads=32, head_dim=128, topk=2048, rope_interleave=True),
    rms_norm_eps=1e-5,
    rope_theta=1e6,
    rope_scaling=None,
    max_position_embeddings=202752,
    eos_token_id=154820,
)

# GLM-5.2: GLM-5's shapes with IndexShare (21 of the 78 layers run the indexer; the others reuse the selection of
# the most recent one), RoPE theta 8e6 and 1M positions. The preset places the full layers by HF's schedule with
# index_topk_freq 4 and index_skip_topk_offset 3 (layers 0-2, then 6, 10, ..., 74); a checkpoint's own
# `indexer_types` replaces it.
GLM52 = dataclasses.replace(
    GLM5,
    indexer=dataclasses.replace(GLM5.indexer, layer_types=indexer_layer_types(78, freq=4, offset=3)),
    rope_theta=8e6,
    max_position_embeddings=1048576,
)

# The tiny preset as a GLM-5.2-style model: five layers, the shared ones (1 and 3) reusing the selection of the full
# layer before them (HF's schedule with freq 2, offset 1), RoPE interleaved in the indexer.
TINY_GLM = dataclasses.replace(
    TINY,
    architecture="GlmMoeDsaForCausalLM",
    num_hidden_layers=5,
    n_group=1,
    topk_group=1,
    indexer=dataclasses.replace(TINY.indexer, rope_interleave=True, layer_types=indexer_layer_types(5, freq=2,
                                                                                                    offset=1)),
)

# DeepSeek-V3 / R1 / V3.1 (their config.json shapes: V3.2's without the indexer).
DEEPSEEK_R1 = dataclasses.replace(DEEPSEEK_V32, architecture="DeepseekV3ForCausalLM", indexer=None)

# Kimi-K2-Instruct as published (`DeepseekV3ForCausalLM` under model_type kimi_k2): 64 heads, 384 routed experts in
# one group, one dense layer, no MTP layer.
KIMI_K2 = dataclasses.replace(
    DEEPSEEK_R1,
    vocab_size=163840,
    first_k_dense_replace=1,
    num_attention_heads=64,
    n_routed_experts=384,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.827,
    rope_theta=50000.0,
    rope_scaling=(("beta_fast", 1.0), ("beta_slow", 1.0), ("factor", 32.0), ("mscale", 1.0),
                  ("mscale_all_dim", 1.0), ("original_max_position_embeddings", 4096), ("rope_type", "yarn")),
    max_position_embeddings=131072,
    num_nextn_predict_layers=0,
    bos_token_id=163584,
    eos_token_id=163585,
)

PRESETS = {"tiny": TINY, "tiny-mla": TINY_MLA, "tiny-glm": TINY_GLM, "deepseek-v3.2": DEEPSEEK_V32, "glm-5": GLM5,
           "glm-5.2": GLM52, "deepseek-r1": DEEPSEEK_R1, "kimi-k2": KIMI_K2}


# Trained checkpoints shipped inside the package (HF layout), served by name like a preset: `dsa-tiny`, the tiny
# retrieval model of `train/` (docs/training.md).
CHECKPOINTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints")


def shipped_checkpoints() -> list[str]:
    """The names of the checkpoints shipped with the package."""
    if not os.path.isdir(CHECKPOINTS_DIR):
        return []
    return sorted(name for name in os.listdir(CHECKPOINTS_DIR)
                  if os.path.isfile(os.path.join(CHECKPOINTS_DIR, name, "config.json")))


def model_directory(model: str) -> str | None:
    """The HF directory `model` names (a path, or a shipped checkpoint's name); None for a preset or nothing."""
    if os.path.isdir(model):
        return model
    if model in shipped_checkpoints():
        return os.path.join(CHECKPOINTS_DIR, model)
    return None


def unknown_model(model: str) -> str:
    """The error for a model that is neither a directory, a shipped checkpoint nor a preset."""
    return (f"model {model!r} is neither a directory, a shipped checkpoint {shipped_checkpoints()} nor a preset "
            f"{sorted(PRESETS)}")


def preset(name: str, *, num_layers: int | None = None) -> ModelConfig:
    """A built-in config by name, optionally with fewer layers (for benchmarks)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    cfg = PRESETS[name]
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"{num_layers=} must be >= 1")
        cfg = dataclasses.replace(cfg, num_hidden_layers=num_layers)
    return cfg


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """`tp` ranks in all; DCP groups of `dcp` consecutive ranks share one request's KV along tokens. The routed
    experts are split over the tp ranks along their width F, or, with `enable_expert_parallel` (vLLM's name), whole
    experts over the ranks (`model/moe.py`)."""

    tp: int = 1
    dcp: int = 1
    interleave: int = 1
    enable_expert_parallel: bool = False

    def __post_init__(self):
        if self.dcp < 1 or self.tp < 1:
            raise ValueError(f"tp and dcp must be >= 1, got tp={self.tp}, dcp={self.dcp}")
        if self.tp % self.dcp:
            raise ValueError(f"tp={self.tp} must be a multiple of dcp={self.dcp}")
        if self.interleave < 1:
            raise ValueError(f"interleave={self.interleave} must be >= 1")

    @property
    def dcp_groups(self) -> int:
        return self.tp // self.dcp


DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# Rows (decode rows plus prefill-chunk tokens) one step runs at most, by default (vLLM's chunked-prefill default).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# The model's dtype (weights, activations, the exact caches): auto is the checkpoint's torch_dtype (bfloat16 for
# float16 and for presets), or bfloat16 / float32.
DTYPE_CHOICES = ("auto", "bfloat16", "float32")


def resolve_dtype(dtype: str, cfg: ModelConfig) -> str:
    """The dtype name `dtype` means for `cfg` ('bfloat16' or 'float32')."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype={dtype!r} must be one of {DTYPE_CHOICES}")
    if dtype != "auto":
        return dtype
    return "float32" if cfg.torch_dtype == "float32" else "bfloat16"


# Formats of the weights: the model dtype, DeepSeek's block fp8 (the linear layers' weights in e4m3 with one f32
# scale per 128 x 128 block; embeddings, norms, the router and lm_head in the model dtype), or mxfp4: the decoder
# layers' routed experts in OCP MXFP4 (0.5 + 1/32 bytes a weight, AMD Quark's export, `model/mxfp4.py`), the rest
# in the model dtype.
WEIGHT_FORMATS = ("model_dtype", "fp8", "mxfp4")
# How a checkpoint's weights load (vLLM's `quantization`): auto is the checkpoint's format (a block fp8 one stays in
# fp8, `model/fp8_linear.py`; a Quark MXFP4 one keeps its routed experts in MXFP4, `model/quark.py`), none
# dequantizes into the model dtype, fp8 quantizes an unquantized checkpoint's (or a preset's) linear weights to
# DeepSeek's block fp8 on load (ONLINE_FP8_BLOCK; a block fp8 checkpoint stays as it is).
QUANTIZATION_CHOICES = ("auto", "none", "fp8", "ptpc_fp8")
ONLINE_FP8_BLOCK = (128, 128)  # DeepSeek-V3.2's weight_block_size

# Which kernels the model runs (attention, the MoE's grouped matmul, block-fp8 linear layers): auto (Pallas on a GPU,
# the pure-jnp references elsewhere), pallas (the Pallas kernels; interpreted on CPU) or reference.
KERNEL_CHOICES = ("auto", "pallas", "reference")
# Formats of the indexer key cache. exact: keys in the model dtype, scored as HF does. fp8: Hadamard-rotated e4m3
# keys with a power-of-two f32 scale per token (index_head_dim + 4 bytes a token), scored with fp8 queries.
INDEX_CACHE_FORMATS = ("exact", "fp8")


def check_index_cache(index_cache: str) -> None:
    """Refuse an unknown index-cache format."""
    if index_cache not in INDEX_CACHE_FORMATS:
        raise ValueError(f"index_cache={index_cache!r} must be one of {INDEX_CACHE_FORMATS}")


# Formats of the MLA latent cache. exact: the model dtype, as HF. fp8: FlashMLA's 656 B/token format (e4m3 latent
# with a power-of-two f32 scale per 128 columns, bf16 roped key); attention reads its dequantized values.
LATENT_CACHE_FORMATS = ("exact", "fp8")


def check_latent_cache(latent_cache: str) -> None:
    """Refuse an unknown latent-cache format."""
    if latent_cache not in LATENT_CACHE_FORMATS:
        raise ValueError(f"latent_cache={latent_cache!r} must be one of {LATENT_CACHE_FORMATS}")


# The most tokens the MTP layer drafts a step (vLLM's num_speculative_tokens): its one layer runs again on its own
# output for each draft after the first (chained passes), as vLLM's deepseek_mtp does past the checkpoint's layers.
MAX_SPECULATIVE_TOKENS = 3
# `speculative_config` methods (vLLM's names for DeepSeek's MTP layer).
SPECULATIVE_METHODS = ("mtp", "deepseek_mtp")


def num_speculative_tokens(speculative_config: dict | None) -> int:
    """vLLM's `speculative_config` ({"method": "mtp", "num_speculative_tokens": N}, or None: off) -> N, after
    checking it (ValueError naming what is wrong)."""
    if speculative_config is None:
        return 0
    if not isinstance(speculative_config, dict):
        raise ValueError(f"speculative_config must be a dict, got {type(speculative_config).__name__}")
    unknown = set(speculative_config) - {"method", "num_speculative_tokens"}
    if unknown:
        raise ValueError(f"speculative_config: unsupported fields {sorted(unknown)} (method, "
                         f"num_speculative_tokens)")
    method = speculative_config.get("method")
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_config: method {method!r} is not one of {SPECULATIVE_METHODS} (the "
                         f"model's own MTP layer drafts)")
    n = speculative_config.get("num_speculative_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"speculative_config: num_speculative_tokens must be an int in [1, "
                         f"{MAX_SPECULATIVE_TOKENS}], got {n!r}")
    return n


def kv_layers(cfg: ModelConfig, num_speculative_tokens: int) -> int:
    """Layers whose KV the pools hold: the decoder layers', and the MTP layer's when drafting."""
    return cfg.num_hidden_layers + (1 if num_speculative_tokens else 0)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Paged KV pool (page size, page count, index and latent cache formats), the step programs' buckets and the
    token budget of a step.

    A step runs every running request's decode row and prefill chunks, at most `max_num_batched_tokens` rows in all
    (vLLM's name and meaning). Its program is picked by its row count (`buckets`: the ladder's widths up to the budget,
    the small ones for decode steps, the large ones for steps with prefill chunks); each bucket is one compiled
    program per variant, holding at most `seqs_for(rows)` sequences."""

    page_size: int = 16
    num_pages: int = 64
    max_num_seqs: int = 8
    max_model_len: int = 512
    bucket_ladder: tuple[int, ...] = DEFAULT_BUCKETS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    index_cache: str = "exact"
    latent_cache: str = "exact"
    # Tokens the MTP layer drafts per request and step (speculative decoding); 0: off. When on, the KV pools hold
    # the MTP layer's cache after the decoder layers' (`kv_layers`).
    num_speculative_tokens: int = 0

    def __post_init__(self):
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be in "
                             f"[0, {MAX_SPECULATIVE_TOKENS}]")
        if self.page_size < 1 or self.num_pages < 1 or self.max_num_seqs < 1 or self.max_model_len < 1:
            raise ValueError(f"page_size, num_pages, max_num_seqs, max_model_len must be >= 1: {self}")
        if self.max_num_batched_tokens < self.widest_decode:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_num_seqs="
                             f"{self.max_num_seqs} x {self.sample_group} (every running request may decode in one "
                             f"step, with its drafts)")
        check_index_cache(self.index_cache)
        check_latent_cache(self.latent_cache)
        ladder = self.bucket_ladder
        if not ladder or any(b < 1 for b in ladder) or list(ladder) != sorted(set(ladder)):
            raise ValueError(f"bucket_ladder must be strictly increasing positive ints, got {ladder}")

    @property
    def sample_group(self) -> int:
        """Rows sampled per sequence and step at most: its last, or its last accepted token's and its drafts'."""
        return self.num_speculative_tokens + 1

    @property
    def widest_decode(self) -> int:
        """Rows of the widest step without a prefill chunk: every running request's decode row and its drafts'."""
        return self.max_num_seqs * self.sample_group

    def kv_layers(self, cfg: ModelConfig) -> int:
        """Layers whose KV the pools hold (`kv_layers`)."""
        return kv_layers(cfg, self.num_speculative_tokens)

    @property
    def buckets(self) -> tuple[int, ...]:
        """Row widths of the step programs: the ladder's widths below max_num_batched_tokens, with max_num_seqs (a
        step of every running request's decode row) and max_num_batched_tokens (a full step)."""
        kept = {b for b in self.bucket_ladder if b < self.max_num_batched_tokens}
        return tuple(sorted(kept | {self.max_num_seqs, self.max_num_batched_tokens}))

    def bucket_for(self, rows: int) -> int:
        """Smallest bucket holding `rows` scheduled rows."""
        if not 0 < rows <= self.max_num_batched_tokens:
            raise ValueError(f"{rows=} must be in [1, max_num_batched_tokens={self.max_num_batched_tokens}]")
        return next(b for b in self.buckets if b >= rows)

    def seqs_for(self, rows: int) -> int:
        """Sequences a step of `rows` rows holds (and rows it samples): each has a row, and at most max_num_seqs run."""
        return min(rows, self.max_num_seqs)

    def max_blocks_per_seq(self, dcp: int) -> int:
        """Virtual blocks (page_size * dcp tokens each) a request of max_model_len needs."""
        return -(-self.max_model_len // (self.page_size * dcp))
