"""Triton log-softmax / token log-probs / fused lm_head log-probs: the interpreter on CPU tensors
(tiny shapes), the compiled kernels on CUDA (the real vocabulary)."""

import importlib

import pytest
import torch

pytest.importorskip("triton")  # imported here, in compiled mode, before any interpreted import

from vexact_vllm.kernels import dispatch, linear, log_softmax, token_log_probs  # noqa: E402

MODULE = "vexact_vllm.kernels.sampling.logprob_triton"
logprob = importlib.import_module("vexact_vllm.kernels.sampling.logprob")
logit_rules = importlib.import_module("vexact_vllm.kernels.sampling.logit_rules")
sample = importlib.import_module("vexact_vllm.kernels.sampling.sample")
BLOCK = importlib.import_module(MODULE).TRITON_VOCAB_BLOCK
VOCABS = (100, 1500, 3000, 2 * BLOCK + 37)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")



@pytest.fixture(scope="module")
def tk(import_interpreted):
    return import_interpreted(MODULE)


def _tau(temperature, n_rows, device="cpu"):
    """The fp32 [M, 1] divisor the public functions pass down (greedy 0 -> 1)."""
    return logit_rules.temperature_column(temperature, n_rows, torch.device(device))


def _reference(logits, temperature):
    tau = torch.as_tensor(temperature, dtype=torch.float64, device=logits.device).reshape(-1, 1)
    tau = torch.where(tau == 0, torch.ones_like(tau), tau)
    return torch.log_softmax(logits.double() / tau, dim=-1)


def _check_rows(mod, logits, temps, row_counts):
    """Accuracy, row alone vs in a batch, and token log-probs = log_softmax gathered, bit for bit."""
    n_rows, vocab = logits.shape
    device = logits.device
    full = mod.log_softmax_triton(logits, _tau(temps, n_rows, device))
    assert full.dtype == torch.float32 and full.shape == logits.shape
    torch.testing.assert_close(full.double(), _reference(logits, temps), rtol=1e-5, atol=1e-5)
    for m in row_counts:
        assert torch.equal(mod.log_softmax_triton(logits[:m], _tau(temps[:m], m, device)), full[:m])
    last = slice(n_rows - 1, n_rows)
    assert torch.equal(mod.log_softmax_triton(logits[last], _tau(temps[last], 1, device)), full[last])
    tokens = torch.randint(0, vocab, (n_rows,), device=device)
    tokens[0] = vocab - 1
    expected = full.gather(1, tokens[:, None])[:, 0]
    assert torch.equal(mod.token_log_probs_triton(logits, tokens, _tau(temps, n_rows, device)), expected)
    got_last = mod.token_log_probs_triton(logits[last], tokens[last], _tau(temps[last], 1, device))
    assert torch.equal(got_last, expected[last])
    return full


# ---------------------------------------------------------------------------------------------
# interpreter (CPU)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", VOCABS)
def test_accuracy_invariance_and_tokens(tk, vocab):
    logits = torch.randn(17, vocab) * 5
    temps = torch.rand(17) + 0.3
    temps[3] = 0.0
    _check_rows(tk, logits, temps, (1, 5))


def test_chunks_of_minus_infinity_and_many_chunks(tk):
    """A chunk whose logits are all -inf (a blocked vocabulary range) adds nothing and makes no NaN;
    rows spanning several chunks combine them in order (row alone == row in a batch, accurate)."""
    chunk = importlib.import_module(MODULE).TRITON_VOCAB_CHUNK
    vocab = 2 * chunk + 37  # three chunks, the last one short
    logits = torch.randn(4, vocab) * 5
    logits[1, :chunk] = float("-inf")  # row 1: its whole first chunk blocked
    logits[2, chunk : 2 * chunk] = float("-inf")  # row 2: the middle chunk
    temps = torch.tensor([1.0, 0.7, 0.0, 1.3])
    full = _check_rows(tk, logits, temps, (1, 3))
    assert torch.isfinite(full[:, -37:]).all() and (full[1, :chunk] == float("-inf")).all()


