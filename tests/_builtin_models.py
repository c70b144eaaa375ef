"""Tiny checkpoints and PEFT adapters for the built-in engine's tests (built in a temp dir).

Own helpers (not lora_conformance.models): these tests check the engine against HF + PEFT
on inputs they fully control, for several architectures.
"""

from __future__ import annotations

from pathlib import Path

from _tiny_models import build_tokenizer as _word_tokenizer

WORDS = (
    "the a cat dog sat on mat ran fast slow red blue green big small one two three four five six seven "
    "eight nine ten and or but if then when where who what why how is was are were be been have has had "
    "do does did go went come came see saw look took make made say said sun moon star tree sea sky"
).split()
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_tokenizer(out: Path):
    """The plugin tests' word-level tokenizer over this file's words, padding on the left."""
    return _word_tokenizer(out, WORDS, padding_side="left")


def _common(vocab: int) -> dict:
    return dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.15,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)


def build_decoder(out: Path, arch: str = "llama", seed: int = 0, tie: bool = False, **extra) -> Path:
    """arch: llama | qwen2 | qwen3 | mistral | mixtral | qwen2_moe | qwen3_moe."""
    import torch
    import transformers as tf

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    kw = _common(len(tok))
    kw.update(intermediate_size=96, tie_word_embeddings=tie)
    names = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "mixtral": "Mixtral",
             "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe"}
    if arch == "mixtral":
        kw.update(num_local_experts=4, num_experts_per_tok=2)
    elif arch in ("qwen2_moe", "qwen3_moe"):
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=arch == "qwen3_moe")
        if arch == "qwen2_moe":
            kw.update(shared_expert_intermediate_size=80)
    kw.update(extra)
    cfg = getattr(tf, names[arch] + "Config")(**kw)
    torch.manual_seed(seed)
    model = getattr(tf, names[arch] + "ForCausalLM")(cfg).eval()
    if arch == "qwen2":  # biases are zero-initialised; make them matter
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("proj.bias"):
                    p.normal_(0, 0.1)
    model.save_pretrained(str(out))
    return out


def build_bert(out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import BertConfig, BertModel

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=128, pad_token_id=0)
    torch.manual_seed(seed)
    BertModel(cfg).eval().save_pretrained(str(out))
    return out


def build_adapter(base_dir: Path, out: Path, seed: int, r: int = 8, alpha: float = 16, scale: float = 0.2,
                  encoder: bool = False, **lora_kwargs) -> Path:
    """A PEFT LoRA adapter with random A and B (default init zeroes B: a no-op adapter)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel, AutoModelForCausalLM

    base = (AutoModel if encoder else AutoModelForCausalLM).from_pretrained(str(base_dir))
    if "target_parameters" not in lora_kwargs:
        lora_kwargs.setdefault("target_modules", ["query", "key", "value", "dense"] if encoder else ALL_LINEAR)
    cfg = LoraConfig(r=r, lora_alpha=alpha, init_lora_weights=False, **lora_kwargs)
    torch.manual_seed(seed)
    pm = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * scale)
    pm.save_pretrained(str(out))
    return Path(out)
