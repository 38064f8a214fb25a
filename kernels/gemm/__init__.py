"""The batch-invariant linear layer: `linear.py` (the op, its K-sliced partials and gradients),
`linear_triton.py` (the kernel and its tuned tiles per weight shape), `linear_cute.py` (quack's CuTe-DSL
GEMMs on Hopper where a shape has no tuned tiles: the same bits), `split_triton.py` (a split tile's
two K parts in separate programs), `tiles_triton.py` (the tile order and the K-range reduction every
GEMM kernel shares, the MoE's too), `slices.py` (the canonical K-sliced reduction tensor parallelism
reproduces); and the SiLU-and-multiply between the MLP's two GEMMs (`activation.py`,
`activation_triton.py`)."""
