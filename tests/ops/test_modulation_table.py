"""`adaln_lab.modulation_table`: diffusers' `adaln_proj` table upcast to float32, its launch ops (`launch.forward` /
`launch.backward`, writing caller-allocated outputs) and its one autograd node, exact float64 backward; GPU: table.cu
against cuBLAS, T-invariant rows, fallbacks, gradients against float64. The exact gradients' float64 products
(`exact.weight_grad`, `exact.input_grad`) in their documented order on any device."""

import pytest
import torch

from adaln_lab import modulation_table
from adaln_lab.ops.modulation_table import launch
from adaln_lab.reference import block as br

diffusers = pytest.importorskip("diffusers", reason="the test extra brings diffusers 0.42")
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AdaLayerNormModulation  # noqa: E402

H, D, T = 16, 24, 3


def _inputs(dtype=torch.bfloat16, temb_dtype=torch.float32, T_=T, H_=H, D_=D, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    temb = torch.randn(T_, D_, generator=g).to(temb_dtype)
    weight = (torch.randn(18 * H_, D_, generator=g) * D_ ** -0.5).to(dtype)
    bias = (torch.randn(18 * H_, generator=g) * 0.1).to(dtype)
    return temb.to(device), weight.to(device), bias.to(device)


def _table_outputs(temb, weight, route):
    """(table, table_bf16) of launch.forward: table (T, N) in promote_types(weight, float32); on the kernels the
    table kernel's bf16 buffer (its output, then its act scratch: `launch.bf16_elements`), None in the torch code."""
    T_, N = temb.shape[0], weight.shape[0]
    table = torch.empty(T_, N, dtype=torch.promote_types(weight.dtype, torch.float32), device=temb.device)
    if route != "cupy":
        return table, None
    return table, torch.empty(launch.bf16_elements(T_, N, temb.shape[1]), dtype=torch.bfloat16, device=temb.device)


def _grad_outputs(temb, weight, bias):
    """d_temb, d_weight, d_bias of launch.backward, in the inputs' dtypes."""
    return torch.empty_like(temb), torch.empty_like(weight), torch.empty_like(bias)


def table_backward(d_table, temb, weight, bias, route="torch"):
    """(d_temb, d_weight, d_bias) of launch.backward: route "torch" is the exact float64 derivative."""
    grads = _grad_outputs(temb, weight, bias)
    launch.backward(d_table, temb, weight, route, *grads)
    return grads


def _grads(fn, leaves, d_out):
    leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    fn(*leaves).backward(d_out)
    return [t.grad for t in leaves]


def _rel_l2(value, ref):
    ref = ref.double()
    return float((value.double() - ref).norm() / ref.norm())


# (param dtype, temb dtype): the checkpoint's mixed layout, a model cast wholesale, fp32, fp16, fp64
DTYPES = [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
          (torch.float16, torch.float32), (torch.float64, torch.float64)]


@pytest.mark.parametrize("dtype,temb_dtype", DTYPES)
def test_table_is_diffusers_adaln_proj_upcast_exactly(dtype, temb_dtype):
    temb, weight, bias = _inputs(dtype, temb_dtype)
    module = MiniMaxH3AdaLayerNormModulation(D, H).to(dtype)
    with torch.no_grad():
        module.linear.weight.copy_(weight)
        module.linear.bias.copy_(bias)
        want = module(temb)  # diffusers' six (3T, H) chunks in the projection's dtype
    table = modulation_table(temb, weight, bias)
    assert table.shape == (T, 18 * H) and table.dtype == torch.promote_types(dtype, torch.float32)
    assert table.is_contiguous()
    assert torch.equal(table, br.replay_table(temb, weight, bias).to(table.dtype))
    for got, expected in zip(br.table_chunks(table, H), want):
        assert got.shape == (3 * T, H) and got.stride() == (6 * H, 1)
        assert torch.equal(got.to(dtype), expected)  # the cast back is exact
    assert torch.equal(modulation_table(temb, weight, bias, table_backend="torch"), table)  # CPU: the same code


def test_backward_is_the_exact_derivative_and_at_least_as_accurate_as_diffusers():
    """d_weight, d_bias: float64 sums rounded once (one rounding of the golden, a bf16 ulp at most); d_temb
    float32 from float64. diffusers' bf16 table takes a bf16 gradient and uses the rounded SiLU."""
    temb, weight, bias = _inputs(seed=1, T_=5)
    d_table = torch.randn(5, 18 * H, generator=torch.Generator().manual_seed(2)).bfloat16().float()
    ours = _grads(modulation_table, (temb, weight, bias), d_table)
    golden = _grads(br.golden_table, (temb.double(), weight.double(), bias.double()), d_table.double())
    theirs = _grads(br.replay_table, (temb, weight, bias), d_table.bfloat16())
    for got, gold, dtype in zip(ours, golden, (torch.float32, torch.bfloat16, torch.bfloat16)):
        assert got.dtype == dtype
        ulp = gold.abs() * 2.0 ** -(7 if dtype == torch.bfloat16 else 22) + 1e-30  # one ulp
        assert ((got.double() - gold).abs() <= ulp).all()
    for name, got, theirs_, gold in zip(("temb", "weight", "bias"), ours, theirs, golden):
        assert _rel_l2(got, gold) <= _rel_l2(theirs_, gold), name


def test_gradients_flow_from_the_chunks_in_float32_and_repeat_bitwise():
    temb, weight, bias = _inputs(seed=3)

    def chunk_sum(temb, weight, bias):
        chunks = br.table_chunks(modulation_table(temb, weight, bias), H)
        return sum((c * (k + 1)).sum() for k, c in enumerate(chunks))

    first = _grads(chunk_sum, (temb, weight, bias), torch.tensor(1.0))
    second = _grads(chunk_sum, (temb, weight, bias), torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    d_table = torch.arange(1.0, 7.0).repeat_interleave(H).repeat(3).expand(T, -1)  # each chunk's factor
    expected = table_backward(d_table.contiguous(), temb, weight, bias)
    assert all(torch.equal(a, b) for a, b in zip(first, expected))


@pytest.mark.parametrize("dtype,temb_dtype", DTYPES[:3])
def test_opcheck(dtype, temb_dtype):
    temb, weight, bias = (t.requires_grad_(True) for t in _inputs(dtype, temb_dtype))
    outputs = _table_outputs(temb, weight, "torch")
    torch.library.opcheck(launch.forward.op, (temb, weight, bias, "torch", "cuda", *outputs))
    d_table = torch.randn(T, 18 * H)
    temb, weight, bias = temb.detach(), weight.detach(), bias.detach()
    torch.library.opcheck(launch.backward.op, (d_table, temb, weight, "torch", *_grad_outputs(temb, weight, bias)))


def test_fake_kernel_on_meta_tensors():
    """The launch ops' no-op fakes serve meta tensors (nothing written, nothing returned), and the node on meta
    tensors allocates the table and, backward, the gradients in their dtypes."""
    temb, weight, bias = (t.to("meta").requires_grad_(True) for t in _inputs())
    table = modulation_table(temb, weight, bias)
    assert table.device.type == "meta" and table.shape == (T, 18 * H) and table.dtype == torch.float32
    table.backward(torch.empty_like(table))
    assert (temb.grad.dtype, weight.grad.dtype, bias.grad.dtype) == (torch.float32, torch.bfloat16, torch.bfloat16)
    assert all(t.grad.device.type == "meta" and t.grad.shape == t.shape for t in (temb, weight, bias))
    temb, weight, bias = temb.detach(), weight.detach(), bias.detach()
    assert torch.ops.adaln_lab.modulation_table_fwd(temb, weight, bias, "cupy", "cuda",
                                                    *_table_outputs(temb, weight, "cupy")) is None
    assert torch.ops.adaln_lab.modulation_table_bwd(table.detach(), temb, weight, "cupy",
                                                    *_grad_outputs(temb, weight, bias)) is None


def test_compile_fullgraph_matches_eager():
    temb, weight, bias = _inputs(seed=4)
    compiled = torch.compile(modulation_table, fullgraph=True, backend="aot_eager")
    d_table = torch.randn(T, 18 * H)
    eager = _grads(modulation_table, (temb, weight, bias), d_table)
    traced = _grads(compiled, (temb, weight, bias), d_table)
    assert torch.equal(compiled(temb, weight, bias), modulation_table(temb, weight, bias))
    assert all(torch.equal(a, b) for a, b in zip(eager, traced))


def test_bad_inputs_are_refused_naming_the_argument():
    temb, weight, bias = _inputs()
    with pytest.raises(ValueError, match="table_backend"):
        modulation_table(temb, weight, bias, table_backend="cublas")
    with pytest.raises(ValueError, match="shapes"):
        modulation_table(temb[0], weight, bias)
    with pytest.raises(ValueError, match="disagree"):
        modulation_table(temb[:, :-1], weight, bias)
    with pytest.raises(ValueError, match="disagree"):
        modulation_table(temb, weight, bias[:-1])
    with pytest.raises(TypeError, match="temb"):
        modulation_table(temb.long(), weight, bias)


# ---------------------------------------------------------------- GPU (H200) ----------------------------------

GH, GD, GT = 256, 128, 3


@pytest.mark.gpu
def test_cuda_table_against_cublas_and_t_invariant():
    """table_backend="torch": F.linear on the GPU, diffusers' bits. "cuda": table.cu, equal to cuBLAS's on
    >= 99.9 % of entries, every entry within the fp32 dot-product bound of the exact table plus one bf16
    rounding (as cuBLAS's), and whose rows do not depend on the other timesteps."""
    from ..core.test_tensors import assert_table_within_the_dot_product_bound

    temb, weight, bias = _inputs(T_=GT, H_=GH, D_=GD, device="cuda")
    want = br.replay_table(temb, weight, bias).float()
    assert torch.equal(modulation_table(temb, weight, bias, table_backend="torch"), want)
    table = modulation_table(temb, weight, bias)
    assert table.dtype == torch.float32 and torch.equal(table, table.bfloat16().float())
    assert (table == want).float().mean().item() >= 0.999
    assert_table_within_the_dot_product_bound(table, temb, weight, bias)
    assert_table_within_the_dot_product_bound(want, temb, weight, bias)
    for rows in ([2], [1, 0], [0, 2]):
        assert torch.equal(modulation_table(temb[rows].contiguous(), weight, bias), table[rows])
    # bf16 temb (a model cast wholesale) is widened exactly for the kernels: the same table as its fp32 copy
    t16 = temb.bfloat16()
    assert torch.equal(modulation_table(t16, weight, bias), modulation_table(t16.float(), weight, bias))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,temb_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float64)])
