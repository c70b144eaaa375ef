"""The HF transformers + PEFT reference and its content-addressed cache."""

from lora_conformance.reference.cache import ReferenceCache
from lora_conformance.reference.runner import ReferenceRunner, sum_work

__all__ = ["ReferenceCache", "ReferenceRunner", "sum_work"]
