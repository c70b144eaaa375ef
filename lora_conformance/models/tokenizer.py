"""A word-level tokenizer over fixtures/words.txt, saved in the standard HF layout.

One token per word, so ``decode`` gives space-joined words and ROUGE-L over words
compares the same units the model predicts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

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


def words_as_added_tokens(out: Path, limit: Optional[int] = None) -> None:
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
    # ``limit``: ids from it on (the real shapes' filler tokens, never in a prompt) stay plain vocab
    words = sorted(((w, i) for w, i in tj["model"]["vocab"].items()
                    if w not in specials and (limit is None or i < limit)), key=lambda x: x[1])
    tj["added_tokens"] += [{"id": i, "content": w, "single_word": True, "lstrip": True, "rstrip": False,
                            "normalized": False, "special": False} for w, i in words]
    path.write_text(json.dumps(tj, ensure_ascii=False))


# ---- loading: AutoTokenizer, its class choice kept between processes ----------------------

# Where AutoTokenizer's class choices are kept (set by the harness to <cache>/tokenizers; None: not
# kept). AutoTokenizer reads the model's config.json into a config object, importing that
# architecture's modelling package (about 0.8 s a process), only to choose a tokenizer class; it
# then calls that class's ``from_pretrained``. The choice depends on the checkpoint's config and
# tokenizer files and on the transformers version alone: with those as the key, a later process
# (every pytest-xdist worker, every run) calls the chosen class the same way directly.
RESOLUTION_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json")


def _resolution_key(model_dir: Path) -> Optional[str]:
    from lora_conformance.models import transformers_files_key

    return transformers_files_key(model_dir, RESOLUTION_FILES)


def _remote_code(model_dir: Path) -> bool:
    """A tokenizer_config.json with an ``auto_map``: AutoTokenizer may load code from the checkpoint."""
    import json

    try:
        return "auto_map" in json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False


def load_tokenizer(model_dir: Path, cache_dir: Optional[Path] = None):
    """``AutoTokenizer.from_pretrained(model_dir)``; where an earlier process recorded the class it
    chose for these files (in ``cache_dir``, the session's ``<cache>/tokenizers``), that class's ``from_pretrained`` with the
    arguments AutoTokenizer passes it (tests/test_models.py checks both give the same tokenizer)."""
    import transformers

    model_dir = Path(model_dir)
    path = None
    if cache_dir is not None and not _remote_code(model_dir):
        key = _resolution_key(model_dir)
        path = Path(cache_dir) / f"{key}.json" if key else None
    if path is not None and path.exists():
        import json

        try:
            cls = getattr(transformers, json.loads(path.read_text())["class"])
            return cls.from_pretrained(str(model_dir), _from_auto=True)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # unreadable, or a class this transformers lacks: AutoTokenizer below decides again
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    name = type(tok).__name__
    if path is not None and getattr(transformers, name, None) is type(tok):
        from lora_conformance.fileio import write_json_atomic

        try:
            write_json_atomic(path, {"class": name})
        except OSError:
            pass  # a read-only cache only costs AutoTokenizer's lookup next time
    return tok