def test_temperature_semantics(tk):
    logits = torch.randn(6, 3000) * 3

    def lsm(z, temperature):
        return tk.log_softmax_triton(z, _tau(temperature, z.shape[0]))

    ones = lsm(logits, torch.ones(6))
    assert torch.equal(lsm(logits, 1.0), ones)
    assert torch.equal(lsm(logits, 0.0), ones)  # greedy: log-probs at tau = 1
    assert torch.equal(lsm(logits, 0.7), lsm(logits, torch.full((6,), 0.7)))
    assert not torch.equal(lsm(logits, 0.7), ones)
    # true fp32 division, bit for bit torch's (which a multiply by the reciprocal is not)
    tau = torch.tensor(0.7)
    assert not torch.equal(logits * (1 / tau), logits / tau)
    assert torch.equal(lsm(logits, 0.7), lsm(logits / tau, 1.0))
    temps = (0.0, 1.0, 0.5, 2.0, 0.0, 0.9)
    mixed = lsm(logits, torch.tensor(temps))
    for i, t in enumerate(temps):
        assert torch.equal(mixed[i : i + 1], lsm(logits[i : i + 1], t))


def test_kernels_apply_the_effective_temperature(tk):
    """The kernels apply `effective_temperature` themselves (so the sampler's hot path launches no
    torch ops for it): requested and effective temperatures give the same bits, also backward."""
    logits = torch.randn(7, 3000) * 3
    requested = torch.tensor([0.0, 0.005, 1e-6, 0.01, 0.7, 1.0, 2.5]).reshape(7, 1)
    effective = logit_rules.effective_temperature(requested)
    assert torch.equal(effective[:3, 0], torch.tensor([1.0, 0.01, 0.01]))  # the rule itself
    assert torch.equal(logit_rules.effective_temperature(effective), effective)  # idempotent
    assert torch.equal(tk.log_softmax_triton(logits, requested), tk.log_softmax_triton(logits, effective))
    tokens = torch.randint(0, 3000, (7,))
    got = tk.token_log_probs_triton(logits, tokens, requested)
    assert torch.equal(got, tk.token_log_probs_triton(logits, tokens, effective))
    grads = []
    for tau in (requested, effective):
        z = logits.clone().requires_grad_()
        tk.log_softmax_triton(z, tau)[:, :50].sum().backward()
        grads.append(z.grad)
    assert torch.equal(*grads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_equals_unfused(tk, dtype):
    hidden = torch.randn(23, 24).to(dtype)
    weight = (torch.randn(1500, 24) / 7).to(dtype)
    tokens = torch.randint(0, 1500, (23,))
    temps = torch.rand(23) + 0.5
    logits = linear(hidden, weight, out_dtype=torch.float32)
    expected = tk.token_log_probs_triton(logits, tokens, _tau(temps, 23))
    for chunk_rows in (1, 7, 256):
        got = tk.linear_token_log_probs_triton(hidden, weight, tokens, _tau(temps, 23), chunk_rows)
        assert got.dtype == torch.float32 and torch.equal(got, expected), chunk_rows
    got = tk.linear_token_log_probs_triton(hidden[9:10], weight, tokens[9:10], _tau(temps[9:10], 1), 256)
    assert torch.equal(got, expected[9:10])
    assert torch.equal(
        tk.linear_token_log_probs_triton(hidden, weight, tokens, _tau(0.8, 23), 5),
        tk.token_log_probs_triton(logits, tokens, _tau(0.8, 23)),
    )


def test_log_softmax_gradient(tk):
    vocab = 2 * BLOCK + 37
    logits = (torch.randn(3, vocab) * 3).requires_grad_()
    g = torch.randn(3, vocab)
    (tk.log_softmax_triton(logits, _tau(0.7, 3)) * g).sum().backward()
    ld = logits.detach().double().requires_grad_()
    (_reference(ld, 0.7) * g.double()).sum().backward()
    torch.testing.assert_close(logits.grad.double(), ld.grad, rtol=1e-5, atol=1e-5)


def test_token_log_probs_gradient(tk):
    logits = (torch.randn(5, 3000) * 3).requires_grad_()
    tokens = torch.randint(0, 3000, (5,))
    temps = torch.tensor([0.0, 0.7, 1.0, 1.3, 2.0])
    g = torch.randn(5)
    (tk.token_log_probs_triton(logits, tokens, _tau(temps, 5)) * g).sum().backward()
    ld = logits.detach().double().requires_grad_()
    (_reference(ld, temps).gather(1, tokens[:, None])[:, 0] * g.double()).sum().backward()
    torch.testing.assert_close(logits.grad.double(), ld.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backward_elements", [1, 1 << 27])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_linear_token_log_probs_gradients(tk, dtype, tol, backward_elements, monkeypatch):
    """Against float64 autograd, the backward in chunks of the forward's rows (1 element: 4 rows of 300
    logits, four dW parts summed) and in one chunk (the default budget)."""
    monkeypatch.setattr(tk, "BACKWARD_CHUNK_ELEMENTS", backward_elements)
    hidden = torch.randn(13, 24).to(dtype).requires_grad_()
    weight = (torch.randn(300, 24) / 5).to(dtype).requires_grad_()
    tokens = torch.randint(0, 300, (13,))
    temps = torch.rand(13) + 0.5
    g = torch.randn(13)
    grads = []
    for chunk_rows in (4, 256):
        hidden.grad = weight.grad = None
        (
            tk.linear_token_log_probs_triton(hidden, weight, tokens, _tau(temps, 13), chunk_rows) * g
        ).sum().backward()
        assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype
        grads.append((hidden.grad, weight.grad))
    hd, wd = (t.detach().double().requires_grad_() for t in (hidden, weight))
    ref = _reference(hd @ wd.t(), temps).gather(1, tokens[:, None])[:, 0]
    (ref * g.double()).sum().backward()
    for grad_h, grad_w in grads:
        torch.testing.assert_close(grad_h.double(), hd.grad, rtol=tol, atol=tol)
        torch.testing.assert_close(grad_w.double(), wd.grad, rtol=tol, atol=tol)


def test_bad_input_raises(tk):
    logits = torch.randn(3, 10)
    tau = _tau(1.0, 3)
    with pytest.raises(ValueError):
        tk.log_softmax_triton(logits.bfloat16(), tau)
    with pytest.raises(ValueError):
        tk.log_softmax_triton(logits, _tau(1.0, 4))
    with pytest.raises(ValueError):
        tk.log_softmax_triton(logits, tau.double())
    with pytest.raises(ValueError):
        tk.log_softmax_triton(torch.randn(3, 0), tau)
    with pytest.raises(ValueError):
        tk.log_softmax_triton(torch.randn(10, 3).t(), tau)
    with pytest.raises(ValueError):
        tk.token_log_probs_triton(logits, torch.tensor([0, 1]), tau)
    hidden, weight, tokens = torch.randn(3, 4), torch.randn(10, 4), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError):
        tk.linear_token_log_probs_triton(hidden, weight, tokens, tau, 0)
    with pytest.raises(ValueError):
        tk.linear_token_log_probs_triton(hidden, weight, tokens[:2], tau, 4)


def test_tables_register_triton():
    for table in (
        logprob._LOG_SOFTMAX_IMPLS,
        logprob._TOKEN_IMPLS,
        logprob._LINEAR_IMPLS,
        sample._GUMBEL_IMPLS,
    ):
        assert set(table) == {"torch", "triton"}


# ---------------------------------------------------------------------------------------------
# CUDA (compiled kernels, the real vocabulary)
# ---------------------------------------------------------------------------------------------

VOCAB = 151936


@pytest.mark.cuda
@requires_cuda
def test_cuda_rows_tokens_and_temperature():
    mod = importlib.import_module(MODULE)
    logits = torch.randn(300, VOCAB, device="cuda") * 5
    temps = torch.rand(300, device="cuda") + 0.3
    temps[7] = 0.0
    full = _check_rows(mod, logits, temps, (1, 2, 5, 17, 64, 257))
    for m in (1, 100, 299):
        tail = mod.log_softmax_triton(logits[300 - m :], _tau(temps[300 - m :], m, "cuda"))
        assert torch.equal(tail, full[300 - m :])
    z = logits[:8]
    tau = torch.tensor(0.7, device="cuda")
    assert not torch.equal(z * (1 / tau), z / tau)
    assert torch.equal(
        mod.log_softmax_triton(z, _tau(0.7, 8, "cuda")), mod.log_softmax_triton(z / tau, _tau(1.0, 8, "cuda"))
    )
    assert torch.equal(
        mod.log_softmax_triton(z, _tau(0.0, 8, "cuda")), mod.log_softmax_triton(z, _tau(1.0, 8, "cuda"))
    )
    with pytest.MonkeyPatch.context() as mp:  # the public ops on the Triton backend are these kernels
        mp.setattr(dispatch, "_CUDA_BACKEND", "triton")
        assert torch.equal(log_softmax(logits, temps), full)
        tokens = torch.randint(0, VOCAB, (300,), device="cuda")
        assert torch.equal(token_log_probs(logits, tokens, temps), full.gather(1, tokens[:, None])[:, 0])


@pytest.mark.cuda
@requires_cuda
def test_cuda_fused_equals_unfused_and_gradients():
    mod = importlib.import_module(MODULE)
    hidden = torch.randn(300, 256, device="cuda").bfloat16()
    weight = (torch.randn(VOCAB, 256, device="cuda") / 16).bfloat16()
    tokens = torch.randint(0, VOCAB, (300,), device="cuda")
    temps = torch.rand(300, device="cuda") + 0.5
    tau = _tau(temps, 300, "cuda")
    logits = linear(hidden, weight, out_dtype=torch.float32)
    expected = mod.token_log_probs_triton(logits, tokens, tau)
    assert torch.equal(expected, mod.log_softmax_triton(logits, tau).gather(1, tokens[:, None])[:, 0])
    for chunk_rows in (64, 256, 300):
        assert torch.equal(
            mod.linear_token_log_probs_triton(hidden, weight, tokens, tau, chunk_rows), expected
        )
    # gradients: deterministic, and close to an fp64 reference
    h = hidden[:64].float().requires_grad_()
    w = weight.float().requires_grad_()
    g = torch.randn(64, device="cuda")
    grads = []
    for _ in range(2):
        h.grad = w.grad = None
        (mod.linear_token_log_probs_triton(h, w, tokens[:64], tau[:64], 16) * g).sum().backward()
        grads.append((h.grad.clone(), w.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = _reference(hd @ wd.t(), temps[:64]).gather(1, tokens[:64, None])[:, 0]
    (ref * g.double()).sum().backward()
    torch.testing.assert_close(h.grad.double(), hd.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), wd.grad, rtol=1e-4, atol=1e-5)


def test_log_softmax_into_out(tk):
    """`log_softmax_triton(..., out=)` (the sampler graph's static log-probs): the same bits, written
    into the given rows of a larger buffer only."""
    logits = torch.randn(6, 3000) * 4
    tau = _tau(torch.tensor([0.0, 0.5, 1.0, 1.5, 0.005, 2.0]), 6)
    buf = torch.full((8, 3000), 3.0)
    assert tk.log_softmax_triton(logits, tau, out=buf[:6]).data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:6], tk.log_softmax_triton(logits, tau))
    assert torch.equal(buf[6:], torch.full((2, 3000), 3.0))
    in_place = logits.clone()  # out = logits: the sampler graphs' static buffer
    tk.log_softmax_triton(in_place, tau, out=in_place)
    assert torch.equal(in_place, buf[:6])
