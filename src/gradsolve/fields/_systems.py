"""The seed's systems. Each builder returns an `EnsembleProblem` whose trajectories
spread one physical parameter (or the initial state) evenly over a stated range, so
an ensemble is deterministic without a random key. `dtype=None` is JAX's default
float: float64 with `jax_enable_x64`, float32 without.

Beside each right-hand side `<name>_f` is its hand-written fused form, Warp source
text (`<NAME>_WARP`: `field`, and `jac` for the stiff ones), listed in `WARP_FORMS`;
`warp/_registry.py` compiles it into the fused kernels (this module imports no Warp).
The source's signatures are fixed:

    field(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> V
    jac(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> M

with `p[i, k]` trajectory i's parameter `columns[k]`, `s` the shared parameter
`shared` flattened, `T`, `V`, `M` the float, vector and matrix types and `{d}` the
state dimension.
"""

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import scipy.linalg

from ..problem import EnsembleProblem, Shared


def default_float(dtype=None):
    """`dtype`, or JAX's default float when None (float32 without x64, silently:
    asking JAX for float64 there warns on every array)."""
    return jnp.zeros((), dtype).dtype


def _linspace(lo, hi, n):
    return np.linspace(lo, hi, n) if n > 1 else np.array([0.5 * (lo + hi)])


def _spread(lo, hi, n, dtype):
    return jnp.asarray(_linspace(lo, hi, n), dtype)


def _rows(row, n, dtype):
    return jnp.asarray(np.tile(np.asarray(row, np.float64), (n, 1)), dtype)


def lorenz_f(t, y, p):
    x, u, z = y
    return jnp.stack([p["sigma"] * (u - x), x * (p["rho"] - z) - u, x * u - p["beta"] * z])


LORENZ_WARP = """
@wp.func
def field(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> V:
    return V(p[i, 0] * (y[1] - y[0]), y[0] * (p[i, 1] - y[2]) - y[1],
             y[0] * y[1] - p[i, 2] * y[2])
"""


def lorenz(n=8, *, rho=(10.0, 20.0), sigma=10.0, beta=8.0 / 3.0, t_span=(0.0, 1.0),
           y0=(1.0, 0.0, 0.0), dtype=None):
    """Lorenz ensemble; `rho` spread over `rho` (below the chaotic regime by default).

    Examples:
        >>> import gradsolve as gs
        >>> prob = gs.problems.lorenz(n=4)
        >>> prob.y0.shape, [float(r) for r in prob.params["rho"]][:2]
        ((4, 3), [10.0, 13.333333333333334])
    """
    rho = _spread(*rho, n, dtype) if isinstance(rho, tuple) else jnp.full(n, rho, dtype)
    params = {"sigma": jnp.full(n, sigma, dtype), "rho": rho, "beta": jnp.full(n, beta, dtype)}
    return EnsembleProblem(f_jax=lorenz_f, y0=_rows(y0, n, dtype), params=params,
                           t_span=t_span, name="lorenz")


def van_der_pol_f(t, y, p):
    return jnp.stack([y[1], p["mu"] * (1 - y[0] ** 2) * y[1] - y[0]])


VAN_DER_POL_WARP = """
@wp.func
def field(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> V:
    return V(y[1], p[i, 0] * (T(1.0) - y[0] * y[0]) * y[1] - y[0])
"""


def van_der_pol(n=8, *, mu=(0.5, 2.0), t_span=(0.0, 5.0), y0=(2.0, 0.0),
                dtype=None):
    """Van der Pol oscillator (non-stiff range of `mu` by default)."""
    mu = _spread(*mu, n, dtype) if isinstance(mu, tuple) else jnp.full(n, mu, dtype)
    return EnsembleProblem(f_jax=van_der_pol_f, y0=_rows(y0, n, dtype),
                           params={"mu": mu}, t_span=t_span, name="van_der_pol")


def lorenz96_f(t, y, p):
    return (jnp.roll(y, -1) - jnp.roll(y, 2)) * jnp.roll(y, 1) - y + p["F"]


LORENZ96_WARP = """
@wp.func
def field(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> V:
    out = V()
    for k in range({d}):
        out[k] = (y[(k + 1) % {d}] - y[(k + {d} - 2) % {d}]) * y[(k + {d} - 1) % {d}] \\
            - y[k] + p[i, 0]
    return out
"""


def lorenz96(n=8, *, d=8, forcing=(7.5, 8.5), t_span=(0.0, 1.0), dtype=None):
    """Lorenz-96 with `d` variables; forcing `F` spread, state `F` plus 0.01 on x_0."""
    F = _spread(*forcing, n, dtype)
    y0 = np.tile(np.asarray(F)[:, None], (1, d)).astype(np.float64)
    y0[:, 0] += 0.01
    return EnsembleProblem(f_jax=lorenz96_f, y0=jnp.asarray(y0, dtype), params={"F": F},
                           t_span=t_span, name="lorenz96")


def linear_f(t, y, p):
    return p["lam"] * (p["A"] @ y)


