"""Tiny checkpoints for the engine-plugin tests, built with transformers + PEFT in a temp dir.

Deliberately independent of lora_conformance.models/adapters (other parts of the project):
the engine tests must say whether the *plugin* is right, with inputs they fully control.
head_dim is 32 because vLLM's CPU attention refuses smaller heads; weights are drawn with a
large init range so that greedy choices are decided by wide margins, not by float noise.
"""

from __future__ import annotations

from pathlib import Path

WORDS = (
    "the a cat dog sat on mat ran fast slow red blue green big small one two three four five "
    "six seven eight nine ten and or but if then when where who what why how is was are were "
    "be been have has had do does did go went come came see saw look took make made say said"
).split()
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def build_tokenizer(out: Path, words=WORDS, **fast_kwargs):
    """A word-level fast tokenizer (BOS prepended, whitespace split) saved into ``out``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list(words))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>", **fast_kwargs
    )
    fast.save_pretrained(str(out))
    return fast


def build_llama(out: Path, seed: int = 0, layers: int = 2, tie: bool = False) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(str(out))
    return out


def build_moe(out: Path, seed: int = 0) -> Path:
    """A one-layer Mixtral with fused 3-D expert parameters (transformers 5 layout)."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    cfg = MixtralConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=4,
        num_experts_per_tok=2, initializer_range=0.15, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    MixtralForCausalLM(cfg).eval().save_pretrained(str(out))
    return out


def build_bert(out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import BertConfig, BertModel

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    cfg = BertConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=128, pad_token_id=0,
    )
    torch.manual_seed(seed)
    BertModel(cfg).eval().save_pretrained(str(out))
    return out


def build_adapter(base_dir: Path, out: Path, seed: int, r: int = 8, alpha: float = 16, scale: float = 0.3,
                  model_cls: str = "causal", **lora_kwargs) -> Path:
    """A PEFT LoRA adapter with random A and B (B is zero by default, which would be a no-op)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel, AutoModelForCausalLM

    loader = AutoModelForCausalLM if model_cls == "causal" else AutoModel
    base = loader.from_pretrained(str(base_dir))
    lora_kwargs.setdefault(
        "target_modules",
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        if model_cls == "causal" else ["query", "key", "value", "dense"],
    )
    cfg = LoraConfig(r=r, lora_alpha=alpha, init_lora_weights=False,
                     task_type="CAUSAL_LM" if model_cls == "causal" else "FEATURE_EXTRACTION", **lora_kwargs)
    torch.manual_seed(seed)
    pm = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * scale)
    pm.save_pretrained(str(out))
    return Path(out)


def greedy_oracle(base_dir: Path, adapter_dir, prompt: str, steps: int):
    """An independent oracle for an engine's greedy decode: a plain single-adapter PeftModel (or the
    bare base), one prompt, full forwards with no cache and no generate(). Returns (prompt ids,
    generated ids, the float32 logprob row of every step)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base_dir))
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    prompt_ids, new, rows = ids[0].tolist(), [], []
    with torch.no_grad():
        for _ in range(steps):
            row = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), -1)
            t = int(row.argmax())
            new.append(t)
            rows.append(row)
            ids = torch.cat([ids, torch.tensor([[t]])], 1)
    return prompt_ids, new, rows
