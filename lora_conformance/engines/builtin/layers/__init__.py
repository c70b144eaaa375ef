"""One small module per layer kind: LoRA-aware linear and embedding, attention, rotary, norms, sampler."""
