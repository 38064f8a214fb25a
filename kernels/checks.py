"""Input checks shared by the ops and their Triton launchers: each raises ValueError with a clear message.

An op (`op.py`) and its launcher (`op_triton.py`) both check what they take; the checks live here so
that a launcher never imports its op."""

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)


def check_dtype(name: str, t: torch.Tensor, allowed: tuple = SUPPORTED_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise ValueError(f"{name} has dtype {t.dtype}; supported: {names}")


def check_int(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} has dtype {t.dtype}; expected torch.int32 or torch.int64")


def check_dim(name: str, t: torch.Tensor, ndim: int, legend: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {legend}, got shape {tuple(t.shape)}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"inputs must share one device, got {devices}")


def check_out(
    out: torch.Tensor | None,
    shape: tuple,
    dtype: torch.dtype,
    device: torch.device,
    *inputs: torch.Tensor | None,
    row_stride: bool = False,
) -> None:
    """A kernel's `out=`: None, or a contiguous tensor of the result's shape, dtype and device (the
    result is written there, with the bits it has without `out=`); with `row_stride`, a 2-D one may
    also have rows further apart (a column block of a wider matrix). Inference only, so neither
    `out` nor any of `inputs` may need a gradient."""
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a torch.Tensor, got {type(out).__name__}")
    laid_out = out.is_contiguous() or (
        row_stride and out.dim() == 2 and out.stride(1) == 1 and out.stride(0) >= out.shape[1]
    )
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device or not laid_out:
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of shape {tuple(shape)} on {device}"
            f"{' (or a 2-D one with unit column stride)' if row_stride else ''}, got "
            f"{out.dtype} {tuple(out.shape)} strides {out.stride()} on {out.device}"
        )
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (out, *inputs)):
        raise ValueError("out= is for inference: no input or output may need a gradient")


# ------------------------------------------------------------------------ log-probs and sampling


def check_logits(logits: torch.Tensor, name: str = "logits") -> None:
    """fp32 [M, V] logits (V > 0), contiguous rows."""
    check_dtype(name, logits, (torch.float32,))
    check_dim(name, logits, 2, "[M, V]")
    if logits.shape[1] == 0:
        raise ValueError(f"{name} must have a non-empty vocabulary dim, got shape {tuple(logits.shape)}")
    check_last_dim_contiguous(name, logits)


def check_temperature(temperature, n_rows: int, device: torch.device) -> None:
    """A float >= 0 or an fp32 tensor [M] on `device` (values checked on the CPU only)."""
    if isinstance(temperature, torch.Tensor):
        check_dtype("temperature", temperature, (torch.float32,))
        if temperature.numel() != n_rows or temperature.dim() > 1:
            raise ValueError(
                f"temperature must be a float or an fp32 tensor [{n_rows}], got {tuple(temperature.shape)}"
            )
        if temperature.device != device:
            raise ValueError(f"temperature is on {temperature.device}, logits on {device}")
        # Values are checked on the CPU only: on CUDA the check would stall the sampler on a host
        # sync every step (vLLM has validated each request's temperature at admission).
        if temperature.device.type == "cpu" and (
            bool((temperature < 0).any()) or not bool(torch.isfinite(temperature).all())
        ):
            raise ValueError("temperature must be finite and >= 0 (0 means greedy)")
    elif not isinstance(temperature, (int, float)) or not 0 <= temperature < float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {temperature!r}")


def check_tokens(tokens: torch.Tensor, n_rows: int, vocab: int) -> None:
    """int [M] token ids in [0, vocab) (the values are read: a host sync on CUDA)."""
    check_int("tokens", tokens)
    if tuple(tokens.shape) != (n_rows,):
        raise ValueError(f"tokens must have shape ({n_rows},), got {tuple(tokens.shape)}")
    if n_rows and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(f"tokens must lie in [0, {vocab})")


def check_noise_keys(seeds: torch.Tensor, positions: torch.Tensor, n_rows: int) -> None:
    """The Gumbel noise's key: int tensors [M] of seeds and positions."""
    for name, t in (("seeds", seeds), ("positions", positions)):
        check_int(name, t)
        if tuple(t.shape) != (n_rows,):
            raise ValueError(f"{name} must have shape ({n_rows},), got {tuple(t.shape)}")


# ------------------------------------------------------------------------ norms, RoPE, MoE


def check_rms_norm_inputs(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> None:
    """`rms_norm` / `add_rms_norm`'s inputs (shared with their Triton launchers and the RoPE op's qk_norm)."""
    check_dtype("x", x)
    check_dtype("weight", weight)
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight {tuple(weight.shape)} must be [H] with H = x.shape[-1] (x {tuple(x.shape)})"
        )
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    if residual is not None:
        check_dtype("residual", residual)
        if residual.dtype != x.dtype or residual.shape != x.shape:
            raise ValueError(
                f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
            )
        check_last_dim_contiguous("residual", residual)
    check_same_device(x=x, weight=weight, residual=residual)
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")


