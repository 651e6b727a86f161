"""Decoder building blocks: RMSNorm, RoPE, paged GQA attention, SwiGLU MLP, hyper-connections."""
