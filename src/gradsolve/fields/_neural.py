"""Neural right-hand sides: the seed's neural experiments as `EnsembleProblem`s whose
fields call an Equinox MLP held in `gs.Shared`.

- `neural_spiral`: a 2-D neural ODE `y' = MLP(y)`, the classic spiral of torchdiffeq's
  and Diffrax's neural ODE examples, with its true field (`spiral_f`) for the data.
- `neural_robertson`: Robertson's kinetics with the autocatalytic rate written as
  `k2 y2^2 exp(MLP(y))`, the MLP started at zero output (plain Robertson), and the
  "true" chemistry the recipe fits, `k2 y2^2 (1 + 2 y3)` (`robertson_true_f`).

Neither field is registered: built with `fused=True`, the translator writes their
fused (Warp) forms, MLP included, so every gradient engine can run them.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..problem import EnsembleProblem, Shared
from ._systems import _linspace, default_float


# The spiral's true field: y' = A^T y^3 (cubes elementwise), a slow inward spiral.
SPIRAL_A = ((-0.1, 2.0), (-2.0, -0.1))


def spiral_f(t, y, p):
    return (y ** 3) @ jnp.asarray(SPIRAL_A, y.dtype)


def neural_f(t, y, p):
    return p["net"](y)


def neural_spiral(n=32, *, key=None, width=64, depth=2, t_span=(0.0, 10.0),
                  activation=jnp.tanh, dtype=None):
    """`y' = MLP(y)` for n initial states spread over the spiral's start region.

    Args:
        n: trajectories (the batch).
        key: the MLP's initialisation key (default `jax.random.key(0)`).
        width, depth: the MLP's hidden width and number of hidden layers.
        activation: its activation (translated for the Warp engines).

    Examples:
        >>> import gradsolve as gs
        >>> prob = gs.problems.neural_spiral(n=4, width=8)
        >>> prob.d, prob.n, type(prob.params["net"].value).__name__
        (2, 4, 'MLP')
    """
    key = jax.random.key(0) if key is None else key
    net = eqx.nn.MLP(2, 2, width, depth, activation=activation, key=key)
    net = jax.tree.map(lambda x: x.astype(default_float(dtype)) if eqx.is_inexact_array(x) else x, net)
    s = np.linspace(0.0, 1.0, n) if n > 1 else np.array([0.5])
    radius = 0.5 + 0.5 * s  # the cubic field turns faster further out
    y0 = np.stack([radius * np.cos(np.pi * s), radius * np.sin(np.pi * s)], axis=1)
    return EnsembleProblem(f_jax=neural_f, y0=jnp.asarray(y0, dtype),
                           params={"net": Shared(net)}, t_span=t_span, fused=True,
                           name="neural_spiral")


def _rates(y1, y2, y3, p, factor):
    r1, r2, r3 = p["k1"] * y1, p["k2"] * y2 * y2 * factor, p["k3"] * y2 * y3
    return jnp.stack([-r1 + r3, r1 - r2 - r3, r2])


def neural_robertson_f(t, y, p):
    y1, y2, y3 = y
    return _rates(y1, y2, y3, p, jnp.exp(p["mlp"](y)[0]))


def robertson_true_f(t, y, p):
    y1, y2, y3 = y
    return _rates(y1, y2, y3, p, 1 + 2 * y3)


def zero_output_mlp(key, width=16, depth=2, dtype=None):
    """`eqx.nn.MLP(3, 1, width, depth, tanh)` whose last layer is zero: exp(MLP) = 1."""
    mlp = eqx.nn.MLP(3, 1, width, depth, activation=jnp.tanh, key=key)
    mlp = jax.tree.map(lambda x: x.astype(default_float(dtype)) if eqx.is_inexact_array(x) else x, mlp)
    return eqx.tree_at(lambda m: (m.layers[-1].weight, m.layers[-1].bias), mlp,
                       (jnp.zeros_like(mlp.layers[-1].weight), jnp.zeros(1, dtype)))


def neural_robertson(n=4, *, key=None, width=16, depth=2, t_span=(0.0, 100.0),
                     dtype=None):
    """Robertson's reactors (y1(0) spread over [0.7, 1], y3(0) = 1 - y1(0)) with the
    autocatalytic rate `k2 y2^2 exp(MLP(y))`, the MLP in `gs.Shared` (zero output).

    Examples:
        >>> import gradsolve as gs
        >>> prob = gs.problems.neural_robertson(n=2)
        >>> prob.stiff, sorted(prob.params)
        (True, ['k1', 'k2', 'k3', 'mlp'])
    """
    key = jax.random.key(3) if key is None else key
    a = _linspace(1.0, 0.7, n)
    y0 = np.stack([a, np.zeros(n), 1.0 - a], axis=1)
    params = {"k1": jnp.full(n, 0.04, dtype), "k2": jnp.full(n, 3e7, dtype),
              "k3": jnp.full(n, 1e4, dtype),
              "mlp": Shared(zero_output_mlp(key, width, depth, dtype))}
    return EnsembleProblem(f_jax=neural_robertson_f, y0=jnp.asarray(y0, dtype), params=params,
                           t_span=t_span, stiff=True, fused=True, name="neural_robertson")
