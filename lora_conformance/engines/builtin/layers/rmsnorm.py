"""RMSNorm computed the way HF Llama-family models do (float32 statistics, weight in model dtype)."""

import torch
import torch.nn.functional as F
from torch import nn

from lora_conformance.engines.builtin.layers import kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.use_kernels = False  # fused kernel (layers/kernels.py), set by kernels.attach

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # rms_norm upcasts to float32 for the statistics and rounds back to x's dtype, like HF;
        # the weight is applied after that rounding, as HF does (bitwise the same in bf16).
        # One fused kernel where the device has one, instead of seven.
        if self.use_kernels and x.dim() == 2 and x.stride(1) == 1 and self.weight.dtype == x.dtype:
            return kernels.ops.rms_norm(x, self.weight, self.eps)  # norm and weight in one kernel
        return F.rms_norm(x, (x.shape[-1],), None, self.eps) * self.weight
