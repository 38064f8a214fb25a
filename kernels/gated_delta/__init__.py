"""Gated DeltaNet: the causal conv1d with its cached state (`causal_conv1d.py`,
`causal_conv1d_triton.py`), the gated delta rule as one recurrence (`recurrent.py`,
`recurrent_triton.py`, `recurrent_triton_bwd.py`) and chunk-anchored (`chunked.py`,
`chunked_triton.py`), with the input rules (`rules.py`) and checks (`checks.py`) they share."""
