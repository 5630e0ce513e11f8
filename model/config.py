"""DSv4 model configuration: one dataclass, named sizes (torchtitan style).

Field names follow Hugging Face `DeepseekV4Config` where one exists (so `from_hf` is a 1:1 copy); the
Megatron-Core name is given in the comment where users meet it. Symbols are those of
`shared/reference/dsv4_architecture.md` §1.

Layer schedule: `compress_ratios[i]` in {0 (window / `W`), m (CSA / `C`), m' (HCA / `H`)} for the main layers,
and one more entry for the MTP layer when `num_nextn_predict_layers > 0` (as in DeepSeek's config.json).
`csa_ratio` and `hca_ratio` say which non-zero value means CSA and which HCA (4 and 128 in the real model;
tiny models use smaller HCA ratios such as 16).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A bad configuration; the message is one line naming the field."""


@dataclass
class DSv4Config:
    # --- sizes (symbols of the spec §1) ---
    vocab_size: int = 129280            # V
    hidden_size: int = 4096             # d            (Megatron: hidden_size)
    num_hidden_layers: int = 43         # L            (Megatron: num_layers)
    num_attention_heads: int = 64       # H
    head_dim: int = 512                 # c            (Megatron: kv_channels / v_head_dim); K = V single head
    qk_rope_head_dim: int = 64          # r            (Megatron: qk_pos_emb_head_dim), last r dims of a head
    q_lora_rank: int = 1024             # d_c
    o_groups: int = 8                   # g
    o_lora_rank: int = 1024             # d_g
    sliding_window: int = 128           # n_win        (Megatron: csa_window_size)
    # --- compressed attention ---
    compress_ratios: list[int] = field(default_factory=lambda: [0, 0] + [4, 128] * 20 + [4] + [0])
    csa_ratio: int = 4                  # m
    hca_ratio: int = 128                # m'
    index_n_heads: int = 64             # n_I          (Megatron: dsa_indexer_n_heads)
    index_head_dim: int = 128           # c_I          (Megatron: dsa_indexer_head_dim)
    index_topk: int = 512               # k            (Megatron: dsa_indexer_topk)
    # --- rope ---
    rope_theta: float = 10000.0         # "main" table: window-only layers and the MTP layer
    compress_rope_theta: float = 160000.0  # "compress" table (CSA/HCA layers, their compressors, indexer)
    rope_scaling: dict | None = field(default_factory=lambda: {
        "type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
        "beta_fast": 32.0, "beta_slow": 1.0})   # applied to the "compress" table only; None = plain
    # --- mHC ---
    hc_mult: int = 4                    # n_hc         (Megatron: num_residual_streams)
    hc_sinkhorn_iters: int = 20         # t_max        (Megatron: mhc_sinkhorn_iterations)
    hc_eps: float = 1e-6
    # --- MoE ---
    n_routed_experts: int = 256         # E            (Megatron: num_experts)
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6        # K            (Megatron: moe_router_topk)
    moe_intermediate_size: int = 2048   # f            (Megatron: moe_ffn_hidden_size)
    dense_intermediate_size: int = 0    # width of a dense `-` MLP layer (HybridModel patterns); 0 = 2*f
    routed_scaling_factor: float = 1.5  # rho          (Megatron: moe_router_topk_scaling_factor)
    num_hash_layers: int = 3            #              (Megatron: moe_n_hash_layers)
    swiglu_limit: float = 10.0          # L_sw         (Megatron: activation_func_clamp_value)
    shared_expert_clamp: bool = False   # DeepSeek's code: unclamped shared expert; HF 5.23: clamped
    moe_layer_pattern: str | None = None  # per layer 'E' (MoE) or '-' (dense MLP); None = all MoE
    hash_seed: int = 1234               # seed of the frozen token-id -> experts table
    expert_bias_update_rate: float = 1e-3   # gamma of auxiliary-loss-free balancing
    seq_aux_loss_coeff: float = 1e-4    # alpha of the sequence-wise balance loss (Megatron: moe_aux_loss_coeff)
    # --- MTP / losses ---
    num_nextn_predict_layers: int = 1   # (Megatron: mtp_num_layers)
    mtp_loss_scaling_factor: float = 0.3
    indexer_loss_coeff: float = 1e-2    # (Megatron: dsa_indexer_loss_coeff)
    indexer_loss_mode: str = "sparse"   # "dense" (warm-up) | "sparse" | "off"
    indexer_teacher: str = "joint"      # "joint" (window+compressed+sink share a denominator) | "renormalized"
    # --- misc ---
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        def need(cond: bool, fld: str, msg: str):
            if not cond:
                raise ConfigError(f"DSv4Config.{fld}: {msg}")

        for f in ("vocab_size", "hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups",
                  "o_lora_rank", "sliding_window", "hc_mult", "n_routed_experts", "num_experts_per_tok",
                  "moe_intermediate_size"):
            need(getattr(self, f) > 0, f, f"must be positive, got {getattr(self, f)}")
        need(self.num_hidden_layers >= 0, "num_hidden_layers", "must be >= 0")
        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", f"must be even, got {self.qk_rope_head_dim}")
        need(self.head_dim >= self.qk_rope_head_dim, "head_dim",
             f"head_dim {self.head_dim} < qk_rope_head_dim {self.qk_rope_head_dim}")
        need(self.index_head_dim >= self.qk_rope_head_dim, "index_head_dim",
             f"index_head_dim {self.index_head_dim} < qk_rope_head_dim {self.qk_rope_head_dim}")
        need(self.num_attention_heads % self.o_groups == 0, "o_groups",
             f"num_attention_heads {self.num_attention_heads} not divisible by o_groups {self.o_groups}")
        need(self.index_topk >= 1, "index_topk", f"must be >= 1, got {self.index_topk}")
        need(self.csa_ratio > 0, "csa_ratio", f"must be positive, got {self.csa_ratio}")
        need(self.hca_ratio > 0, "hca_ratio", f"must be positive, got {self.hca_ratio}")
        need(self.csa_ratio != self.hca_ratio, "hca_ratio", "must differ from csa_ratio")
        need(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
             f"{self.num_experts_per_tok} > n_routed_experts {self.n_routed_experts}")
        n_need = self.num_hidden_layers + self.num_nextn_predict_layers
        need(len(self.compress_ratios) >= n_need, "compress_ratios",
             f"has {len(self.compress_ratios)} entries, need num_hidden_layers + num_nextn_predict_layers = {n_need}")
        for i, r in enumerate(self.compress_ratios):
            need(r in (0, self.csa_ratio, self.hca_ratio), "compress_ratios",
                 f"entry {i} is {r}; allowed 0, csa_ratio {self.csa_ratio}, hca_ratio {self.hca_ratio}")
        need(self.indexer_loss_mode in ("dense", "sparse", "off"), "indexer_loss_mode",
             f"must be dense|sparse|off, got {self.indexer_loss_mode!r}")
        need(self.indexer_teacher in ("joint", "renormalized"), "indexer_teacher",
             f"must be joint|renormalized, got {self.indexer_teacher!r}")
        if self.moe_layer_pattern is not None:
            need(len(self.moe_layer_pattern) >= n_need and set(self.moe_layer_pattern) <= {"E", "-"},
                 "moe_layer_pattern", f"needs {n_need} characters from 'E-', got {self.moe_layer_pattern!r}")

    # ------------------------------------------------------------------ derived
    def layer_kind(self, i: int) -> str:
        """'window' | 'csa' | 'hca' for layer i (i == num_hidden_layers is the MTP layer)."""
        r = self.compress_ratios[i]
        return "window" if r == 0 else ("csa" if r == self.csa_ratio else "hca")

    def is_moe(self, i: int) -> bool:
        return self.moe_layer_pattern is None or self.moe_layer_pattern[i] == "E"

    def is_hash(self, i: int) -> bool:
        return i < self.num_hash_layers and i < self.num_hidden_layers

    @property
    def dense_ffn_size(self) -> int:
        return self.dense_intermediate_size or 2 * self.moe_intermediate_size

    def replace(self, **kw) -> "DSv4Config":
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DSv4Config":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"DSv4Config.{unknown[0]}: unknown field")
        return cls(**d)


