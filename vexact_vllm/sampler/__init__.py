"""The vexact sampler: log-probs from the one log-prob function, order-free seeded sampling.

One role per module (nothing is imported here, so importing one runner's sampler does not import
the other's vLLM modules):
- rules.py: what both runners share: the greedy cut (GREEDY_EPS), the request seed, the draw
  (argmax or Gumbel-max keyed by seed and position), truncation (top-k, top-p, min-p) and the
  refusal of the sampling options the bitwise contract cannot keep.
- v1.py: `VexactSampler` for vLLM's V1 model runner (the CPU runner) and `wrap_sample`, the patch
  that puts it into that runner.
- v2.py: `VexactSamplerV2` for vLLM's model runner v2 and `VexactModelState`, the model state through
  which runner v2 takes it.
- graphs.py: the decode step's lm_head and sampler CUDA graphs (runner v2).
"""
