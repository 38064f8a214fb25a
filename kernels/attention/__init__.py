"""Causal attention with one position-anchored reduction order: `causal.py` (the op: varlen for
training, paged for inference, the KV-cache write), its Triton launchers (`varlen_triton.py` with its
backward, `paged_triton.py`) over the shared core (`core_triton.py`), the shared-prefix decode
(`prefix.py`, `prefix_triton.py`, `prefix_groups_triton.py`), DeepSeek's latent layout with its training
backward (`latent.py`; its elementwise passes `latent_scores_triton.py`), FlashAttention-4 (`fa4.py`) and
the key tile every path shares (`tiles.py`)."""
