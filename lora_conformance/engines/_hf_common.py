"""Helpers shared by the engine plugins: top-k records, engine-arg parsing; checkpoint facts re-exported.

Nothing here imports torch at module level: the vllm/openai/sglang plugins import this
module in processes where torch may be heavy or absent (the openai plugin needs only a
tokenizer), so torch is imported inside the functions that need it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping, Optional

from lora_conformance import checkpoints
# One reader of dtype names and adapter_config.json: the checkpoint module's, under the names the engines use.
from lora_conformance.checkpoints import DTYPE_NAMES, AdapterInfo  # noqa: F401
from lora_conformance.checkpoints import adapter_info as read_adapter_info  # noqa: F401
from lora_conformance.engines.base import EngineError
from lora_conformance.types import TopK


def torch_dtype(name: str):
    try:
        return checkpoints.torch_dtype(name)
    except ValueError as exc:
        raise EngineError(str(exc)) from None


def topk_from_logprobs(row, k: int) -> TopK:
    """A 1-D float32 logprob tensor -> {token id: logprob} of its k best, best first.

    Ties are broken by the lower token id (torch.topk's order is unspecified for ties),
    so two engines with bit-identical logits produce identical dicts.
    """
    import torch

    if k <= 0:
        return {}
    k = min(k, row.shape[-1])
    # Over-fetch a little so that ties at the k-th place can be ordered by id.
    vals, ids = torch.topk(row, min(row.shape[-1], k + 8))
    pairs = sorted(zip(vals.tolist(), ids.tolist()), key=lambda p: (-p[0], p[1]))[:k]
    return {int(i): float(v) for v, i in pairs}


def trim_topk(entries: Mapping[int, float], k: int) -> TopK:
    """Keep the k best of an engine's logprob dict (vLLM adds the sampled/prompt token)."""
    pairs = sorted(((int(t), float(v)) for t, v in entries.items()), key=lambda p: (-p[1], p[0]))[:k]
    return dict(pairs)


# ---- engine args --------------------------------------------------------------------


def check_known_args(engine: str, args: Mapping[str, str], known: Iterable[str]) -> None:
    known = sorted(set(known))
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise EngineError(
            f"engine {engine!r}: unknown engine argument(s) {', '.join(unknown)}; "
            f"known: {', '.join(known) or 'none'}"
        )


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def arg_bool(engine: str, args: Mapping[str, str], key: str, default: bool) -> bool:
    raw = args.get(key)
    if raw is None or raw == "":
        return default
    low = str(raw).strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise EngineError(f"engine {engine!r}: {key}={raw!r} is not a boolean (true/false/1/0/yes/no)")


def arg_int(engine: str, args: Mapping[str, str], key: str, default: Optional[int]) -> Optional[int]:
    raw = args.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(str(raw).strip())
    except ValueError:
        raise EngineError(f"engine {engine!r}: {key}={raw!r} is not an integer") from None


def arg_float(engine: str, args: Mapping[str, str], key: str, default: Optional[float]) -> Optional[float]:
    raw = args.get(key)
    if raw is None or raw == "":
        return default
    try:
        return float(str(raw).strip())
    except ValueError:
        raise EngineError(f"engine {engine!r}: {key}={raw!r} is not a number") from None


def load_tokenizer(model_dir: Path):
    from lora_conformance.models.tokenizer import load_tokenizer as load

    return load(model_dir)


def is_encoder_only(model_dir: Path) -> bool:
    """True for checkpoints that are encoders (``checkpoints.model_kind``'s rule)."""
    return checkpoints.is_encoder(model_dir)
