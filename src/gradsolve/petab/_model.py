"""A PEtab problem's model and tables as JAX functions: the right-hand side, theta ->
`(params, y0)` of every trajectory (initial assignments, preequilibration steady
states), the observable and noise formulas, and the switches a gradient cannot cross.

SymPy's `lambdify` writes each expression set as one JAX function; the right-hand side
of each model is made once per process (`FIELDS`), so that problems of one model share
its compiled solves.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import sympy as sp

from ._sbml import TIME, symbol
from ._steady import conservation_laws, steady_state
from ._tables import PetabError, Tables

FIELDS = {}  # the generated right-hand side of each model loaded, by its expressions


def lambdify(args, exprs):
    """A JAX function of `args` (symbols, or lists of symbols passed as arrays)
    returning the float array of `exprs`."""
    # Every argument symbol renamed once to a plain identifier: lambdify's own
    # dummify=True substitutes each argument into every common subexpression
    # (Chen_MSB2009, 500 states: 27 of its load's 40 s under cProfile; the load takes
    # 8.6 s this way, 14.8 s that way).
    symbols = [s for a in args for s in ([a] if isinstance(a, sp.Symbol) else a)]
    if len(set(symbols)) < len(symbols):  # a symbol in two arguments: lambdify's renaming
        flat = [a if isinstance(a, sp.Symbol) else list(a) for a in args]
        g = sp.lambdify(flat, list(exprs), modules="jax", cse=True, dummify=True)
    else:
        names = {s: sp.Symbol(f"_gs_arg{i}") for i, s in enumerate(symbols)}
        flat = [names[a] if isinstance(a, sp.Symbol) else [names[s] for s in a] for a in args]
        g = sp.lambdify(flat, [sp.sympify(e).xreplace(names) for e in exprs], modules="jax",
                        cse=True, dummify=False)

    def fn(*values):
        unpacked = [v if isinstance(a, sp.Symbol) else [v[i] for i in range(len(a))]
                    for a, v in zip(args, values)]
        dtype = jnp.result_type(*[jnp.asarray(v).dtype for v in values
                                  if jnp.issubdtype(jnp.asarray(v).dtype, jnp.floating)])
        out = g(*unpacked)
        return jnp.stack([jnp.broadcast_to(jnp.asarray(o, dtype), ()) for o in out]) \
            if out else jnp.zeros((0,), dtype)
    return fn


class Field(eqx.Module):
    """The generated right-hand side `f(t, y, p)`, and its autonomous form `f(x, p)`
    for the steady state."""

    fn: object = eqx.field(static=True)
    name: str = eqx.field(static=True)

    def __call__(self, t, y, p):
        return self.fn(t, y, p)

    def autonomous(self, x, p):
        return self.fn(jnp.zeros((), x.dtype), x, p)


class JaxModel:
    """`tables`' model as JAX functions, with the tolerances of its steady states.

    Attributes:
        rhs: the right-hand side, a `Field`.
        observables: per `tables.observables` entry, `(observable, noise)`: JAX
            functions `(t, x, p, q, g)` and `(t, x, p, q, r, g, s)` of time, state,
            the trajectory's constants, the row's placeholder values, the parameter
            table's entries that are not model constants, and the simulated value.
        switches: the switches whose time moves with theta (`moving_switches`).
    """

    def __init__(self, tables: Tables, rtol: float, atol: float):
        self.tables, self.rtol, self.atol = tables, rtol, atol
        m = tables.model
        x, p = [symbol(s) for s in m.states], [symbol(s) for s in m.constants]
        key = (m.states, m.constants, tuple(sp.srepr(m.rhs[s]) for s in m.states))
        if key not in FIELDS:  # one field per model: its compiled solves are shared
            FIELDS[key] = Field(lambdify([TIME, x, p], [m.rhs[s] for s in m.states]), m.name)
        self.rhs = FIELDS[key]
        self._init = lambdify([p], [m.initial[s] for s in m.states])
        filled = [j for j, c in enumerate(m.constants) if c in m.initial]
        self._fill = [(j, lambdify([p], [m.initial[m.constants[j]]])) for j in filled]
        # Conservation laws of each preequilibration condition, and of each simulation
        # condition with steady-state measurements.
        self._laws = self._conservation_laws(tables.pre_params, tables.pre_computed,
                                             range(len(tables.preeq)))
        self._steady_laws = self._conservation_laws(tables.params, tables.computed,
                                                    tables.steady_of)
        self._weights = [None if size is None else m.constants.index(size)
                         for size in m.sizes]
        g = [symbol(s) for s in tables.outputs]
        self.observables = [
            (lambdify([TIME, x, p, o.placeholders, g], [o.formula]),
             lambdify([TIME, x, p, o.placeholders, o.noise_placeholders, g, symbol(o.id)],
                      [o.noise]))
            for o in tables.observables]
        self.switches = self.moving_switches()

    def _conservation_laws(self, values, computed, rows):
        """`(len(rows), d, d)`: the conservation laws of the conditions `rows` of
        `values`, zero-padded to d rows, with the constants that are numbers there
        substituted (a law may hold only at those values)."""
        m, laws = self.tables.model, []
        for e in rows:
            fixed = self.tables.fixed(values, computed, e)
            rates = [m.rhs[s].xreplace(fixed) for s in m.states]
            weights = [1 if size is None else symbol(size).xreplace(fixed)
                       for size in m.sizes]
            L = conservation_laws(rates, weights)
            laws.append(np.vstack([L, np.zeros((len(m.states) - L.shape[0], len(m.states)))]))
        return np.array(laws).reshape(len(laws), len(m.states), len(m.states))

    # -- switches --------------------------------------------------------------------

    def moving_switches(self):
        """The switches of the right-hand side (piecewise conditions, Heaviside, ...)
        whose time moves with theta, as `(switch, parameters)`: parameters a tuple of
        the estimated parameters that set its time, or None where the switch reads the
        states (then every parameter moves it).

        The replay differentiates on a mesh held fixed and a switch's condition has
        zero derivative, so the derivative of the state with respect to a switch time
        -- a jump `(f_after - f_before) * d t_switch / d theta` at the switch -- is
        missing: the gradient with respect to a parameter that only sets a switch time
        comes out exactly 0 (all 19 `tau_*` of Beer_MolBioSystems2014, where issue 27
        measured -0.099 by central differences for tau_typeIDT1_ExpID1; -0.0707 in
        tests/test_petab.py's one-switch model). A switch at a fixed time
        (`time > 10`, numbers only) or on constants alone (`k > 1`) does not move, and
        its gradient is exact."""
        t = self.tables
        m = t.model
        states = {symbol(x) for x in m.states}
        sets = {}  # constant -> the estimated parameters its value reads, any trajectory
        for j, c in enumerate(m.constants):
            sets[symbol(c)] = {t.parameter_ids[i] for i in np.unique(t.params.index[:, j])
                               if i >= 0}
        for _ in m.constants:  # through initial assignments, which may use each other
            for j, c in enumerate(m.constants):
                if t.computed[:, j].any():
                    for s in m.initial[c].free_symbols:
                        sets[symbol(c)] |= sets.get(s, set())
        found = {}
        for x in m.states:
            for switch in _switches(m.rhs[x]):
                free = switch.free_symbols
                if free & states:
                    found[switch] = None
                elif TIME in free:
                    moved = set().union(*(sets.get(s, set()) for s in free))
                    if moved:
                        found[switch] = tuple(i for i in t.parameter_ids if i in moved)
        return tuple(found.items())

    def refuse_moving_switches(self, what):
        """Raise `PetabError` for `what` (a gradient) where a switch time moves with
        theta (`moving_switches`), naming the switch and its parameters."""
        if not self.switches:
            return
        switch, moved = self.switches[0]
        text = str(switch.xreplace({TIME: sp.Symbol("time")}))
        if moved is None:
            raise PetabError(
                f"{what}: the right-hand side switches at {text}, which reads the "
                "states: the switching time moves with every parameter, and the "
                "replay's gradient has no jump term at a moving switch (not supported; "
                "llh, chi2 and simulate are)")
        ids = self.tables.parameter_ids
        moved = sorted({i for _, found in self.switches if found for i in found},
                       key=ids.index)
        raise PetabError(
            f"{what}: the estimated parameter(s) {moved} set the time of a switch in the "
            f"right-hand side ({text}); the replay's gradient has no jump term at a "
            "moving switch, so theirs would be 0 (not supported; llh, chi2 and simulate "
            "are). Fix them (estimate = 0 in the parameter table) to fit the others")

    # -- theta to the ensemble -------------------------------------------------------

    def vector(self, theta):
        """theta (a dict of the estimated parameters) as one array, in the parameter
        table's order; refused naming missing and unknown entries."""
        ids = self.tables.parameter_ids
        if isinstance(theta, dict):
            missing = [i for i in ids if i not in theta]
            extra = [k for k in theta if k not in ids]
            if missing or extra:
                raise PetabError(f"theta must have the estimated parameters "
                                 f"{list(ids)}; missing {missing}, unknown {extra}")
            values = [jnp.asarray(theta[i]) for i in ids]
        else:
            raise TypeError(f"theta must be a dict of the estimated parameters, got "
                            f"{type(theta).__name__}")
        if not values:
            return jnp.zeros((0,), jnp.result_type(float))
        return jnp.stack([v.astype(jnp.result_type(float)) for v in values])

    def _constants(self, values, v, computed):
        """Constants of each row, those given by initial assignments filled in (as
        many passes as there are: each may use the ones before)."""
        p = values.at(v)
        for _ in self._fill:
            for j, fn in self._fill:
                p = p.at[:, j].set(jnp.where(computed[:, j], jax.vmap(fn)(p)[:, 0], p[:, j]))
        return p

    def to_params(self, theta):
        """theta -> `(K, P)` constants of every trajectory's simulation condition."""
        return self._constants(self.tables.params, self.vector(theta), self.tables.computed)

    def to_y0(self, theta):
        """theta -> `(K, d)` initial states (see `PetabProblem.to_y0`)."""
        t = self.tables
        v = self.vector(theta)
        p = self.to_params(theta)
        x0 = jnp.where(t.reset, t.states.at(v), jax.vmap(self._init)(p))
        if not t.preeq:
            return x0
        pp = self._constants(t.pre_params, v, t.pre_computed)
        xp = jnp.where(t.pre_reset, t.pre_states.at(v), jax.vmap(self._init)(pp))
        steady = jax.vmap(self._steady_state)(xp, pp, jnp.asarray(self._laws, pp.dtype))
        after = jnp.where(t.reset, t.states.at(v), steady[np.maximum(t.pre_of, 0)])
        return jnp.where((t.pre_of >= 0)[:, None], after, x0)

    def _steady_state(self, x, p, L):
        """The steady state reached from `x` (one trajectory, parameters `p`, its
        conservation laws `L`), differentiable (`steady_state`); NaN where none is
        found."""
        w = jnp.stack([jnp.ones((), p.dtype) if j is None else p[j] for j in self._weights])
        xs, ok = steady_state(self.rhs.autonomous, x, p, L * w[None, :], self.rtol,
                              self.atol)
        return jnp.where(ok, xs, jnp.nan)

    def steady_states(self, theta, y0):
        """`(K, d)`: the steady state each trajectory with steady-state measurements
        reaches from its initial state `y0` (after any preequilibration); zeros for
        the others."""
        sel = self.tables.steady_of
        p = self.to_params(theta)
        s = jax.vmap(self._steady_state)(y0[sel], p[sel],
                                         jnp.asarray(self._steady_laws, y0.dtype))
        return jnp.zeros_like(y0).at[sel].set(s)


def _switches(expr):
    """The expressions at whose sign changes `expr` jumps: piecewise conditions and
    the arguments of Heaviside, sign, floor and ceiling."""
    found = []
    for a in sp.preorder_traversal(expr):
        if isinstance(a, sp.Piecewise):
            found += [c for _, c in a.args if c not in (sp.true, True)]
        elif isinstance(a, (sp.Heaviside, sp.sign, sp.floor, sp.ceiling)):
            found.append(a.args[0])
    return found
