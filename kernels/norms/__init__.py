"""RMSNorm and fused residual-add + RMSNorm (`rms_norm.py`, `rms_norm_triton.py`), and the rotary
embedding (`rope.py`, `rope_triton.py`), whose Triton launch applies Qwen3's per-head q/k RMSNorm
first with the RMSNorm kernels' arithmetic."""
