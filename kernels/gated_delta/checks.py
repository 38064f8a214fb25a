"""Input checks of the Gated DeltaNet ops (the causal conv and the gated delta rule), shared by the ops
and their Triton launchers so that a launcher never imports its op. Each raises ValueError.

Legend: T tokens (packed sequences), N sequences, HK / HV k / v heads, DK / DV head dims, C conv
channels, W conv width, S cache slots.
"""

import torch

from ..checks import check_dim, check_dtype, check_int, check_last_dim_contiguous, check_same_device


def check_cu_seqlens(cu_seqlens: torch.Tensor, n_tokens: int, padding_rows: bool = False) -> int:
    """int [N + 1], 0 = cu[0] <= cu[1] <= ... <= cu[N] = T, or <= T with `padding_rows` (inference: a CUDA
    graph runs the rows it was captured with, the rows past cu[N] are padding); values checked on CPU
    only. Returns N."""
    check_int("cu_seqlens", cu_seqlens)
    check_dim("cu_seqlens", cu_seqlens, 1, "[N + 1]")
    if cu_seqlens.shape[0] < 2:
        raise ValueError("cu_seqlens must hold at least one sequence ([N + 1] with N >= 1)")
    if cu_seqlens.device.type == "cpu":  # on CUDA the check would stall every step on the host
        end = int(cu_seqlens[-1])
        if int(cu_seqlens[0]) != 0 or end > n_tokens or (end != n_tokens and not padding_rows):
            ends = f"at most T = {n_tokens} (padding rows after it)" if padding_rows else f"T = {n_tokens}"
            raise ValueError(f"cu_seqlens must run from 0 to {ends}, got {cu_seqlens.tolist()}")
        if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}")
    return cu_seqlens.shape[0] - 1


def check_slots(
    slots: torch.Tensor, has_state: torch.Tensor, n_seqs: int, n_slots: int, padded: bool = False
) -> None:
    """slots: int [N], distinct, in [0, S), or -1 where `padded` allows it (a sequence with no slot: its
    state is neither read nor written, as for a CUDA graph's padded request); has_state: bool [N]
    (values checked on CPU only)."""
    check_int("slots", slots)
    if tuple(slots.shape) != (n_seqs,):
        raise ValueError(f"slots must have shape ({n_seqs},), got {tuple(slots.shape)}")
    if (
        not isinstance(has_state, torch.Tensor)
        or has_state.dtype != torch.bool
        or tuple(has_state.shape) != (n_seqs,)
    ):
        raise ValueError(f"has_state must be a bool tensor of shape ({n_seqs},)")
    if slots.device.type == "cpu" and n_seqs:
        lowest = -1 if padded else 0
        if int(slots.min()) < lowest or int(slots.max()) >= n_slots:
            allowed = f"[0, {n_slots})" + (" or -1 (no slot)" if padded else "")
            raise ValueError(f"slots must lie in {allowed}, got {slots.tolist()}")
        used = slots[slots >= 0]
        if used.unique().numel() != used.numel():
            raise ValueError(
                f"slots must be distinct (each sequence owns its cache slot), got {slots.tolist()}"
            )