def check_rope_inputs(q, k, positions, cache, qk_norm=None) -> None:
    """`apply_rope`'s inputs (shared with its Triton launcher)."""
    for name, t in (("q", q), ("k", k)):
        check_dtype(name, t)
        check_dim(name, t, 3, "[T, H, D]")
        check_last_dim_contiguous(name, t)
    check_dtype("cache", cache, (torch.float32,))
    check_dim("cache", cache, 2, "[max_positions, rot_dim]")
    check_last_dim_contiguous("cache", cache)
    check_int("positions", positions)
    check_dim("positions", positions, 1, "[T]")
    if k.dtype != q.dtype:
        raise ValueError(f"k dtype {k.dtype} differs from q dtype {q.dtype}")
    if k.shape[0] != q.shape[0] or positions.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)} must share T and D"
        )
    if cache.shape[1] % 2 != 0 or not 0 < cache.shape[1] <= q.shape[2]:
        raise ValueError(f"cache rot_dim {cache.shape[1]} must be even, in (0, head_dim {q.shape[2]}]")
    check_same_device(q=q, k=k, positions=positions, cache=cache)
    if not positions.is_cuda and positions.numel() > 0:
        if int(positions.min()) < 0 or int(positions.max()) >= cache.shape[0]:
            raise ValueError(f"positions must lie in [0, {cache.shape[0]}) (the cache's max_positions)")
    if qk_norm is not None:
        if not isinstance(qk_norm, tuple) or len(qk_norm) != 3:
            raise ValueError("qk_norm must be a tuple (q_weight, k_weight, eps)")
        q_weight, k_weight, eps = qk_norm
        check_rms_norm_inputs(q, q_weight, eps)
        check_rms_norm_inputs(k, k_weight, eps)


def check_moe_inputs(x, w_gate_up, w_down, topk_ids, topk_weights, down_shape=None) -> None:
    """Shapes, dtypes, contiguity and device of `fused_moe`'s inputs (shared with the Triton launcher).
    Expert ids are checked against [0, E) on CPU tensors only: on CUDA the check would synchronise
    with the host in every MoE layer (and cannot run inside CUDA-graph capture); the Triton path
    writes NaN rows for tokens with an id outside [0, E) instead of reading out of bounds."""
    check_dtype("x", x)
    check_dim("x", x, 2, "[T, H]")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x must be contiguous in its last dim, got strides {x.stride()}")
    for name, w, legend in (("w_gate_up", w_gate_up, "[E, 2I, H]"), ("w_down", w_down, "[E, H, I]")):
        check_dtype(name, w)
        if w.dtype != x.dtype:
            raise ValueError(f"{name} dtype {w.dtype} differs from x dtype {x.dtype}")
        check_dim(name, w, 3, legend)
        check_contiguous(name, w)
    n_experts, two_inter, hidden = w_gate_up.shape
    inter = two_inter // 2
    if n_experts < 1 or inter < 1 or two_inter % 2 or hidden != x.shape[1]:
        raise ValueError(
            f"w_gate_up {tuple(w_gate_up.shape)} must be [E, 2I, H] with E, I >= 1 and H = x.shape[1] "
            f"= {x.shape[1]}"
        )
    down_shape = (n_experts, hidden, inter) if down_shape is None else down_shape  # [E, H, I]
    if tuple(w_down.shape) != tuple(down_shape):
        raise ValueError(
            f"w_down must have shape {tuple(down_shape)} = [E, H, I], got {tuple(w_down.shape)}"
        )
    check_int("topk_ids", topk_ids)
    check_dim("topk_ids", topk_ids, 2, "[T, k]")
    check_dtype("topk_weights", topk_weights, (torch.float32,))
    if topk_ids.shape[0] != x.shape[0] or topk_ids.shape[1] < 1:
        raise ValueError(
            f"topk_ids must be [T, k] with T = {x.shape[0]} and k >= 1, got {tuple(topk_ids.shape)}"
        )
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} must both be [T, k]"
        )
    check_contiguous("topk_ids", topk_ids)
    check_contiguous("topk_weights", topk_weights)
    check_same_device(x=x, w_gate_up=w_gate_up, w_down=w_down, topk_ids=topk_ids, topk_weights=topk_weights)
    if (
        topk_ids.device.type == "cpu"
        and topk_ids.numel()
        and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= n_experts)
    ):
        raise ValueError(f"topk_ids must lie in [0, {n_experts}) (E = w_gate_up.shape[0])")
