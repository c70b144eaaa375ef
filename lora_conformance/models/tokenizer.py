"""A word-level tokenizer over fixtures/words.txt, saved in the standard HF layout.

One token per word, so ``decode`` gives space-joined words and ROUGE-L over words
compares the same units the model predicts.
"""

from __future__ import annotations

from pathlib import Path

from lora_conformance.settings import fixtures_dir

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "[UNK]"
SPECIALS = (PAD, BOS, EOS, UNK)  # ids 0..3; words follow in file order


def load_words(path: Path | None = None) -> list[str]:
    path = path or fixtures_dir() / "words.txt"
    words = [w.strip() for w in path.read_text().splitlines() if w.strip()]
    if len(set(words)) != len(words):
        raise ValueError(f"{path}: duplicate words")
    return words


def vocab(words: list[str]) -> dict[str, int]:
    return {tok: i for i, tok in enumerate(list(SPECIALS) + words)}


def build_tokenizer(words: list[str], kind: str):
    """A PreTrainedTokenizerFast; decoders get ``<s> $A``, the encoder ``<s> $A </s>`` (CLS/SEP-style)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    v = vocab(words)
    tok = Tokenizer(models.WordLevel(vocab=v, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # WordLevel has no decoder of its own; the default joins with spaces, which is what we want.
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    if kind == "encoder":
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A {EOS}", pair=f"{BOS} $A {EOS} $B {EOS}", special_tokens=[(BOS, v[BOS]), (EOS, v[EOS])]
        )
    else:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, v[BOS])]
        )
    extra = {"cls_token": BOS, "sep_token": EOS} if kind == "encoder" else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        # Decoders pad on the left so batched greedy generation continues each prompt's last word.
        padding_side="right" if kind == "encoder" else "left",
        model_max_length=512,
        **extra,
    )


def words_as_added_tokens(out: Path) -> None:
    """Make a saved word-level ``tokenizer.json`` tokenise the same under Qwen2Tokenizer.

    transformers 5 loads every ``model_type: qwen2`` checkpoint with Qwen2Tokenizer (a byte-level
    BPE built from the file's vocab and merges), whatever ``tokenizer_class`` says; our vocab has
    no merges, so words would vanish. Added tokens are matched before the BPE runs: each word as
    a non-special added token with its own id (``lstrip`` takes the space before it) gives the
    word-level ids. Decoding joins added tokens without spaces; engines and the reference share it.
    """
    import json

    path = Path(out) / "tokenizer.json"
    tj = json.loads(path.read_text())
    specials = {t["content"] for t in tj["added_tokens"]}
    words = sorted(((w, i) for w, i in tj["model"]["vocab"].items() if w not in specials), key=lambda x: x[1])
    tj["added_tokens"] += [{"id": i, "content": w, "single_word": True, "lstrip": True, "rstrip": False,
                            "normalized": False, "special": False} for w, i in words]
    path.write_text(json.dumps(tj, ensure_ascii=False))