def check_conv_inputs(x, weight, bias, cu_seqlens, conv_state=None, slots=None, has_state=None) -> int:
    """x [T, C] (unit last stride), weight [C, W] (W >= 2), bias [C] or None, cu_seqlens [N + 1];
    conv_state [S, W - 1, C] in x's dtype with slots / has_state [N], or all three None. Returns N."""
    check_dtype("x", x)
    check_dim("x", x, 2, "[T, C]")
    check_last_dim_contiguous("x", x)
    check_dtype("weight", weight)
    check_dim("weight", weight, 2, "[C, W]")
    if weight.shape[0] != x.shape[1] or weight.shape[1] < 2:
        raise ValueError(f"weight {tuple(weight.shape)} must be [C, W] with C = {x.shape[1]} and W >= 2")
    if bias is not None:
        check_dtype("bias", bias)
        if tuple(bias.shape) != (x.shape[1],):
            raise ValueError(f"bias must be [C] = ({x.shape[1]},), got {tuple(bias.shape)}")
    n_seqs = check_cu_seqlens(cu_seqlens, x.shape[0], padding_rows=conv_state is not None)
    if (conv_state is None) != (slots is None) or (slots is None) != (has_state is None):
        raise ValueError("conv_state, slots and has_state go together: all three or none")
    if conv_state is not None:
        check_dtype("conv_state", conv_state, (x.dtype,))
        width = weight.shape[1]
        if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != (width - 1, x.shape[1]):
            raise ValueError(
                f"conv_state must be [S, W - 1, C] = [S, {width - 1}, {x.shape[1]}], got {tuple(conv_state.shape)}"
            )
        check_slot_layout("conv_state", conv_state)
        check_slots(slots, has_state, n_seqs, conv_state.shape[0], padded=True)
    check_same_device(
        x=x, weight=weight, bias=bias, cu_seqlens=cu_seqlens, conv_state=conv_state, slots=slots
    )
    return n_seqs


def check_gated_delta_inputs(q, k, v, a, b, A_log, dt_bias, cu_seqlens, padding_rows: bool = False) -> int:
    """q, k [T, HK, DK], v [T, HV, DV] (unit last strides; HV a multiple of HK), a, b [T, HV],
    A_log, dt_bias [HV], cu_seqlens [N + 1]. Returns N."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_dtype(name, t)
        check_dim(name, t, 3, "[T, H, D]")
        check_last_dim_contiguous(name, t)
    if q.shape != k.shape or q.dtype != k.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} must match, v ({v.dtype}) share their dtype"
        )
    n_tokens, hk, _ = q.shape
    hv = v.shape[1]
    if v.shape[0] != n_tokens or hv % hk != 0:
        raise ValueError(
            f"v {tuple(v.shape)} must be [T, HV, DV] with T = {n_tokens} and HV a multiple of HK = {hk}"
        )
    for name, t in (("a", a), ("b", b)):
        check_dtype(name, t)
        if tuple(t.shape) != (n_tokens, hv):
            raise ValueError(f"{name} must be [T, HV] = ({n_tokens}, {hv}), got {tuple(t.shape)}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        check_dtype(name, t)
        if tuple(t.shape) != (hv,):
            raise ValueError(f"{name} must be [HV] = ({hv},), got {tuple(t.shape)}")
    check_same_device(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens)
    return check_cu_seqlens(cu_seqlens, n_tokens, padding_rows)


def check_slot_layout(name: str, cache: torch.Tensor) -> None:
    """Each slot of `cache` [S, ...] contiguous, the slots at any stride (vLLM's hybrid cache puts each
    slot's states in one page, so a state tensor strides over the pages)."""
    if cache.shape[0] and not cache[0].is_contiguous():
        raise ValueError(f"{name} must hold each slot contiguously (the slots at any stride), got strides {cache.stride()}")


def check_state(
    name: str, state: torch.Tensor, rows: int | None, v: torch.Tensor, k: torch.Tensor, slot_strided: bool = False
) -> None:
    """An fp32 contiguous state [rows, HV, DV, DK] (rows None: any count) on v's device; `slot_strided`:
    only each slot contiguous (`check_slot_layout`)."""
    check_dtype(name, state, (torch.float32,))
    shape = (v.shape[1], v.shape[2], k.shape[2])
    if state.dim() != 4 or tuple(state.shape[1:]) != shape or (rows is not None and state.shape[0] != rows):
        want = f"[{'S' if rows is None else rows}, HV, DV, DK] = [.., {', '.join(map(str, shape))}]"
        raise ValueError(f"{name} must be {want}, got {tuple(state.shape)}")
    if slot_strided:
        check_slot_layout(name, state)
    elif not state.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    check_same_device(**{name: state, "v": v})
