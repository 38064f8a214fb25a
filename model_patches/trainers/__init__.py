"""The trainer side: the switch (switch.py), the transformers training class (hf_causal_lm.py), the
hooks into transformers, verl and VeOmni, VeOmni's classes, autocast and the PPO outputs. Built on the
shared model one level up, which never imports from here."""
