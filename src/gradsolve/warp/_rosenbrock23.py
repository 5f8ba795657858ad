"""Rosenbrock23's step bodies for the fused kernels, written by hand (the only method
whose kernels are not generated from a tableau; its two constants are read from
`methods.rosenbrock23`'s): the trial step, the plain step (with `w_inverse` and a
Gauss--Jordan `inverse` of W), and the plain step's adjoint. `_steps.EMITTERS` holds
them beside the generated explicit Runge--Kutta ones."""

from ..methods import Rosenbrock23
from ._source import lit


_INVERSE = '''

@wp.func
def inverse(A: M) -> M:
    # Gauss--Jordan elimination with partial pivoting: W is factored once per step
    # and every stage is a matrix-vector product with its inverse.
    a = A
    inv = wp.identity(n=D, dtype=T)
    for c in range(D):
        piv = c
        big = wp.abs(a[c, c])
        for r in range(c + 1, D):
            if wp.abs(a[r, c]) > big:
                big = wp.abs(a[r, c])
                piv = r
        if piv != c:
            for k in range(D):
                tmp = a[c, k]
                a[c, k] = a[piv, k]
                a[piv, k] = tmp
                tmp = inv[c, k]
                inv[c, k] = inv[piv, k]
                inv[piv, k] = tmp
        scale = T(1.0) / a[c, c]
        for k in range(D):
            a[c, k] = a[c, k] * scale
            inv[c, k] = inv[c, k] * scale
        for r in range(D):
            if r != c:
                m = a[r, c]
                for k in range(D):
                    a[r, k] = a[r, k] - m * a[c, k]
                    inv[r, k] = inv[r, k] - m * inv[c, k]
    return inv
'''


def trial(method: Rosenbrock23) -> list[str]:
    e32 = lit(method.tableau.e32)
    return [
        "Wi = w_inverse(t, y, h, p, s, i)",
        "k1 = Wi * f0",
        "f1 = field(t + T(0.5) * h, y + (T(0.5) * h) * k1, p, s, i)",
        "k2 = Wi * (f1 - k1) + k1",
        "y_new = y + h * k2",
        "f_new = field(t + h, y_new, p, s, i)",
        f"k3 = Wi * (f_new - {e32} * (k2 - f1) - T(2.0) * (k1 - f0))",
        "err = (h / T(6.0)) * (k1 - T(2.0) * k2 + k3)",
    ]


def plain(method: Rosenbrock23) -> str:
    return _INVERSE + f'''

@wp.func
def w_inverse(t: T, y: V, h: T, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> M:
    return inverse(wp.identity(n=D, dtype=T) - (h * {lit(method.tableau.d)}) * jac(t, y, p, s, i))


@wp.func
def plain(t: T, y: V, h: T, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> V:
    if h == T(0.0):
        return y
    Wi = w_inverse(t, y, h, p, s, i)
    k1 = Wi * field(t, y, p, s, i)
    f1 = field(t + T(0.5) * h, y + (T(0.5) * h) * k1, p, s, i)
    return y + h * (Wi * (f1 - k1) + k1)
'''


_ROSENBROCK23_STEP_VJP = '''

@wp.func
def step_vjp(t: T, y: V, h: T, lam: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T),
             i: int, gp: wp.array2d(dtype=T), gs: wp.array2d(dtype=T)) -> V:
    if h == T(0.0):
        return lam
    f0 = field(t, y, p, s, i)
    Wi = w_inverse(t, y, h, p, s, i)
    WiT = wp.transpose(Wi)
    k1 = Wi * f0
    y1 = y + (T(0.5) * h) * k1
    f1 = field(t + T(0.5) * h, y1, p, s, i)
    u = f1 - k1
    ak2 = h * lam
    au = WiT * ak2
    ay1 = field_vjp(t + T(0.5) * h, y1, au, p, s, i, gp, gs)
    ak1 = ak2 - au + (T(0.5) * h) * ay1
    af0 = WiT * ak1
    aJ = (h * {gamma}) * (WiT * (wp.outer(ak2, u) + wp.outer(ak1, f0)) * WiT)
    a0 = field_vjp(t, y, af0, p, s, i, gp, gs)
    return lam + ay1 + a0 + jac_vjp(t, y, aJ, p, s, i, gp, gs)
'''


def step_vjp(method: Rosenbrock23) -> str:
    """`step_vjp` of Rosenbrock23's plain step (`plain`):

        W = I - h d J,  k1 = W^-1 f0,  y1 = y + (h/2) k1,  k2 = W^-1 (f1 - k1) + k1,
        y_new = y + h k2.

    Its adjoint recomputes W^-1, k1 and f1 from `y` and goes back through them: each
    solve's adjoint is a product with W^-T (a transposed solve, with the inverse the
    step already formed), and the inverse's own adjoint, `adj(W^-1) = adj(k2) u^T +
    adj(k1) f0^T` (u = f1 - k1), reaches the Jacobian as `adj(J) = h d W^-T adj(W^-1)
    W^-T`, which `jac_vjp` (the translated VJP of `jax.jacfwd` of the field) takes on
    to `y` and the parameters."""
    return _ROSENBROCK23_STEP_VJP.format(gamma=lit(method.tableau.d))
