"""HybridModel layer patterns -> DSv4Config (slice D4; Megatron `hybrid_layer_allocation.py` symbols, §2.2).

Symbols: `W` window (ratio 0), `C` CSA (cfg.csa_ratio), `H` HCA (cfg.hca_ratio) -- each starts a layer and
must be followed by its FFN symbol `E` (MoE) or `-` (dense MLP); `|` cuts pipeline stages between layers;
`/` starts one MTP layer (after it: one attention + one FFN symbol). Example `WEC-|H-C-/W-`: 4 main layers
(W+E, C+-, H+-, C+-), stages [[0, 1], [2, 3]], one MTP layer W+- (on the last stage).

Also: `count_params(cfg)` -- total / active parameter counts from the shapes (spec §2.1, §11.3), used by the
FLOP accounting and checked against a meta-device module.
"""
from __future__ import annotations

from dataclasses import dataclass

from dsv4.model.config import ConfigError, DSv4Config, get_config

ATTN = {"W", "C", "H"}
FFN = {"E", "-"}


@dataclass
class HybridLayout:
    cfg: DSv4Config
    stages: list[list[int]]        # main-layer indices per pipeline stage (MTP layers go with the last stage)
    pattern: str


def parse_pattern(pattern: str, base: DSv4Config | str = "flash", **overrides) -> HybridLayout:
    """Pattern string -> HybridLayout(cfg, stages). Bad patterns raise ConfigError naming the position."""
    base = get_config(base) if isinstance(base, str) else base
    ratio = {"W": 0, "C": base.csa_ratio, "H": base.hca_ratio}
    main, mtp, stages, cur = [], [], [], []
    in_mtp, i = False, 0

    def bad(pos, msg):
        raise ConfigError(f"hybrid pattern {pattern!r}: position {pos} ({pattern[pos] if pos < len(pattern) else 'end'!r}): {msg}")

    if not pattern:
        raise ConfigError("hybrid pattern: empty")
    while i < len(pattern):
        ch = pattern[i]
        if ch == "|":
            if in_mtp:
                bad(i, "pipeline cut '|' inside the MTP part")
            if not cur:
                bad(i, "empty pipeline stage")
            stages.append(cur)
            cur = []
            i += 1
        elif ch == "/":
            if in_mtp and (i == 0 or pattern[i - 1] == "/"):
                bad(i, "empty MTP layer")
            in_mtp = True
            i += 1
        elif ch in ATTN:
            if i + 1 >= len(pattern) or pattern[i + 1] not in FFN:
                bad(i + 1, f"attention symbol {ch!r} must be followed by an FFN symbol 'E' or '-'")
            layer = (ratio[ch], pattern[i + 1])
            if in_mtp:
                if len(mtp) >= pattern[:i].count("/"):
                    bad(i, "one layer per MTP depth ('/W-/W-' for two)")
                mtp.append(layer)
            else:
                cur.append(len(main))
                main.append(layer)
            i += 2
        elif ch in FFN:
            bad(i, f"FFN symbol {ch!r} without an attention symbol before it")
        else:
            bad(i, "unknown symbol; allowed W C H E - | /")
    if not main:
        raise ConfigError(f"hybrid pattern {pattern!r}: no main layers")
    if not cur:
        bad(len(pattern) - 1 if not in_mtp else pattern.index("/") - 1, "empty last pipeline stage")
    stages.append(cur)
    if in_mtp and len(mtp) != pattern.count("/"):
        bad(len(pattern), "an MTP separator '/' without a layer after it")
    layers = main + mtp
    moe = "".join(f for _, f in layers)
    cfg = base.replace(num_hidden_layers=len(main), num_nextn_predict_layers=len(mtp),
                       compress_ratios=[r for r, _ in layers],
                       moe_layer_pattern=None if set(moe) == {"E"} else moe,
                       num_hash_layers=min(base.num_hash_layers, len(main)), **overrides)
    return HybridLayout(cfg, stages, pattern)


