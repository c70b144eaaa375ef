"""The serving machinery, split by concern (nano-vllm style): sequences, blocks, scheduling,
adapters, and the model runner that owns every device tensor."""
