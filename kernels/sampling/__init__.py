"""Log-probs and sampling: THE log-prob function (`logprob.py`, `logprob_triton.py`) with the rules
it applies to logits (`logit_rules.py`: temperature, vocabulary mask), a row's top-k and a token's rank
(`logprob_topk.py`), the Gumbel noise (`gumbel.py`, `gumbel_triton.py`), the decode step's sampling
(`sample.py`, `sample_triton.py`), truncated sampling (`truncation.py`) and the sampler's per-row
gathers (`gather_triton.py`)."""