def test_cuda_falls_back_to_torch_for_what_the_kernels_do_not_take(dtype, temb_dtype):
    temb, weight, bias = _inputs(dtype, temb_dtype, T_=GT, H_=GH, D_=GD, device="cuda")
    table = modulation_table(temb, weight, bias)
    assert torch.equal(table, br.replay_table(temb, weight, bias).to(table.dtype))
    d_table = torch.randn_like(table)
    got = _grads(modulation_table, (temb, weight, bias), d_table)
    want = table_backward(d_table.cpu(), temb.cpu(), weight.cpu(), bias.cpu())
    for a, b in zip(got, want):
        assert torch.allclose(a.cpu().double(), b.double(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("temb_dtype", [torch.float32, torch.bfloat16])
def test_cuda_backward_against_float64_repeatable_and_no_worse_than_diffusers(temb_dtype):
    temb, weight, bias = _inputs(temb_dtype=temb_dtype, T_=GT, H_=GH, D_=GD, device="cuda")
    d_table = torch.randn(GT, 18 * GH, device="cuda").bfloat16().float()
    ours = _grads(modulation_table, (temb, weight, bias), d_table)
    again = _grads(modulation_table, (temb, weight, bias), d_table)
    assert all(torch.equal(a, b) for a, b in zip(ours, again))
    assert [g.dtype for g in ours] == [temb_dtype, torch.bfloat16, torch.bfloat16]
    golden = _grads(br.golden_table, (temb.double(), weight.double(), bias.double()), d_table.double())
    theirs = _grads(br.replay_table, (temb, weight, bias), d_table.bfloat16())
    for name, got, theirs_, gold in zip(("temb", "weight", "bias"), ours, theirs, golden):
        assert _rel_l2(got, gold) <= _rel_l2(theirs_, gold) * 1.001 + 1e-7, name


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["cupy", "torch"])
def test_cuda_opcheck(route):
    temb, weight, bias = (t.requires_grad_(True) for t in _inputs(T_=GT, H_=GH, D_=GD, device="cuda"))
    torch.library.opcheck(launch.forward.op, (temb, weight, bias, route, "cuda", *_table_outputs(temb, weight, route)))
    d_table = torch.randn(GT, 18 * GH, device="cuda")
    temb, weight, bias = temb.detach(), weight.detach(), bias.detach()
    torch.library.opcheck(launch.backward.op, (d_table, temb, weight, route, *_grad_outputs(temb, weight, bias)))


def _tree(values: list[float]) -> float:
    """input_grad's order in Python floats (IEEE float64): the upper half added onto the lower until one is left."""
    values, n = list(values), len(values)
    while n > 1:
        half = (n + 1) // 2
        for i in range(n - half):
            values[i] = values[i] + values[half + i]
        n = half
    return values[0]


def _exact_parts(seed: int, U: int = 3, N: int = 37, D: int = 5):
    g = torch.Generator().manual_seed(seed)
    d_table = torch.randn(U, N, generator=g) * torch.exp2(torch.randint(-20, 20, (U, N), generator=g).float())
    weight = torch.randn(N, D, generator=g).bfloat16()
    act = torch.nn.functional.silu(torch.randn(U, D, generator=g, dtype=torch.float64))
    return d_table, weight, act


def test_the_table_products_follow_their_documented_order_whatever_the_blocks(monkeypatch):
    """weight_grad (a sum over u in order, a product and an add a rounding each) and input_grad (exact products, a
    pairwise tree fixed by N) equal the same order replayed in Python floats, for the whole tensor, blocks of 1 or 7
    products' rows or columns, and a block of rows alone (a shard); a sequential sum (a planted other order) differs
    from input_grad's tree for some column, so the replay can tell orders apart."""
    from adaln_lab.ops.modulation_table import exact

    d_table, weight, act = _exact_parts(0)
    (U, N), D = d_table.shape, act.shape[1]
    want_w = torch.tensor([[_sequential([float(d_table[u, n]) * float(act[u, d]) for u in range(U)])
                            for d in range(D)] for n in range(N)], dtype=torch.float64)
    want_a = torch.tensor([[_tree([float(d_table[u, n]) * float(weight[n, d]) for n in range(N)])
                            for d in range(D)] for u in range(U)], dtype=torch.float64)
    planted = torch.tensor([[_sequential([float(d_table[u, n]) * float(weight[n, d]) for n in range(N)])
                             for d in range(D)] for u in range(U)], dtype=torch.float64)
    assert not torch.equal(planted, want_a)
    for elements in (exact.PRODUCT_ELEMENTS, 1, 7 * D, 2 * N):  # whole; one a block; 7 rows of 37; 2 columns of 5
        monkeypatch.setattr(exact, "PRODUCT_ELEMENTS", elements)
        assert torch.equal(exact.weight_grad(d_table, act, torch.float64, "cpu"), want_w), elements
        assert torch.equal(exact.input_grad(d_table, weight, "cpu"), want_a), elements
        assert torch.equal(exact.weight_grad(d_table, act, torch.float64, "cpu", slice(5, 19)), want_w[5:19])


def _sequential(values: list[float]) -> float:
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total


@pytest.mark.gpu
def test_the_table_products_are_the_same_bits_on_the_gpu():
    """TableSums' float64 products run on the parameters' device: CUDA gives the CPU's bits (the same elementwise
    order), at a shape that takes several blocks."""
    from adaln_lab.ops.modulation_table import exact

    d_table, weight, act = _exact_parts(1, U=3, N=4099, D=9000)
    for f in (lambda dev: exact.weight_grad(d_table, act, torch.bfloat16, dev),
              lambda dev: exact.input_grad(d_table, weight, dev)):
        assert torch.equal(f("cuda").cpu(), f("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, bits", [(torch.float32, torch.int32), (torch.bfloat16, torch.int16)])
def test_the_weight_products_kernel_gives_the_torch_codes_bits(dtype, bits, monkeypatch):
    """exact_products.cu's one pass (with a compiled unit, as a block's write uses it) against weight_grad's torch ops
    on the CPU: the same bits, compared as integers (so -0 and +0 differ), for the whole gradient and a block of rows
    (a shard's), at U 1, 3 and 9 (tiles of 8 rows: ragged last tiles, ragged column blocks; a grid of 2 tiles' rows
    whose threads stride over the rest), with sums that round to float32 subnormals and to FLT_MIN, overflow to inf,
    and are -0 (each made, as the asserts after the first loop check)."""
    from adaln_lab.core import tensors
    from adaln_lab.ops.modulation_table import exact

    d_table, _, act = _exact_parts(2, U=3, N=4099, D=1000)
    d_table[:, :64] *= 2.0 ** -140                    # products about 2^-141 and below: subnormal in float32
    d_table[:, 64:80], act[:, :8] = 3e38, 1e10        # past float32's range: inf
    d_table[:, 80:96] = -0.0                          # -0 times act: a sum of signed zeros
    act[:, 8:16] = -act[:, 8:16].abs()
    kernels = tensors.context(0, 64, 8, 9, 1)[2]
    for rows in (None, slice(7, 2050)):
        want = exact.weight_grad(d_table, act, dtype, "cpu", rows)
        got = exact.weight_grad(d_table, act, dtype, "cuda", rows, kernels).cpu()
        assert torch.equal(got.view(bits), want.view(bits)), rows
    assert bool((want.float().abs() < 2.0 ** -126).logical_and(want != 0).any())  # subnormals were made
    assert bool(want.isinf().any()) and bool((want.view(bits) == torch.iinfo(bits).min).any())  # inf and -0
    for U, rows, tiles in ((1, None, None), (9, slice(3, 70), None), (3, slice(1, 74), 2)):
        # one timestep; more than a tile's rows with a ragged last tile; then 2 tiles a grid: the stride loop
        if tiles is not None:
            monkeypatch.setattr(exact, "WEIGHT_TILES_MAX", tiles)
        d_table, _, act = _exact_parts(3, U=U, N=75, D=300)
        want = exact.weight_grad(d_table, act, dtype, "cpu", rows)
        assert torch.equal(exact.weight_grad(d_table, act, dtype, "cuda", rows, kernels).cpu().view(bits),
                           want.view(bits)), U


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_input_products_kernels_give_the_torch_codes_bits(dtype):
    """exact_products.cu's input passes (five levels of the tree a launch) against input_grad's torch ops on the CPU:
    the same float64 bits, compared as integers, for N of one level, of levels not a multiple of five, odd sizes
    along the way, and H3's block width (N = 18 * 5376: 96768 -> 3024 -> 95 -> 3 -> 1), with products spread over
    2^80 so that the order of the adds shows (a sequential sum differs), and subnormal, zero and -0 weights (the
    unit's -ftz must not flush a subnormal weight: a column of them alone is checked nonzero)."""
    from adaln_lab.core import tensors
    from adaln_lab.ops.modulation_table import exact

    kernels = tensors.context(0, 64, 8, 9, 1)[2]
    for N, D in ((1, 3), (31, 40), (33, 7), (1025, 65), (4099, 130), (96768, 24)):
        d_table, weight, _ = _exact_parts(N, U=3, N=N, D=D)
        d_table *= torch.exp2(torch.randint(-20, 20, (1, N), generator=torch.Generator().manual_seed(N)).float())
        weight = weight.to(dtype)
        weight[:, 0] = torch.randn(N, generator=torch.Generator().manual_seed(1)).to(dtype) * 2.0 ** -130  # subnormal
        weight[: N // 2, 1] = -0.0
        want = exact.input_grad(d_table, weight, "cpu")
        assert bool(want[:, 0].ne(0).all()) and bool((weight[:, 0].float().abs() < 2.0 ** -126).all())
        got = exact.input_grad(d_table, weight, "cuda", kernels).cpu()
        assert torch.equal(got.view(torch.int64), want.view(torch.int64)), N
    sequential = (d_table.double()[:, :, None] * weight.double()[None]).cumsum(1)[:, -1]
    assert not torch.equal(sequential, want)
