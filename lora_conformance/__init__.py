"""lora-conformance: certify LoRA inference engines on any accelerator against HF transformers + PEFT.

The comparison API is importable from here; heavy modules load lazily.
"""

__version__ = "0.2.0"