LINEAR_WARP = """
@wp.func
def field(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> V:
    out = V()
    for r in range({d}):
        acc = T(0.0)
        for c in range({d}):
            acc = acc + s[r * {d} + c] * y[c]
        out[r] = p[i, 0] * acc
    return out

@wp.func
def jac(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> M:
    out = M()
    for r in range({d}):
        for c in range({d}):
            out[r, c] = p[i, 0] * s[r * {d} + c]
    return out
"""


def _linear_problem(A, n, lam, t_span, seed, dtype, stiff, name):
    d = A.shape[0]
    y0 = np.random.default_rng(seed).normal(size=(n, d))
    return EnsembleProblem(
        f_jax=linear_f, y0=jnp.asarray(y0, dtype),
        params={"lam": _spread(*lam, n, dtype), "A": Shared(jnp.asarray(A, dtype))},
        t_span=t_span, stiff=stiff, name=name)


def linear(n=8, *, d=4, lam=(0.5, 1.5), t_span=(0.0, 1.0), seed=0, dtype=None):
    """`y' = lam * A y`: one shared damped-rotation matrix `A` (eigenvalues
    `-0.5 +- i w`), a per-trajectory rate `lam`. Closed form: `linear_exact`."""
    rng = np.random.default_rng(seed + 1)
    S = rng.normal(size=(d, d)) / np.sqrt(d)
    A = -0.5 * np.eye(d) + (S - S.T)
    return _linear_problem(A, n, lam, t_span, seed, dtype, False, "linear")


def linear_stiff(n=8, *, d=8, lam=(0.5, 1.5), stiffness=1e4, t_span=(0.0, 1.0), seed=0,
                 dtype=None):
    """`y' = lam * A y` with `A = Q diag(-logspace(0, log10(stiffness), d)) Q^T`:
    decay rates spread over `stiffness` decades' ratio. Closed form: `linear_exact`."""
    rng = np.random.default_rng(seed + 1)
    Q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    A = Q @ np.diag(-np.logspace(0, np.log10(stiffness), d)) @ Q.T
    return _linear_problem(A, n, lam, t_span, seed, dtype, True, "linear_stiff")


def linear_exact(prob, t):
    """Closed-form states `expm(lam_i A (t - t0)) y0_i` of a `linear`/`linear_stiff`
    problem, computed in float64 with SciPy (independent of the integrators)."""
    A = np.asarray(prob.params["A"].value, np.float64)
    lam = np.asarray(prob.params["lam"], np.float64)
    y0 = np.asarray(prob.y0, np.float64)
    dt = float(t) - float(prob.t_span[0])
    return np.stack([scipy.linalg.expm(l * dt * A) @ y for l, y in zip(lam, y0)])


def robertson_f(t, y, p):
    y1, y2, y3 = y
    r1 = p["k1"] * y1
    r2 = p["k2"] * y2 * y2
    r3 = p["k3"] * y2 * y3
    return jnp.stack([-r1 + r3, r1 - r2 - r3, r2])


ROBERTSON_WARP = """
@wp.func
def field(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> V:
    r1 = p[i, 0] * y[0]
    r2 = p[i, 1] * y[1] * y[1]
    r3 = p[i, 2] * y[1] * y[2]
    return V(-r1 + r3, r1 - r2 - r3, r2)


@wp.func
def jac(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> M:
    k1 = p[i, 0]
    k2 = p[i, 1]
    k3 = p[i, 2]
    return M(-k1, k3 * y[2], k3 * y[1],
             k1, -T(2.0) * k2 * y[1] - k3 * y[2], -k3 * y[1],
             T(0.0), T(2.0) * k2 * y[1], T(0.0))
"""


def robertson(n=8, *, k1=(0.03, 0.05), k2=3e7, k3=(0.8e4, 1.2e4), t_span=(0.0, 100.0),
              dtype=None):
    """Robertson's stiff kinetics; rates `k1` and `k3` spread, `k2` fixed."""
    params = {"k1": _spread(*k1, n, dtype), "k2": jnp.full(n, k2, dtype),
              "k3": _spread(*k3, n, dtype)}
    return EnsembleProblem(f_jax=robertson_f, y0=_rows((1.0, 0.0, 0.0), n, dtype),
                           params=params, t_span=t_span, stiff=True, name="robertson")


def hires_f(t, y, p):
    y1, y2, y3, y4, y5, y6, y7, y8 = y
    r = 280.0 * y6 * y8
    return jnp.stack([
        -1.71 * y1 + 0.43 * y2 + 8.32 * y3 + 0.0007,
        1.71 * y1 - 8.75 * y2,
        -10.03 * y3 + 0.43 * y4 + 0.035 * y5,
        8.32 * y2 + 1.71 * y3 - 1.12 * y4,
        -1.745 * y5 + 0.43 * y6 + 0.43 * y7,
        -r + 0.69 * y4 + 1.71 * y5 - 0.43 * y6 + 0.69 * y7,
        r - 1.81 * y7,
        -r + 1.81 * y7,
    ])


