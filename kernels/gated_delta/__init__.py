"""Gated DeltaNet: the causal conv1d with its cached state (`causal_conv1d.py`, `causal_conv1d_triton.py`,
`causal_conv1d_triton_bwd.py`) and the gated delta rule, chunk-anchored and incremental (`incremental.py`,
its cache layout `incremental_cache.py`, the torch path `incremental_torch.py`, the Triton kernels
`incremental_*_triton*.py`), with the input rules (`rules.py`) and checks (`checks.py`) they share."""
