"""Gated DeltaNet: the causal conv1d with its cached state (`causal_conv1d.py`, `causal_conv1d_triton.py`,
`causal_conv1d_triton_bwd.py`), the gated delta rule in three candidate designs: one recurrence
(`recurrent.py`, `recurrent_triton.py`, `recurrent_triton_bwd.py`), chunk-anchored recomputing the partial
chunk (`chunked.py`, `chunked_triton.py`), and chunk-anchored incremental (`incremental.py` and its
`incremental_*.py`), with the input rules (`rules.py`) and checks (`checks.py`) they share."""
