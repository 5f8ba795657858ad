"""The launch driver (`gradsolve.warp._launch`) on a small kernel of its own: the
header it writes, outputs per trajectory, block sums over the trajectories, chunking
by the memory budget and a subset of rows -- against NumPy."""

import numpy as np
import pytest

from gradsolve.warp import _kernels, _launch, _runtime
from gradsolve.warp._launch import block_sum, count, output, per_trajectory, scalar, shared


SCALE = _launch.Signature((
    per_trajectory("x", 2), shared("w"), scalar("a"), count("m"),
    output("y", 2), output("steps", dtype=_launch.INT32), block_sum("total", 2),
))

BODY = """
    i = wp.tid()
    if i < m:
        for k in range(2):
            y[i, k] = a * x[i, k] * w[k]
            total[i, k] = x[i, k]
        if x[i, 0] > T(0.0):
            steps[i] = 1
"""


def _chunk_sizes(monkeypatch):
    """The rows of each chunk `_launch.run` launches (one `run_split` call a chunk)."""
    sizes, real = [], _runtime.run_split

    def spy(fn, n, align=1):
        sizes.append(n)
        return real(fn, n, align)
    monkeypatch.setattr(_runtime, "run_split", spy)
    return sizes


@pytest.fixture(scope="module")
def kernel():
    return _runtime.load(_kernels.header(2, 64) + "\n" + SCALE.header("scale") + BODY).scale


def test_header_is_written_from_the_signature():
    text = SCALE.header("scale")
    assert text.startswith("@wp.kernel(enable_backward=False)\ndef scale(")
    for piece in ("x: wp.array2d(dtype=T)", "w: wp.array(dtype=T)", "a: T", "m: int",
                  "y: wp.array2d(dtype=T)", "steps: wp.array(dtype=wp.int32)",
                  "total: wp.array2d(dtype=T)"):
        assert piece in text
    with pytest.raises(ValueError, match="exactly one count"):
        _launch.Signature((per_trajectory("x", 2),))
    with pytest.raises(ValueError, match="repeated parameter names"):
        _launch.Signature((count("m"), output("m")))


# One chunk; chunks of one block (64 trajectories of 52 bytes each: x, y, steps, total:
# 16 + 16 + 4 + 16), so the 150 rows go as 64 + 64 + 22.
@pytest.mark.parametrize("budget,chunks", [(1 << 30, [150]), (64 * 52, [64, 64, 22])])
def test_outputs_and_block_sums_equal_numpy(kernel, budget, chunks, monkeypatch):
    # Products of two float64 numbers and a sum of 150 rows: the sum depends on the
    # order of addition only in the last bits (bound 1e-14 relative); the products are
    # exact in both. Rows 0..149 out of 200, in any chunks: the same numbers bit for bit.
    rng = np.random.default_rng(0)
    n = 200
    x, w = rng.normal(size=(n, 2)), rng.normal(size=2)
    rows = np.arange(150)
    sizes = _chunk_sizes(monkeypatch)
    out = _launch.run(kernel, SCALE, dict(x=x, w=w, a=1.5), n=n, dtype=np.float64,
                      lanes=1, budget=budget, rows=rows)
    assert sizes == chunks
    np.testing.assert_array_equal(out.y, 1.5 * x[rows] * w)
    np.testing.assert_array_equal(out.steps, x[rows, 0] > 0)
    assert out.steps.dtype == np.int32
    np.testing.assert_allclose(out.total, x[rows].sum(axis=0), rtol=1e-14)
    whole = _launch.run(kernel, SCALE, dict(x=x, w=w, a=1.5), n=n, dtype=np.float64,
                        lanes=1, budget=1 << 30, rows=rows)
    np.testing.assert_array_equal(out.y, whole.y)
    np.testing.assert_array_equal(out.total, whole.total)


def test_per_trajectory_inputs_must_have_n_rows(kernel):
    with pytest.raises(ValueError, match="x: 3 rows, expected 4"):
        _launch.run(kernel, SCALE, dict(x=np.zeros((3, 2)), w=np.zeros(2), a=1.0), n=4,
                    dtype=np.float64, lanes=1, budget=1 << 30)


ROWS = _launch.Signature((per_trajectory("x", 3), count("m"), _launch.block_sum("total", 3)))

ROWS_BODY = """
    i = wp.tid()
    if i < m:
        for k in range(3):
            total[i, k] = x[i, k] * x[i, k]
"""


@pytest.fixture(scope="module")
def rows_kernel():
    return _runtime.load(_kernels.header(3, 64) + "\n" + ROWS.header("rows") + ROWS_BODY).rows


def test_block_sums_are_the_same_bits_whatever_the_chunking_and_threads(rows_kernel,
                                                                         monkeypatch):
    # Rows summed in fixed blocks of BLOCK trajectories, launches aligned to them: one
    # chunk or chunks of one block, one thread or two, give the same bits; the sum is
    # NumPy's to roundoff (1e-14 relative: a different order of the same 1000 terms).
    rng = np.random.default_rng(1)
    n = 1000
    x = rng.normal(size=(n, 3))
    runs = []
    sizes = _chunk_sizes(monkeypatch)
    # 48 bytes a row (x and total, 3 float64 each): a budget of BLOCK rows.
    blocks = [_launch.BLOCK] * (n // _launch.BLOCK) + [n % _launch.BLOCK] * (n % _launch.BLOCK > 0)
    for budget, threads, chunks in [(1 << 30, "1", [n]), (1 << 30, "2", [n]),
                                    (_launch.BLOCK * 48, "2", blocks),
                                    (_launch.BLOCK * 48, "1", blocks)]:
        monkeypatch.setenv("GRADSOLVE_CPU_THREADS", threads)
        sizes.clear()
        runs.append(_launch.run(rows_kernel, ROWS, dict(x=x), n=n, dtype=np.float64, lanes=1,
                                budget=budget).total)
        assert sizes == chunks, (budget, sizes)
    assert len(blocks) == 16  # 1000 rows: 15 blocks of 64 and 40
    for other in runs[1:]:
        np.testing.assert_array_equal(runs[0], other)
    np.testing.assert_allclose(runs[0], (x ** 2).sum(axis=0), rtol=1e-14)
