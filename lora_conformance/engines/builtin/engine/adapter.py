"""Read a PEFT LoRA adapter directory into host tensors packed for the slot pool.

Format is checked first by the shared validator (adapters/validate.py: AdapterFormatError naming
file and field); then unsupported features (DoRA, modules_to_save, bias) -> UnsupportedFeatureError.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from lora_conformance.checkpoints import module_rank_alpha, pattern_value, split_lora_key
from lora_conformance.engines.base import AdapterFormatError, AdapterIncompatibleError, UnsupportedFeatureError
from lora_conformance.engines.builtin.engine.plan import AdapterRules
from lora_conformance.engines.builtin.variants import Variant


@dataclass
class PackedLora:
    """One module's LoRA, zero-padded to the pool rank. Shapes depend on the module kind:
    linear A (R, in) / Bt (R, out); embedding At (vocab, R) / Bt (R, hidden);
    expert A (E, R, in) / Bt (E, R, out)."""

    A: torch.Tensor
    Bt: torch.Tensor
    rank: int


@dataclass
class HostAdapter:
    name: str
    path: Path
    identity: str  # content hash: what the prefix cache keys on
    modules: dict[str, PackedLora] = field(default_factory=dict)

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)


def _check_config(cfg: dict, path: Path) -> None:
    where = f"{path}/adapter_config.json"
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterIncompatibleError(f"adapter {path}: peft_type={cfg.get('peft_type')!r} in {where}; only LORA")
    if cfg.get("use_dora"):
        raise UnsupportedFeatureError(f"DoRA (use_dora=true in {where}) is not supported by the builtin engine")
    if cfg.get("modules_to_save"):
        raise UnsupportedFeatureError(
            f"modules_to_save={cfg['modules_to_save']!r} in {where} is not supported by the builtin engine"
        )
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        raise UnsupportedFeatureError(f"LoRA bias (bias={cfg.get('bias')!r}, lora_bias in {where}) is not supported")
    if cfg.get("trainable_token_indices"):
        raise UnsupportedFeatureError(f"trainable_token_indices in {where} is not supported by the builtin engine")


# The adapter config fields PEFT's scaling is computed from.
SCALING_FIELDS = ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern")


def load_adapter_dir(name: str, path: Path, model_modules: dict, max_rank: int, rules: AdapterRules, dtype,
                     pin: bool, model_dir: Path, scaling_config: Optional[dict] = None) -> HostAdapter:
    """model_modules: our module name -> ('linear'|'embedding'|'expert', module); rules: how the
    scaling is computed, which modules are packed and how the factors are stored (engine/plan.py);
    scaling_config: the ``SCALING_FIELDS`` the scaling is read from (None: the adapter's own; another
    adapter's only under the fault reload_keeps_first_scaling).

    The shared validator (adapters/validate.py) runs first: malformed files, shapes of another
    model, non-finite values, config/tensor rank mismatches and ranks over max_rank are refused
    with AdapterFormatError before anything is packed, and so are values that would not be finite
    in ``dtype`` (the pool's): one Inf in the pool makes NaN of every row of a masked batched GEMM
    (0 * Inf), the base's and other adapters' included. The packed tensors are checked again,
    since what is stored (scaling folded into B, variants) is what the pool holds."""
    from lora_conformance.adapters.validate import validate_adapter

    path = Path(path)
    checked = validate_adapter(path, model_dir, max_rank, str(dtype).replace("torch.", ""))
    cfg, tensors = checked.config, checked.tensors
    _check_config(cfg, path)
    if any(k.endswith("lora_magnitude_vector") for k in tensors):
        raise UnsupportedFeatureError(f"DoRA magnitude vectors in {path} are not supported by the builtin engine")

    scfg = cfg if scaling_config is None else {**{k: v for k, v in cfg.items() if k not in SCALING_FIELDS},
                                               **scaling_config}
    (r0, alpha0), rs = module_rank_alpha(scfg), bool(scfg.get("use_rslora", False))
    rank_pat, alpha_pat = scfg.get("rank_pattern") or {}, scfg.get("alpha_pattern") or {}
    targets = cfg.get("target_modules")
    tparams = list(cfg.get("target_parameters") or [])
    if isinstance(targets, list):
        names = list(model_modules)
        for t in targets:
            if not any(n == t or n.endswith("." + t) for n in names):
                raise AdapterIncompatibleError(
                    f"adapter {path}: target_modules entry {t!r} matches no module of this model"
                )

    pairs: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        lk = split_lora_key(key)
        if not lk.factor:
            continue  # base_layer copies of embed_tokens/lm_head and the like
        mod = lk.module[len("bert."):] if lk.module.startswith("bert.") else lk.module
        pairs.setdefault((mod, lk.depth), {})[("emb" if lk.embedding else "") + lk.factor] = t

    ad = HostAdapter(name=name, path=path, identity="")
    for (mod, depth), ts in sorted(pairs.items()):
        target = mod if mod in model_modules else _expert_target(mod, ts, tparams, model_modules)
        if target not in model_modules:
            raise AdapterIncompatibleError(
                f"adapter {path}: target_modules/target_parameters names module {mod!r}, which this model lacks"
            )
        kind_m, module = model_modules[target]
        if rules.drops(target, kind_m):  # only under a drop fault
            continue
        A, B = (ts.get("embA"), ts.get("embB")) if kind_m == "embedding" else (ts.get("A"), ts.get("B"))
        if A is None or B is None:
            raise AdapterIncompatibleError(f"adapter {path}: module {mod!r} lacks its lora_A or lora_B tensor")
        E = module.weight.shape[0] if kind_m == "expert" else 1
        r = A.shape[0] // E
        if r > max_rank:
            field_ = "rank_pattern" if pattern_value(rank_pat, target, None) is not None else "r"
            raise AdapterIncompatibleError(
                f"adapter {path}: rank {r} of {target} ({field_} in adapter_config.json) exceeds max_rank={max_rank}"
            )
        key_for_patterns = mod if kind_m == "expert" else target
        rm, am = ((checked.module_params.get(key_for_patterns) if scaling_config is None else None)
                  or module_rank_alpha(scfg, key_for_patterns))
        scale = rules.scaling.of(r0, alpha0, rm, am, rs)
        if rules.rank_tile and E == 1 and r >= rules.rank_tile[0]:  # only under fault rank_ge_128_truncated
            A = A.clone()
            A[rules.rank_tile[1]:] = 0
        A, B = _stored_factors(A.float(), B.float(), rules.variant, dtype, E)
        packed = _pack(kind_m, module, A, B, r, E, scale, max_rank, dtype, path, target)
        for what, t in (("lora_A", packed.A), ("lora_B x scaling", packed.Bt)):
            if not bool(torch.isfinite(t).all()):
                raise AdapterFormatError(checked.weights_file, f"{target}.{what}",
                                         f"not finite once stored in the engine's {str(dtype).replace('torch.', '')} "
                                         f"pool (scaling {scale:.3g}); expected values finite in that dtype")
        ad.modules[target] = packed
    if pin:
        for m in ad.modules.values():
            m.A, m.Bt = m.A.pin_memory(), m.Bt.pin_memory()
    h = hashlib.sha256(checked.weights_sha256.encode())
    h.update(json.dumps({"r": r0, "a": alpha0, "rs": rs, "rp": rank_pat, "ap": alpha_pat}, sort_keys=True).encode())
    ad.identity = h.hexdigest()[:32]
    return ad


def _expert_target(mod: str, ts: dict, tparams: list[str], model_modules: dict) -> str:
    """Which fused expert parameter a (nested) ParamWrapper's tensors belong to.

    Nesting depth follows the order PEFT applied the wrappers, which the saved config does not
    reliably preserve, so match by shape: gate_up (E, 2I, H) takes lora_A (r*E, H) and lora_B
    (2I, r*E); down (E, H, I) takes (r*E, I) and (H, r*E). The two never both fit.
    """
    A, B = ts.get("A"), ts.get("B")
    for p in tparams:
        owner, _, pname = p.rpartition(".")
        cand = f"{mod}.{pname}"
        if not mod.endswith(owner) or cand not in model_modules or A is None or B is None:
            continue
        E, out_f, in_f = model_modules[cand][1].weight.shape
        if A.shape[1] == in_f and B.shape[0] == out_f and A.shape[0] % E == 0:
            return cand
    return mod


def _stored_factors(A: torch.Tensor, B: torch.Tensor, variant: Variant, dtype,
                    experts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 factors to pack. Variants (benign: B @ A is unchanged in exact arithmetic):
    rescale:C stores (C*A, B/C); preround rounds both to the model dtype first, so B is rounded
    again once the scaling is folded in; svd rebuilds both from an SVD of B @ A (per expert:
    lora_A (r*E, in) is grouped by expert, lora_B (out, r*E) by rank)."""
    if variant.on("svd"):
        A2, B2 = svd_factors(A, B, experts)
        return A2.float(), B2.float()
    if variant.on("rescale"):
        return A * variant.factor, B / variant.factor
    if variant.on("preround"):
        return A.to(dtype).float(), B.to(dtype).float()
    return A, B


def svd_factors(A: torch.Tensor, B: torch.Tensor, E: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """lora_A and lora_B rebuilt from an SVD of B @ A, per expert (B = U sqrt(S), A = sqrt(S) V^T), in
    float64: the same delta from other factors (variant svd; bench/power.py's svd rewriting). lora_A
    (r*E, in) is grouped by expert, lora_B (out, r*E) by rank."""
    r = A.shape[0] // E
    Ae, Be = A.double().view(E, r, -1), B.double().view(B.shape[0], r, E).permute(2, 0, 1)  # (E, r, in), (E, out, r)
    outA, outB = [], []
    for a, b in zip(Ae, Be):
        U, S, Vh = torch.linalg.svd(b @ a, full_matrices=False)
        root = S[:r].sqrt()
        outA.append(root[:, None] * Vh[:r])
        outB.append(U[:, :r] * root)
    return torch.cat(outA), torch.stack(outB).permute(1, 2, 0).reshape(B.shape[0], r * E)


def _pack(kind, module, A, B, r, E, scale, R, dtype, path, target) -> PackedLora:
    def bad(what):
        return AdapterIncompatibleError(f"adapter {path}: {target} {what} does not fit the base model's shape")

    from lora_conformance.engines.builtin.layers.parallel import full_features

    if kind == "linear":
        n_in, n_out = full_features(module)  # the checkpoint module's, where this rank holds a shard
        if A.shape[1] != n_in or B.shape != (n_out, r):
            raise bad(f"lora_A {tuple(A.shape)} / lora_B {tuple(B.shape)}")
        Ap = torch.zeros(R, A.shape[1]); Ap[:r] = A  # noqa: E702
        Bp = torch.zeros(R, B.shape[0]); Bp[:r] = (B * scale).t()  # noqa: E702
    elif kind == "embedding":  # lora_embedding_A (r, vocab), lora_embedding_B (hidden, r)
        vocab, hidden = full_features(module)
        if A.shape[1] != vocab or B.shape != (hidden, r):
            raise bad(f"lora_embedding_A {tuple(A.shape)} / lora_embedding_B {tuple(B.shape)}")
        Ap = torch.zeros(A.shape[1], R); Ap[:, :r] = A.t()  # noqa: E702
        Bp = torch.zeros(R, B.shape[0]); Bp[:r] = (B * scale).t()  # noqa: E702
    else:  # expert: lora_A (r*E, in) grouped by expert; lora_B (out, r*E) grouped by rank
        _, out_f, in_f = module.weight.shape
        if A.shape != (r * E, in_f) or B.shape != (out_f, r * E):
            raise bad(f"lora_A {tuple(A.shape)} / lora_B {tuple(B.shape)}")
        Ae = A.view(E, r, in_f)
        Be = B.view(out_f, r, E).permute(2, 1, 0)  # (E, r, out) = B_e^T
        Ap = torch.zeros(E, R, in_f); Ap[:, :r] = Ae  # noqa: E702
        Bp = torch.zeros(E, R, out_f); Bp[:, :r] = Be * scale  # noqa: E702
    return PackedLora(Ap.to(dtype).contiguous(), Bp.to(dtype).contiguous(), r)


def model_lora_modules(model) -> dict:
    """Our LoRA-capable modules by name, with their kind."""
    from lora_conformance.engines.builtin.layers.embedding import LoraEmbedding
    from lora_conformance.engines.builtin.layers.linear import LoraLinear
    from lora_conformance.engines.builtin.models.moe import ExpertParam

    out = {}
    for n, m in model.named_modules():
        if isinstance(m, LoraLinear):
            out[n] = ("linear", m)
        elif isinstance(m, LoraEmbedding):
            out[n] = ("embedding", m)
        elif isinstance(m, ExpertParam):
            out[n] = ("expert", m)
    return out