HIRES_WARP = """
@wp.func
def field(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> V:
    r = T(280.0) * y[5] * y[7]
    out = V()
    out[0] = -T(1.71) * y[0] + T(0.43) * y[1] + T(8.32) * y[2] + T(0.0007)
    out[1] = T(1.71) * y[0] - T(8.75) * y[1]
    out[2] = -T(10.03) * y[2] + T(0.43) * y[3] + T(0.035) * y[4]
    out[3] = T(8.32) * y[1] + T(1.71) * y[2] - T(1.12) * y[3]
    out[4] = -T(1.745) * y[4] + T(0.43) * y[5] + T(0.43) * y[6]
    out[5] = -r + T(0.69) * y[3] + T(1.71) * y[4] - T(0.43) * y[5] + T(0.69) * y[6]
    out[6] = r - T(1.81) * y[6]
    out[7] = -r + T(1.81) * y[6]
    return out


@wp.func
def jac(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> M:
    J = M()
    J[0, 0] = -T(1.71)
    J[0, 1] = T(0.43)
    J[0, 2] = T(8.32)
    J[1, 0] = T(1.71)
    J[1, 1] = -T(8.75)
    J[2, 2] = -T(10.03)
    J[2, 3] = T(0.43)
    J[2, 4] = T(0.035)
    J[3, 1] = T(8.32)
    J[3, 2] = T(1.71)
    J[3, 3] = -T(1.12)
    J[4, 4] = -T(1.745)
    J[4, 5] = T(0.43)
    J[4, 6] = T(0.43)
    J[5, 3] = T(0.69)
    J[5, 4] = T(1.71)
    J[5, 5] = -T(0.43) - T(280.0) * y[7]
    J[5, 6] = T(0.69)
    J[5, 7] = -T(280.0) * y[5]
    J[6, 5] = T(280.0) * y[7]
    J[6, 6] = -T(1.81)
    J[6, 7] = T(280.0) * y[5]
    J[7, 5] = -T(280.0) * y[7]
    J[7, 6] = T(1.81)
    J[7, 7] = -T(280.0) * y[5]
    return J
"""


def hires(n=8, *, y1=(0.9, 1.1), t_span=(0.0, 321.8122), dtype=None):
    """HIRES (8 species, stiff); no free rate: the ensemble spreads `y1(0)`."""
    y0 = np.tile([1.0, 0, 0, 0, 0, 0, 0, 0.0057], (n, 1))
    y0[:, 0] = _linspace(*y1, n)
    return EnsembleProblem(f_jax=hires_f, y0=jnp.asarray(y0, dtype), params=None,
                           t_span=t_span, stiff=True, name="hires")


def galactic_halo_f(t, y, p):
    pos, vel = y[:3], y[3:]
    x, u, z = pos
    q2 = p["q"] ** 2
    denom = p["r_c"] ** 2 + x * x + u * u + z * z / q2
    acc = -(p["v_c"] ** 2) * jnp.stack([x, u, z / q2]) / denom
    return jnp.concatenate([vel, acc])


def galactic_halo(n=8, *, q=(0.7, 0.95), v_c=1.0, r_c=0.1, t_span=(0.0, 10.0),
                  dtype=None):
    """Stellar orbits in the logarithmic halo `Phi = v_c^2/2 ln(r_c^2 + x^2 + y^2 +
    z^2/q^2)`; the flattening `q` is spread; orbits start at x = 1 with a spread of
    tangential and vertical velocities."""
    s = np.linspace(0.0, 1.0, n) if n > 1 else np.array([0.5])
    y0 = np.stack([np.ones(n), np.zeros(n), 0.1 + 0.2 * s,
                   np.zeros(n), 0.6 + 0.3 * s, 0.1 + 0.2 * s[::-1]], axis=1)
    params = {"q": _spread(*q, n, dtype), "v_c": Shared(jnp.asarray(v_c, dtype)),
              "r_c": Shared(jnp.asarray(r_c, dtype))}
    return EnsembleProblem(f_jax=galactic_halo_f, y0=jnp.asarray(y0, dtype),
                           params=params, t_span=t_span, name="galactic_halo")


class WarpForm(NamedTuple):
    """A right-hand side's hand-written fused form (see the module docstring)."""

    name: str
    source: str  # Warp source, `{d}` the state dimension
    columns: tuple[str, ...]  # the per-trajectory parameters, in `p[i, k]` order
    shared: str | None = None  # the `gs.Shared` parameter read as `s`
    stiff: bool = False  # `source` defines `jac`
    d: int | None = None  # the one state dimension it is written for (None: any)


WARP_FORMS = {
    lorenz_f: WarpForm("lorenz", LORENZ_WARP, ("sigma", "rho", "beta"), d=3),
    van_der_pol_f: WarpForm("van_der_pol", VAN_DER_POL_WARP, ("mu",), d=2),
    lorenz96_f: WarpForm("lorenz96", LORENZ96_WARP, ("F",)),
    linear_f: WarpForm("linear", LINEAR_WARP, ("lam",), shared="A", stiff=True),
    robertson_f: WarpForm("robertson", ROBERTSON_WARP, ("k1", "k2", "k3"), stiff=True, d=3),
    hires_f: WarpForm("hires", HIRES_WARP, (), stiff=True, d=8),
}