# ---------------------------------------------------------------------------------------------------------
# Named sizes. `debug` is for unit tests (fast on 2 CPU cores), `tiny` for CPU training, `proxy` for one
# H200, `flash` / `pro` are the published shapes (build them on the meta device).
# ---------------------------------------------------------------------------------------------------------

def _debug() -> DSv4Config:
    return DSv4Config(
        vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, head_dim=32,
        qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
        compress_ratios=[0, 4, 16, 0], csa_ratio=4, hca_ratio=16,
        index_n_heads=2, index_head_dim=16, index_topk=4,
        rope_scaling={"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
                      "beta_fast": 32.0, "beta_slow": 1.0},
        max_position_embeddings=1024,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_hash_layers=1,
        routed_scaling_factor=1.5,
    )


def _tiny() -> DSv4Config:
    return DSv4Config(
        vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, head_dim=64,
        qk_rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32, sliding_window=16,
        compress_ratios=[0, 4, 16, 4, 0], csa_ratio=4, hca_ratio=16,
        index_n_heads=4, index_head_dim=32, index_topk=8,
        rope_scaling={"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                      "beta_fast": 32.0, "beta_slow": 1.0},
        max_position_embeddings=4096,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, num_hash_layers=1,
    )


def _proxy() -> DSv4Config:
    # One H200 (issue 7): 4 layers, hidden 2048, 16 heads x 512, 16 experts top-4, vocab 32768, window 128,
    # CSA 4 / HCA 128, top-k 512.
    return DSv4Config(
        vocab_size=32768, hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, head_dim=512,
        qk_rope_head_dim=64, q_lora_rank=512, o_groups=4, o_lora_rank=512, sliding_window=128,
        compress_ratios=[0, 4, 128, 4, 0], csa_ratio=4, hca_ratio=128,
        index_n_heads=16, index_head_dim=128, index_topk=512,
        n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=1024, num_hash_layers=1,
    )


def _flash() -> DSv4Config:
    return DSv4Config()  # the defaults are DeepSeek-V4-Flash (config.json of the hub repo)


def _pro() -> DSv4Config:
    return DSv4Config(
        hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, o_groups=16,
        compress_ratios=[128, 128] + [4, 128] * 29 + [4] + [0], index_topk=1024,
        n_routed_experts=384, moe_intermediate_size=3072, routed_scaling_factor=2.5,
    )


NAMED_CONFIGS = {"debug": _debug, "tiny": _tiny, "proxy": _proxy, "flash": _flash, "pro": _pro}


def get_config(name: str, **overrides) -> DSv4Config:
    """A named config (debug|tiny|proxy|flash|pro), optionally with field overrides."""
    if name not in NAMED_CONFIGS:
        raise ConfigError(f"config: unknown name {name!r}; known: {', '.join(NAMED_CONFIGS)}")
    cfg = NAMED_CONFIGS[name]()
    return cfg.replace(**overrides) if overrides else cfg


def yarn_correction_range(rope_dim: int, base: float, original_max_pos: float, beta_fast: float,
                          beta_slow: float) -> tuple[int, int]:
    """(low, high) pair indices of the YaRN ramp: floor / ceil of the correction dims, clamped to [0, r-1]
    (spec §5.6; the one copy, used by model/rope.py's tables)."""
    def corr(nrot: float) -> float:
        return rope_dim * math.log(original_max_pos / (nrot * 2 * math.pi)) / (2 * math.log(base))

    return max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), rope_dim - 1)


def yarn_low_high(cfg: DSv4Config) -> tuple[int, int] | None:
    """YaRN ramp bounds of a config's compress table (spec §5.6); (15, 25) for Flash/Pro. None without YaRN."""
    rs = cfg.rope_scaling
    if not rs:
        return None
    return yarn_correction_range(cfg.qk_rope_head_dim, cfg.compress_rope_theta, rs["original_max_position_embeddings"],
                                 rs["beta_fast"], rs["beta_slow"])