def config_from_ratios(ratios: list[int], base: DSv4Config | str = "flash", n_mtp: int = 1,
                       moe_layer_pattern: str | None = None, **overrides) -> DSv4Config:
    """Per-layer compress-ratio list (main layers, then MTP layers) -> DSv4Config."""
    base = get_config(base) if isinstance(base, str) else base
    L = len(ratios) - n_mtp
    if L < 1:
        raise ConfigError(f"compress_ratios: {len(ratios)} entries leave no main layer with {n_mtp} MTP layer(s)")
    return base.replace(num_hidden_layers=L, num_nextn_predict_layers=n_mtp, compress_ratios=list(ratios),
                        moe_layer_pattern=moe_layer_pattern, num_hash_layers=min(base.num_hash_layers, L),
                        **overrides)


def to_pattern(cfg: DSv4Config, stages: list[list[int]] | None = None) -> str:
    """DSv4Config -> pattern string (inverse of parse_pattern for the same csa/hca ratios)."""
    sym = {"window": "W", "csa": "C", "hca": "H"}
    L = cfg.num_hidden_layers
    cuts = {s[0] for s in (stages or [])[1:]}
    out = ""
    for i in range(L + cfg.num_nextn_predict_layers):
        if i in cuts:
            out += "|"
        if i >= L:
            out += "/"
        out += sym[cfg.layer_kind(i)] + ("E" if cfg.is_moe(i) else "-")
    return out


# ---------------------------------------------------------------------------------------------------------
# parameter counts (spec §2.1: Flash ~284B total / 13B active, Pro ~1.6T / 49B)
# ---------------------------------------------------------------------------------------------------------

def _attn_params(cfg: DSv4Config, i: int) -> int:
    d, H, c, dc, g, dg = (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups,
                          cfg.o_lora_rank)
    n = d * dc + dc + dc * H * c + d * c + c + (H * c // g) * g * dg + g * dg * d + H
    kind = cfg.layer_kind(i)
    if kind != "window":
        m, coff = cfg.compress_ratios[i], 2 if kind == "csa" else 1
        n += m * coff * c + 2 * coff * c * d + c                          # compressor ape, wkv, wgate, norm
    if kind == "csa":
        cI, nI = cfg.index_head_dim, cfg.index_n_heads
        n += cfg.csa_ratio * 2 * cI + 2 * 2 * cI * d + cI                  # indexer compressor
        n += nI * cI * dc + nI * d                                         # wq_b, weights_proj
    return n


def _ffn_params(cfg: DSv4Config, i: int) -> tuple[int, int]:
    """(total, active) parameters of layer i's FFN."""
    d, f, E, K = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    if not cfg.is_moe(i):
        n = 3 * d * cfg.dense_ffn_size
        return n, n
    shared = 3 * d * f * cfg.n_shared_experts
    return E * d + E * 3 * d * f + shared, E * d + K * 3 * d * f + shared


def count_params(cfg: DSv4Config) -> dict:
    """Parameter counts from the config's shapes (buffers such as tid2eid / expert bias excluded).

    Keys: total (incl. MTP), total_main (no MTP), mtp, active (per token, no MTP, incl. embedding and head),
    active_no_embed (active minus the input embedding), embedding, head, attention, ffn, mhc.
    """
    d, n, V, L = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size, cfg.num_hidden_layers
    mhc_sub = (2 + n) * n * n * d + (2 + n) * n + 3
    head_mhc = n * n * d + n + 1
    attn = ffn = ffn_active = 0
    for i in range(L):
        attn += _attn_params(cfg, i)
        t, a = _ffn_params(cfg, i)
        ffn, ffn_active = ffn + t, ffn_active + a
    mhc = L * 2 * mhc_sub + head_mhc
    norms = L * 2 * d + d
    embed, head = V * d, V * d
    total_main = embed + head + attn + ffn + mhc + norms
    mtp = 0
    for k in range(cfg.num_nextn_predict_layers):
        j = L + k
        mtp += _attn_params(cfg, j) + _ffn_params(cfg, j)[0] + 2 * mhc_sub + 2 * d    # block
        mtp += 2 * d * d + 3 * d + head_mhc                                               # e/h_proj, norms, head mHC
    active = embed + head + attn + ffn_active + mhc + norms
    return {"total": total_main + mtp, "total_main": total_main, "mtp": mtp, "active": active,
            "active_no_embed": active - embed, "embedding": embed, "head": head, "attention": attn,
            "ffn": ffn, "mhc": mhc}
