"""The one reader of the user settings: every `VEXACT_*` environment variable, read once, validated.

Both sides of the contract (the trainer and the rollout) must see the same values: the attention
backend and the key split change bits. `get_settings()` reads the environment on its first call
(never at import time) and keeps the frozen result; `refresh_settings()` reads it again (tests, and
a CLI that sets variables before it starts work); `clear_settings()` leaves the next read to
`get_settings()`. `Settings.describe()` is the one line the check and the bench print.

VEXACT_ATTENTION      triton (unset) or fa4: the CUDA attention kernels (fa4: FlashAttention-4, Hopper)
VEXACT_KEY_SPLIT      0, or a positive multiple of 64 (unset: 2048; 0 under fa4): keys per split of
                      the Triton attention
VEXACT_SHARED_PREFIX  0 (unset) or 1: shared-prompt decode groups (Triton, no key split; same bits)
VEXACT_VLLM_CACHE     a directory (unset: ~/.cache/vexact-vllm): where the built-in tiny checkpoints go

An empty variable counts as unset.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .attention.tiles import KEY_TILE

# The CUDA attention kernels both sides may run ("triton": kernels/attention/core_triton.py; "fa4":
# FlashAttention-4 on Hopper, kernels/attention/fa4.py).
ATTENTION_BACKENDS = ("triton", "fa4")
# Keys per split of the Triton attention when VEXACT_KEY_SPLIT is unset: a step of few long rows then
# uses every SM (see docs/results.md#key-split); a row before key 2,048 keeps the unsplit bits.
DEFAULT_KEY_SPLIT = 2048

ENV_VARS: dict[str, str] = {
    "VEXACT_ATTENTION": "CUDA attention kernels: triton (default) or fa4 (FlashAttention-4, Hopper); "
    "the same on the trainer and the rollout",
    "VEXACT_KEY_SPLIT": f"keys per split of the Triton attention: 0 (none) or a positive multiple of "
    f"{KEY_TILE} (default {DEFAULT_KEY_SPLIT}; none under fa4); changes bits, so the same on the trainer and "
    "the rollout",
    "VEXACT_SHARED_PREFIX": "1: decodes reading the same prompt blocks attend them once per group (Triton "
    "attention with VEXACT_KEY_SPLIT=0; the same bits); default 0",
    "VEXACT_VLLM_CACHE": "directory of the built-in tiny checkpoints (default ~/.cache/vexact-vllm)",
}


def default_cache_dir() -> Path:
    """Where the tiny checkpoints go when VEXACT_VLLM_CACHE is unset."""
    return Path.home() / ".cache" / "vexact-vllm"


@dataclass(frozen=True)
class Settings:
    """The validated user settings (module docstring); construct with `get_settings()`."""

    attention: str = "triton"  # the CUDA attention kernels, one of ATTENTION_BACKENDS
    key_split: int = DEFAULT_KEY_SPLIT  # keys per split of the Triton attention (0: none)
    shared_prefix: bool = False  # shared-prompt decode groups on CUDA (no key split)
    cache_dir: Path = field(default_factory=default_cache_dir)  # the tiny checkpoints' directory

    def __post_init__(self):
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(
                f"VEXACT_ATTENTION must be one of {', '.join(ATTENTION_BACKENDS)} (the attention kernels, the same "
                f"on the trainer and the rollout), got {self.attention!r}"
            )
        if not isinstance(self.key_split, int) or self.key_split < 0 or self.key_split % KEY_TILE:
            raise ValueError(
                f"VEXACT_KEY_SPLIT must be 0 (no split) or a positive multiple of {KEY_TILE} keys (the attention's "
                f"key tile), the same on the trainer and the rollout, got {self.key_split!r}"
            )
        if self.key_split and self.attention == "fa4":
            raise ValueError(
                "VEXACT_KEY_SPLIT splits the Triton attention's keys; VEXACT_ATTENTION=fa4 runs FlashAttention-4, "
                "which takes no split: unset VEXACT_KEY_SPLIT or set it to 0"
            )
        if self.shared_prefix and self.attention == "fa4":
            raise ValueError(
                "VEXACT_SHARED_PREFIX=1 groups the Triton attention's decodes; VEXACT_ATTENTION=fa4 runs "
                "FlashAttention-4, which takes no groups: unset one of them"
            )
        if self.shared_prefix and self.key_split:
            raise ValueError(
                f"VEXACT_SHARED_PREFIX=1 takes no key split, and the Triton attention splits keys every "
                f"{self.key_split} (VEXACT_KEY_SPLIT, on by default): set VEXACT_KEY_SPLIT=0 on the trainer and "
                "the rollout alike"
            )

    def describe(self) -> str:
        """One line: every setting with its variable."""
        return (
            f"VEXACT_ATTENTION={self.attention} VEXACT_KEY_SPLIT={self.key_split} "
            f"VEXACT_SHARED_PREFIX={int(self.shared_prefix)} VEXACT_VLLM_CACHE={self.cache_dir}"
        )


def _key_split(text: str, attention: str) -> int:
    """VEXACT_KEY_SPLIT's value: unset, DEFAULT_KEY_SPLIT (0 under fa4, which takes no split)."""
    if not text:
        return 0 if attention == "fa4" else DEFAULT_KEY_SPLIT
    try:
        keys = int(text)
    except ValueError:
        keys = -1
    if keys < 0 or keys % KEY_TILE:
        raise ValueError(
            f"VEXACT_KEY_SPLIT must be 0 (no split) or a positive multiple of {KEY_TILE} keys (the attention's "
            f"key tile), the same on the trainer and the rollout, got {text!r}"
        )
    return keys


def settings_from(env: Mapping[str, str]) -> Settings:
    """The Settings an environment `env` gives (validated; ValueError saying what to change)."""
    attention = env.get("VEXACT_ATTENTION", "") or "triton"
    shared = env.get("VEXACT_SHARED_PREFIX", "") or "0"
    if shared not in ("0", "1"):
        raise ValueError(f"VEXACT_SHARED_PREFIX must be 0 or 1 (shared-prompt decode groups), got {shared!r}")
    cache = env.get("VEXACT_VLLM_CACHE", "")
    return Settings(
        attention=attention,
        key_split=_key_split(env.get("VEXACT_KEY_SPLIT", ""), attention),
        shared_prefix=shared == "1",
        cache_dir=Path(cache).expanduser() if cache else default_cache_dir(),
    )


_current: Settings | None = None


def get_settings() -> Settings:
    """The settings, read from the environment on the first call and kept (a refused environment
    raises at every call until it is fixed)."""
    global _current
    if _current is None:
        _current = settings_from(os.environ)
    return _current


def clear_settings() -> None:
    """Forget the settings read so far: the next `get_settings()` reads the environment (tests)."""
    global _current
    _current = None


def refresh_settings() -> Settings:
    """Read the environment again (after a change to it) and keep the new settings."""
    global _current
    _current = None
    return get_settings()
