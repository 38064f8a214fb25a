"""The mixture-of-experts layer: top-k routing (`routing.py`, `routing_triton.py`) and the fused
SwiGLU experts with their slot-order combine (`experts.py`; on CUDA `experts_triton.py`, its backward
`experts_triton_bwd.py`, over the grouped GEMMs of `core_triton.py` and the expert-grouped layout of
`align_triton.py`)."""
