"""Offline synthetic base models: small, deterministic, and calibrated for greedy stability.

Why not a random init: with std-0.02 Gaussian weights the next-token logits are a
Gaussian cloud, the top-1/top-2 logprob gap is 0.005-0.11 at the first step, and bf16
diverges from fp32 within 16 tokens on 5 of the 16 default prompts. Conformance needs
greedy outputs that only change when the *adapter* changes, not when rounding does.

Design (``design.py`` has the layout): the vocabulary is a 32 x 32 grid and the logits
factor as ``class score + member score``. Each score is a sum of discrete terms — the
successor of the current token (a single 31-/32-cycle, so no short loops) plus a vote
from the previous token carried by sharp previous-token heads in layer 0 (RoPE-only
q/k, so attention does not depend on content). Vote strengths come from {0.5, 1.5}
against 1.0 for the successor, so every base-model decision has a gap of >= 0.5 "units"
(``logit_scale`` nats per unit before the final norm's shrink). Layers 1..n and all
MLPs are random with small outputs: they are LoRA targets and add realism, but cannot
move a decision by more than a few percent of a unit. The gains sit downstream of
q_proj/v_proj (in k_proj and o_proj), so a rank-8 LoRA with B std ~0.03 on q/v moves
the votes and attention by a sizeable fraction of a unit: adapters do change outputs.

Measured (``python bench/model_margins.py``), 16 default prompts x 16 greedy steps:
base model fp32 top-1/top-2 margin min 1.45, p1 2.57, median 4.48 nats; bf16 and fp16
give the fp32 tokens on all 16 prompts; 16 distinct continuations. bf16 moves a gap by
<= 0.06 nats (the logits are shifted so the likely winners sit near 0, where bf16 is
finer). With q/v adapters the votes move continuously, so near-ties come back: see
lora_conformance.adapters for the adapter numbers and how the default seeds were chosen.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lora_conformance.models import design
from lora_conformance.models.tokenizer import build_tokenizer, load_words, words_as_added_tokens

# Bump when the generated weights change for the same recipe: it is part of the cache key.
CODE_VERSION = 1


@dataclass(frozen=True)
class DecoderRecipe:
    seed: int = 0
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 512
    max_positions: int = 512
    rope_theta: float = 10000.0
    # embedding component norms (|E| = sqrt(hidden), so RMSNorm is the identity at layer 0)
    bias_norm: float = 6.0
    class_norm: float = 8.0
    member_norm: float = 8.0
    logit_scale: float = 12.0  # nats per unit gap, before the final norm
    logit_shift: float = 2.0  # units subtracted from every logit (see decoder_state)
    vote_weak: float = 0.5
    vote_strong: float = 1.5
    value_scale: float = 0.35  # previous-token value entries; gain is in o_proj
    q_scale: float = 1.0  # |q| of previous-token heads; gain is in k_proj
    attn_peak: float = 48.0  # peak previous-token score (nats); gap = 17% of it
    rotary_pairs: int = 6
    noise_out: float = 0.02  # residual output std of random layers / MLPs, per unit
    init_std: float = 0.02
    experts: int = 0  # > 0: Mixtral-style MoE, top-2
    expert_intermediate: int = 256
    # Qwen2-style: q/k/v biases of this std and tied embeddings (see tied_embedding, current_token_heads)
    arch: str = "llama"
    tied: bool = False
    qkv_bias_std: float = 0.0
    # The real shapes (profile full): a vocabulary of this size (0: the 32 x 32 grid alone). Ids past
    # the grid are filler tokens of the tokenizer, never in a prompt, pushed down like class 0.
    vocab: int = 0
    top_k_experts: int = 2

    def to_dict(self) -> dict:
        # Fields added later are left out at their defaults: the older kinds keep their cache keys.
        d = asdict(self)
        for k, default in (("arch", "llama"), ("tied", False), ("qkv_bias_std", 0.0), ("vocab", 0),
                           ("top_k_experts", 2)):
            if d[k] == default:
                del d[k]
        return d


# What the real shapes share (see DECODER_KINDS).
_REAL = {"arch": "qwen2", "qkv_bias_std": 0.1, "head_dim": 128, "rope_theta": 1e6, "rotary_pairs": 12,
         "attn_peak": 96.0, "max_positions": 32768}

# synthetic:<kind> -> the decoder recipe's non-default fields (encoder is built apart).
DECODER_KINDS: dict[str, dict] = {
    "llama": {},
    "moe": {"experts": 4},
    "llama-hd128": {"head_dim": 128},  # the fused rotary paths' head sizes (ours are 64 otherwise)
    "llama-hd256": {"head_dim": 256},
    "qwen2": {"arch": "qwen2", "tied": True, "qkv_bias_std": 0.1},
    # Real shapes (models/profiles.py, profile full), weights random as above with the same design:
    # RoPE theta 1e6 and 12 rotary pairs keep the previous-token heads' peak unique over 9,000
    # positions (design.rotary_gap: 11% of a 96-nat peak); the random weights' std is scaled by
    # sqrt(256 / hidden) so pre-activations (MLP gates, random attention) keep the 256-wide design's
    # size (at 0.02 a 1536-wide MLP's output was 6x the design's: greedy margins fell to 0.002 nats),
    # and the random layers' output noise by sqrt(4 / layers) so 28 layers add what 4 did. Qwen2.5-1.5B ties its embeddings; this
    # one does not (the tied layout is synthetic:qwen2's), so lm_head LoRA sees a separate matrix.
    "qwen2.5-1.5b": {**_REAL, "hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2, "intermediate": 8960,
                     "vocab": 151936, "noise_out": 0.02 * math.sqrt(4 / 28), "init_std": 0.02 * math.sqrt(256 / 1536)},
    "qwen2.5-7b": {**_REAL, "hidden": 3584, "layers": 28, "heads": 28, "kv_heads": 4, "intermediate": 18944,
                   "vocab": 152064, "noise_out": 0.02 * math.sqrt(4 / 28), "init_std": 0.02 * math.sqrt(256 / 3584)},
    # 64 experts of Qwen1.5-MoE-A2.7B's expert width (1408) at its hidden size, top-2 as our MoE design;
    # two layers (24 would be 13 B expert parameters in float32 for the reference).
    "moe-64e": {"head_dim": 128, "rope_theta": 1e6, "rotary_pairs": 12, "attn_peak": 96.0, "max_positions": 32768,
                "hidden": 2048, "layers": 2, "heads": 16, "kv_heads": 4, "experts": 64, "expert_intermediate": 1408,
                "vocab": 151936, "init_std": 0.02 * math.sqrt(256 / 2048)},
}


def _gen(seed: int, stream: int) -> torch.Generator:
    # Independent, stable streams per purpose, so changing one part leaves the rest alone.
    return torch.Generator().manual_seed(seed * 1000003 + stream)


def decoder_state(r: DecoderRecipe, vocab_size: int) -> dict[str, torch.Tensor]:
    """The full state dict (HF Llama / Mixtral names, fused MoE experts)."""
    G, H, hd = design.GRID, r.hidden, r.head_dim
    assert vocab_size == (r.vocab or G * G), f"vocab must be {r.vocab or G * G}, got {vocab_size}"
    basis = design.hadamard_basis(H, _gen(r.seed, 1))
    d = basis[:, 0]
    X, Y, Z, W = (basis[:, 1 + i * G : 1 + (i + 1) * G] for i in range(4))
    rest = basis[:, 1 + 4 * G :]
    ids = torch.arange(vocab_size)
    # Ids past the grid (filler tokens) are class 0 like the specials: never predicted.
    cls, mem = torch.where(ids < G * G, ids // G, 0), ids % G

    if r.tied:
        # input codes, the class-0 push direction, a constant filler direction
        Xi, Yi, push, c0 = rest[:, :G], rest[:, G: 2 * G], rest[:, 2 * G], rest[:, 2 * G + 1]
        emb, fill = tied_embedding(r, d, X, Y, Z, W, Xi, Yi, push, c0, cls, mem)
    else:
        # Embeddings: same norm for every token; filler fills the remaining norm.
        filler = rest @ torch.randn(rest.shape[1], vocab_size, generator=_gen(r.seed, 2), dtype=torch.float64)
        filler = filler / filler.norm(dim=0, keepdim=True)
        f_norm = math.sqrt(H - r.bias_norm**2 - r.class_norm**2 - r.member_norm**2)
        emb = (r.bias_norm * d[:, None] + r.class_norm * X[:, cls] + r.member_norm * Y[:, mem] + f_norm * filler).T

    # Successor maps (class 0 holds the specials and is never predicted) and vote tables.
    g = _gen(r.seed, 3)
    succ_c = design.single_cycle(G - 1, g, offset=1)
    succ_m = design.single_cycle(G, g)
    vote_c = torch.randint(1, G, (G,), generator=g)  # previous class -> voted class
    vote_m = torch.randint(0, G, (G,), generator=g)
    strong = lambda: torch.where(torch.rand(G, generator=g) < 0.5, r.vote_strong, r.vote_weak)  # noqa: E731
    kappa_c, kappa_m = strong().double(), strong().double()

    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": emb}
    rnd = _gen(r.seed, 4)

    def randn(*shape, std=r.init_std):
        return torch.randn(*shape, generator=rnd, dtype=torch.float64) * std

    # One "unit" of residual signal along a code direction is class_norm (= member_norm).
    unit = r.class_norm
    for layer in range(r.layers):
        p = f"model.layers.{layer}."
        q, k = randn(r.heads * hd, H), randn(r.kv_heads * hd, H)
        v, o = randn(r.kv_heads * hd, H), randn(H, r.heads * hd)
        # Random o_proj: scale so its residual output has std noise_out * unit per code direction.
        o = o / (o.std() * math.sqrt(r.heads * hd) * 0.32) * r.noise_out * unit
        if layer == 0:
            qv, kv = design.previous_token_rotary(hd, r.rope_theta, r.rotary_pairs, r.attn_peak)
            qv, kv = qv * r.q_scale / qv.norm(), kv * (r.attn_peak * math.sqrt(hd) / (r.q_scale * kv.norm()))
            # kv head 0 -> heads 0, 1 carry the previous class; kv head 1 -> heads 2, 3 the member.
            codes = [(X, r.class_norm), (Y, r.member_norm)] if not r.tied else [(Xi, TIED_CODE), (Yi, TIED_CODE)]
            for kvh, ((code, ncode), votes, kappa, target) in enumerate(
                [(codes[0], vote_c, kappa_c, Z), (codes[1], vote_m, kappa_m, W)]
            ):
                k[kvh * hd : (kvh + 1) * hd] = torch.outer(kv, d) / r.bias_norm
                v[kvh * hd : kvh * hd + G] = code.T * (r.value_scale / ncode)
                v[kvh * hd + G : (kvh + 1) * hd] *= 0.1
                # Only the first head of each group votes (two voting heads could split a vote into
                # ties); the other heads keep q/v and a small random o_proj, like layers 1..n.
                group = r.heads // r.kv_heads
                for j in range(group):
                    h = kvh * group + j
                    q[h * hd : (h + 1) * hd] = torch.outer(qv, d) / r.bias_norm
                h = kvh * group
                o[:, h * hd : (h + 1) * hd] = 0
                o[:, h * hd : h * hd + G] = target[:, votes] * (kappa * unit / r.value_scale)
                if r.tied:  # the group's second head reads the current token: successor, cancellations
                    succ, out_code = (succ_c, X) if kvh == 0 else (succ_m, Y)
                    extra = torch.zeros(H, G, dtype=torch.float64)
                    if kvh == 0:  # per class: its own filler and push cancelled; every token: -PUSH_H along push
                        extra -= c0[:, None] * fill[None, :] + PUSH_H * push[:, None]
                        extra[:, 0] -= PUSH_ROW * push
                    current_token_heads(r, q, o, h + 1, qv, d, out_code, target, code, TIED_CODE, succ, unit, extra)
        _biases(sd, p, r, layer, randn)
        sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"] = q, k
        sd[p + "self_attn.v_proj.weight"], sd[p + "self_attn.o_proj.weight"] = v, o
        sd[p + "input_layernorm.weight"] = torch.ones(H, dtype=torch.float64)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(H, dtype=torch.float64)
        _mlp(sd, p, r, randn, unit)
        if r.tied:  # tied readout reads the input codes at norm cn_in: keep the random writers' noise off them
            Pin = torch.cat([Xi, Yi], dim=1)
            for key in ([p + "self_attn.o_proj.weight"] if layer else []) + [p + "mlp.down_proj.weight"]:
                sd[key] = sd[key] - Pin @ (Pin.T @ sd[key])
        # The layer is final: keep it in float32 from here (what is returned), so a real shape holds its
        # layers once in float32 and one layer in float64, not every layer in both (25 GB peak for
        # qwen2.5-1.5b before, past a 24 GiB machine). The values are the same: each is rounded once.
        for key in [k for k in sd if k.startswith(p)]:
            sd[key] = sd[key].float().contiguous()

    sd["model.norm.weight"] = torch.ones(H, dtype=torch.float64)
    if r.tied:
        sd["lm_head.weight"] = emb
        return {k: v.float().contiguous() for k, v in sd.items()}
    # lm_head: successor terms read X/Y, vote terms read Z/W; class 0 is pushed far down via d.
    inv_c = torch.argsort(succ_c)
    inv_m = torch.argsort(succ_m)
    head = (X[:, inv_c[cls]] + Z[:, cls]) + (Y[:, inv_m[mem]] + W[:, mem])
    head = head.T * (r.logit_scale / unit)
    # Centre the likely winners near 0: bf16 logits are rounded to 2^-8 of their magnitude.
    head -= d * (r.logit_shift * r.logit_scale / r.bias_norm)
    head[cls == 0] -= d * (4 * r.logit_scale * (r.vote_strong + 1) * unit / r.bias_norm)
    sd["lm_head.weight"] = head
    return {k: v.float().contiguous() for k, v in sd.items()}


# Tied kinds: class 0 (the specials) is never predicted. Its rows carry PUSH_ROW along a spare
# direction and every token's h carries -PUSH_H there: class 0's logits drop by about 50 nats.
PUSH_ROW, PUSH_H = 10.0, 5.0
# The input codes' norm: small, since layer 0 cancels them again and bf16 leaves ~0.4 % of what
# it cancels, which the tied readout would read back at this norm.
TIED_CODE = 2.0


def tied_embedding(r: DecoderRecipe, d, X, Y, Z, W, Xi, Yi, push, c0, cls, mem):
    """One matrix for embed_tokens and lm_head (Qwen2's tie_word_embeddings). Token u's row holds
    input codes Xi[c_u], Yi[m_u] (what layer 0 reads), readout codes rho * (X + Z)[c_u] and
    rho * (Y + W)[m_u] (what its logit reads: rho = logit_scale / unit, as the untied lm_head) and
    the bias direction d; no filler, whose self-overlap would favour repeating the current token.
    A constant filler direction c0 takes the norm that is left (every row has norm sqrt(hidden);
    a constant's self-overlap shifts every logit alike); class 0's rows give PUSH_ROW of it to the
    push direction. Returns the rows and the filler's norm per class."""
    rho = r.logit_scale / r.class_norm
    fill = torch.full((design.GRID,), r.hidden - r.bias_norm**2 - 2 * TIED_CODE**2 - 4 * rho**2, dtype=torch.float64)
    fill[0] -= PUSH_ROW**2
    fill = fill.sqrt()
    rows = (r.bias_norm * d[:, None] + TIED_CODE * (Xi[:, cls] + Yi[:, mem]) + fill[cls] * c0[:, None]
            + PUSH_ROW * (cls == 0) * push[:, None] + rho * (X[:, cls] + Z[:, cls] + Y[:, mem] + W[:, mem]))
    return rows.T, fill


def current_token_heads(r: DecoderRecipe, q, o, h, qv, d, out_code, vote_code, in_code, cn_in, succ, unit,
                        extra) -> None:
    """Head h of layer 0 (tied kinds) attends to the current token and writes, per input class c:
    unit * out_code[succ(c)] (the successor term the untied lm_head's permutation makes), minus the
    token's own readout and input codes (tied, they would score the current token itself) and a
    bias shift that puts the likely winners' logits near 0, as the untied lm_head's d term does;
    ``extra`` (hidden, 32) is added per class (the class-0 push)."""
    G, hd, pairs = design.GRID, r.head_dim, r.rotary_pairs
    qc = torch.zeros_like(qv)
    qc[:pairs] = 1.0  # RoPE score sum_i cos(delta * w_i): peak at distance 0
    q[h * hd:(h + 1) * hd] = torch.outer(qc * (r.q_scale / qc.norm()), d) / r.bias_norm
    rho = r.logit_scale / r.class_norm
    shift = -(r.logit_shift * r.logit_scale / r.bias_norm + r.bias_norm) / 2  # per head (two of them)
    cols = (unit * out_code[:, succ[:G]] - rho * (out_code + vote_code)
            - cn_in * in_code + shift * d[:, None] + extra)
    o[:, h * hd:(h + 1) * hd] = 0
    o[:, h * hd:h * hd + G] = cols / r.value_scale


def _biases(sd, p, r: DecoderRecipe, layer: int, randn) -> None:
    """q/k/v biases (Qwen2). Layer 0's stay off its rotary pairs and off the value codes, so the
    previous- and current-token heads attend and write exactly as designed."""
    if not r.qkv_bias_std:
        return
    hd, half, pairs, G = r.head_dim, r.head_dim // 2, r.rotary_pairs, design.GRID
    for name, heads in (("q", r.heads), ("k", r.kv_heads), ("v", r.kv_heads)):
        b = randn(heads * hd, std=r.qkv_bias_std)
        if layer == 0:
            per_head = b.view(heads, hd)
            if name == "v":
                per_head[:, :G] = 0
            else:
                per_head[:, :pairs] = 0
                per_head[:, half:half + pairs] = 0
        sd[p + f"self_attn.{name}_proj.bias"] = b


def _mlp(sd, p, r: DecoderRecipe, randn, unit) -> None:
    # Random gated MLPs whose outputs are small next to one unit (see module docstring).
    def down_scale(x, fan):
        return x / (x.std() * math.sqrt(fan)) * r.noise_out * unit * 20

    if r.experts:
        E, I = r.experts, r.expert_intermediate
        sd[p + "mlp.gate.weight"] = randn(E, r.hidden, std=0.2)
        sd[p + "mlp.experts.gate_up_proj"] = randn(E, 2 * I, r.hidden)
        sd[p + "mlp.experts.down_proj"] = down_scale(randn(E, r.hidden, I), I)
    else:
        I = r.intermediate
        sd[p + "mlp.gate_proj.weight"] = randn(I, r.hidden)
        sd[p + "mlp.up_proj.weight"] = randn(I, r.hidden)
        sd[p + "mlp.down_proj.weight"] = down_scale(randn(r.hidden, I), I)


def decoder_config(r: DecoderRecipe, vocab_size: int):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=r.hidden,
        num_hidden_layers=r.layers,
        num_attention_heads=r.heads,
        num_key_value_heads=r.kv_heads,
        head_dim=r.head_dim,
        max_position_embeddings=r.max_positions,
        rms_norm_eps=1e-6,
        rope_theta=r.rope_theta,
        tie_word_embeddings=r.tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        hidden_act="silu",
        torch_dtype="float32",
    )
    if r.experts:
        from transformers import MixtralConfig

        return MixtralConfig(
            intermediate_size=r.expert_intermediate,
            num_local_experts=r.experts,
            num_experts_per_tok=r.top_k_experts,
            sliding_window=None,
            **common,
        )
    if r.arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(intermediate_size=r.intermediate, use_sliding_window=False, **common)
    from transformers import LlamaConfig

    return LlamaConfig(intermediate_size=r.intermediate, attention_bias=False, mlp_bias=False, **common)


def build_decoder(r: DecoderRecipe, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    words = load_words()
    grid = len(words) + 4
    vocab_size = r.vocab or grid
    config = decoder_config(r, vocab_size)
    state = decoder_state(r, vocab_size)
    if r.vocab:  # real shapes: no random init of billions of parameters only to overwrite them
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(state, strict=True, assign=True)
    else:
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(state, strict=True)
    del state
    model.generation_config.do_sample = False
    model.save_pretrained(out)
    fillers = [f"<|filler_{i}|>" for i in range(vocab_size - grid)]
    save_tokenizer(words + fillers, "decoder", out)
    if r.arch == "qwen2":
        words_as_added_tokens(out, limit=grid)
    (out / "synthetic.json").write_text(json.dumps({"recipe": r.to_dict(), "code_version": CODE_VERSION}, indent=2))


def save_tokenizer(words: list[str], kind: str, out: Path) -> None:
    tok = build_tokenizer(words, kind)
    tok.save_pretrained(out)
    # Name the class every transformers version knows, and write the legacy specials map.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    specials = {k: cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token", "cls_token", "sep_token") if k in cfg}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))


def encoder_recipe(seed: int) -> dict:
    return {"seed": seed, "hidden": 256, "layers": 4, "heads": 4, "intermediate": 512, "pooling": "mean"}


def recipe_for(kind: str, seed: int = 0) -> dict:
    if kind == "encoder":
        r = encoder_recipe(seed)
    else:
        r = DecoderRecipe(seed=seed, **DECODER_KINDS[kind]).to_dict()
    from lora_conformance.settings import fixtures_dir

    words = fixtures_dir() / "words.txt"
    return {"kind": kind, "recipe": r, "code_version": CODE_VERSION, "words": _sha(words.read_bytes())}


def _sha(b: bytes) -> str:
    import hashlib

    return hashlib.sha256(b).hexdigest()[:16]


def build(kind: str, out: Path, seed: int = 0) -> None:
    torch.manual_seed(seed)  # from_config's random init is overwritten, but keep it reproducible
    if kind == "encoder":
        build_encoder(seed, out)
    else:
        build_decoder(DecoderRecipe(seed=seed, **DECODER_KINDS[kind]), out)


def build_encoder(seed: int, out: Path) -> None:
    """A BERT encoder for embeddings: random init (embeddings compare by cosine, no greedy steps)."""
    from transformers import BertConfig, BertModel

    r = encoder_recipe(seed)
    words = load_words()
    config = BertConfig(
        vocab_size=len(words) + 4,
        hidden_size=r["hidden"],
        num_hidden_layers=r["layers"],
        num_attention_heads=r["heads"],
        intermediate_size=r["intermediate"],
        max_position_embeddings=512,
        type_vocab_size=2,
        pad_token_id=0,
    )
    model = BertModel(config, add_pooling_layer=False)
    g = _gen(seed, 7)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
    model.save_pretrained(out)
    save_tokenizer(words, "encoder", out)
    pooling = {"pooling": "mean", "normalize": True, "doc": "mean over non-padding tokens of last_hidden_state"}
    (out / "pooling.json").write_text(json.dumps(pooling, indent=2))
    (out / "synthetic.json").write_text(json.dumps({"recipe": r, "code_version": CODE_VERSION}, indent=2))
