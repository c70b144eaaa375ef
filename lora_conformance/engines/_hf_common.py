"""Helpers shared by the engine plugins: top-k records, engine-arg parsing; checkpoint facts re-exported.

Nothing here imports torch at module level: the vllm/openai/sglang plugins import this
module in processes where torch may be heavy or absent (the openai plugin needs only a
tokenizer), so torch is imported inside the functions that need it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

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




def load_tokenizer(model_dir: Path):
    from lora_conformance.models.tokenizer import load_tokenizer as load

    return load(model_dir)


def is_encoder_only(model_dir: Path) -> bool:
    """True for checkpoints that are encoders (``checkpoints.model_kind``'s rule)."""
    return checkpoints.is_encoder(model_dir)
