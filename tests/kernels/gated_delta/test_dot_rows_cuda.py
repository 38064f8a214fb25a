"""The premise of design C's products on the GPU: an element of a bf16 tl.dot (fp32 accumulate) depends only
on its row of A, its column of B and its accumulator, not on how many rows or columns the dot takes. The
chunk kernels multiply a whole chunk's 64 rows at once (a wgmma on Hopper), the Triton decode step a 16-row
tile holding its row, at times against 16 columns (mma.sync), the hand-written CUDA one mma.sync m16n8k16:
their elements must be equal bit for bit. Random operands over a wide exponent range, with cancelling
terms, at the products' K and N."""

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

pytestmark = pytest.mark.cuda


@triton.jit
def _rows_product(A, B, ACC, C, K: tl.constexpr, N: tl.constexpr, SUB: tl.constexpr, NSUB: tl.constexpr):
    """C[rows, cols] = ACC[rows, cols] + A[rows] @ B[:, cols] for the program's SUB rows and NSUB columns."""
    rm = tl.program_id(0) * SUB + tl.arange(0, SUB)
    ok, on = tl.arange(0, K), tl.program_id(1) * NSUB + tl.arange(0, NSUB)
    a = tl.load(A + rm[:, None] * K + ok[None, :])
    b = tl.load(B + ok[:, None] * N + on[None, :])
    acc = tl.load(ACC + rm[:, None] * N + on[None, :])
    tl.store(C + rm[:, None] * N + on[None, :], tl.dot(a, b, acc))


def _operands(m, k, n, gen):
    """bf16 A [m, k], B [k, n] with magnitudes over 2^-20 .. 2^20, one in eight of A's rows the negation of
    the row before (cancelling sums); an fp32 accumulator, zero in half the rows."""
    def spread(*shape):
        scale = torch.exp2(torch.randint(-20, 21, shape, generator=gen).float())
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    a, b = spread(m, k), spread(k, n)
    a[1::8] = -a[0::8][: a[1::8].shape[0]]
    acc = torch.randn(m, n, generator=gen) * torch.exp2(torch.randint(-10, 11, (m, n), generator=gen).float())
    acc[::2] = 0.0
    return a.cuda(), b.cuda(), acc.cuda()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k,n", [(16, 16), (64, 64), (128, 64), (64, 128), (128, 16), (256, 64)])
@pytest.mark.parametrize("warps", [4, 8])
def test_64_row_products_equal_16_row_products(k, n, warps):
    gen = torch.Generator().manual_seed(k * 1000 + n + warps)
    m = 64 * 16
    outs, kinds = {}, {}
    for trial in range(4):
        a, b, acc = _operands(m, k, n, gen)
        for sub, nsub in ((16, n), (64, n), (16, 16)):
            c = torch.empty(m, n, device="cuda")
            compiled = _rows_product[(m // sub, n // nsub)](a, b, acc, c, K=k, N=n, SUB=sub, NSUB=nsub, num_warps=warps)
            ptx = compiled.asm["ptx"]
            kinds[sub, nsub] = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "other"
            outs[sub, nsub] = c
        for other in ((64, n), (16, 16)):
            differ = (outs[16, n].view(torch.int32) != outs[other].view(torch.int32)).nonzero()
            assert differ.numel() == 0, (
                f"trial {trial}: {differ.shape[0]} of {m * n} elements differ between 16 x {n} ({kinds[16, n]}) and "
                f"{other[0]} x {other[1]} ({kinds[other]}) blocks (K {k}, N {n}, {warps} warps), first at "
                f"{tuple(differ[0].tolist())}"
            )
    assert kinds[16, n] == "mma.sync", kinds  # the decode step's instruction
    if torch.cuda.get_device_capability()[0] == 9:
        print(f"K {k} N {n} warps {warps}: {kinds}")
