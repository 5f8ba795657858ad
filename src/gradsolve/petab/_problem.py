"""A PEtab v1 problem as an ensemble: one trajectory per simulation condition (and per
preequilibration/simulation pair), the measurements, and the PEtab likelihood.

How the tables become arrays, once, when the problem is loaded:

- every model constant (parameter, compartment size, constant species) of every
  condition is either a number or an estimated parameter: `_Values` holds a number
  array and an index array (-1: the number; i >= 0: entry i of theta), so building
  the parameters of all trajectories from theta is one `where`;
- the same for species reinitialised by a condition, and for the observable and noise
  parameters each measurement row gives its observable's placeholders;
- observable and noise formulas become JAX functions of `(t, x, p, q, g)` (time,
  state, the trajectory's constants, the row's placeholder values, the parameter
  table's parameters that are not in the model) by SymPy's `lambdify`.
"""

import copy
import dataclasses
import math
import numbers

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import sympy as sp

from ..calibrate import Calibrator, multistart, transforms as _transforms
from ..problem import EnsembleProblem
from ..record import record
from ..replay import replay
from ..status import Status, summarize
from ._sbml import TIME, Model, UnsupportedSBML, canonical, from_sbml, symbol
from ._steady import conservation_laws, steady_state

SCALES = ("lin", "log", "log10")
# PEtab v1's objective priors: the density of the parameter in linear units
# (uniform, normal, laplace), of its natural log with the Jacobian to linear units
# (logNormal, logLaplace: densities of the parameter), or of its value on its
# parameterScale (parameterScale*: densities of the scaled value, no Jacobian).
PRIORS = ("uniform", "normal", "laplace", "logNormal", "logLaplace",
          "parameterScaleUniform", "parameterScaleNormal", "parameterScaleLaplace")
TRANSFORMATIONS = ("lin", "log", "log10")
DISTRIBUTIONS = ("normal", "laplace")
MIN_COLUMNS = 64  # the narrowest mesh `PetabProblem.record` returns


class PetabError(ValueError):
    """A PEtab problem this importer cannot take, with the table and entry at fault."""


@dataclasses.dataclass(frozen=True)
class _Values:
    """Numbers and theta indices of one shape: `at(v)` is `number` where `index < 0`,
    else `v[index]`."""

    number: np.ndarray
    index: np.ndarray

    def at(self, v):
        if self.number.size == 0:
            return jnp.zeros(self.number.shape, v.dtype)
        taken = v[np.maximum(self.index, 0)] if v.shape[0] else jnp.zeros(
            self.index.shape, v.dtype)
        return jnp.where(self.index >= 0, taken, jnp.asarray(self.number, v.dtype))


def _lambdify(args, exprs):
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


class PetabProblem:
    """A PEtab problem ready to simulate, evaluate and calibrate; see `gs.petab.load`.

    Attributes:
        problem: the `gs.EnsembleProblem`: one trajectory per simulation (or
            preequilibration and simulation) condition of the measurement table, at
            the nominal parameters.
        conditions: per trajectory, `(preequilibration condition or None, simulation
            condition)`.
        parameter_ids: the estimated parameters, in the parameter table's order.
        nominal: the estimated parameters at their nominal values (a dict of floats,
            in linear units).
        lower, upper: their bounds (linear units); scales: their `parameterScale`.
        transforms: per estimated parameter, the `gs.transforms` of its scale and bounds.
        ts: the measurement times (sorted, unique): the output times of every
            trajectory.
        measurements: the measurement table (a pandas DataFrame).
        model: the SBML model's ODE (`gs.petab.Model`).
        rtol, atol: the tolerances every simulation, record and fit uses.
        max_steps: the cap on attempted steps per trajectory of every record and fit.
        priors: per estimated parameter with an objective prior in the parameter
            table, `(objectivePriorType, first, second parameter)`: `loss` (the
            Calibrator's objective) is then the negative log-posterior, `llh` and
            `llh_and_grad` stay the likelihood (docs/petab.md, "Priors").
    """

    def __init__(self, petab_problem, model: Model, *, rtol, atol, max_steps, stiff, fused,
                 name):
        self.petab_problem = petab_problem
        self.model = model
        self.rtol, self.atol, self.fused = float(rtol), float(atol), fused
        self.max_steps = int(max_steps)
        self.measurements = petab_problem.measurement_df.reset_index(drop=True)
        self._parameters(petab_problem.parameter_df)
        self._trajectories()
        self._observables(petab_problem.observable_df)
        self._functions()
        self._switches = self._moving_switches()
        theta = self.nominal
        y0 = np.asarray(self.to_y0(theta))
        failed = [self.conditions[k][0] for k in range(len(y0)) if not np.isfinite(y0[k]).all()]
        if failed:
            raise PetabError(f"no steady state found for preequilibration condition(s) "
                             f"{sorted(set(failed))} at the nominal parameters")
        t_end = float(self.ts[-1]) if self.ts[-1] > 0 else 1.0
        self.problem = EnsembleProblem(f_jax=self._rhs, y0=y0, params=self.to_params(theta),
                                       t_span=(0.0, t_end), stiff=stiff, name=name)

    # -- building -------------------------------------------------------------------

    def _parameters(self, df):
        for column in ("parameterScale", "lowerBound", "upperBound", "nominalValue",
                       "estimate"):
            if column not in df.columns:
                raise PetabError(f"the parameter table has no {column!r} column")
        self._table, priors = {}, {}
        ids, scales, lower, upper, nominal = [], [], [], [], []
        for pid, row in df.iterrows():
            value = float(row["nominalValue"])
            self._table[pid] = value
            if int(row["estimate"]) != 1:
                continue
            scale = str(row["parameterScale"])
            if scale not in SCALES:
                raise PetabError(f"parameter {pid!r}: parameterScale must be one of "
                                 f"{SCALES}, got {scale!r}")
            lo, hi = float(row["lowerBound"]), float(row["upperBound"])
            if not (np.isfinite(lo) and np.isfinite(hi) and lo < hi):
                raise PetabError(f"parameter {pid!r}: needs finite bounds lowerBound < "
                                 f"upperBound, got {lo}, {hi}")
            if scale != "lin" and lo <= 0:
                raise PetabError(f"parameter {pid!r}: a {scale} scale needs lowerBound > 0, "
                                 f"got {lo}")
            prior = _prior(pid, row)
            if prior is not None:
                priors[str(pid)] = prior
            ids.append(str(pid))
            scales.append(scale)
            lower.append(lo)
            upper.append(hi)
            nominal.append(value)
        self.parameter_ids = tuple(ids)
        self.scales = dict(zip(ids, scales))
        self.lower, self.upper = dict(zip(ids, lower)), dict(zip(ids, upper))
        self.nominal = dict(zip(ids, nominal))
        self.priors = priors
        kind = {"lin": _transforms.Bounded, "log": _transforms.Log,
                "log10": _transforms.Log10}
        self.transforms = {i: kind[s](lo, hi) for i, s, lo, hi in
                           zip(ids, scales, lower, upper)}

    def _source(self, value, where):
        """`(number, index)` of a table entry: a number, or a parameter table id."""
        if isinstance(value, numbers.Number) and not isinstance(value, bool):
            return float(value), -1
        text = str(value).strip()
        try:
            return float(text), -1
        except ValueError:
            pass
        if text in self.parameter_ids:
            return math.nan, self.parameter_ids.index(text)
        if text in self._table:
            return self._table[text], -1
        raise PetabError(f"{where} refers to {text!r}, which is not in the parameter table")

    def _trajectories(self):
        m = self.model
        df = self.measurements
        for column in ("observableId", "simulationConditionId", "time", "measurement"):
            if column not in df.columns:
                raise PetabError(f"the measurement table has no {column!r} column")
        times = df["time"].astype(float).to_numpy()
        if np.isnan(times).any() or (times < 0).any():
            raise PetabError(f"measurement times must be >= 0 or inf; rows "
                             f"{np.flatnonzero(~(times >= 0))[:10].tolist()}")
        # Steady-state measurements (time = inf) are read at the steady state the
        # simulation reaches from its initial state (`_steady_states`).
        self._row_inf = np.isinf(times)
        finite = times[~self._row_inf]
        self.ts = np.unique(finite) if finite.size else np.zeros(1)  # (no row reads it)
        pre = df["preequilibrationConditionId"] if "preequilibrationConditionId" in df \
            else [None] * len(df)
        pairs = [(None if _empty(a) else str(a), str(b))
                 for a, b in zip(pre, df["simulationConditionId"])]
        self.conditions = tuple(dict.fromkeys(pairs))
        self._row_trajectory = np.array([self.conditions.index(p) for p in pairs])
        self._row_time = np.where(self._row_inf, 0, np.searchsorted(self.ts, times))
        conditions = self.petab_problem.condition_df
        columns = [c for c in conditions.columns if c != "conditionName"]
        for c in columns:
            if c in m.derived:
                raise PetabError(f"condition table column {c!r} sets an assignment-rule "
                                 "target")
            if c not in m.constants and c not in m.states:
                raise PetabError(f"condition table column {c!r} is neither a model "
                                 "parameter, a compartment nor a species")
        self._preeq = tuple(dict.fromkeys(a for a, _ in self.conditions if a is not None))

        def condition(cid):
            if cid not in conditions.index:
                raise PetabError(f"condition {cid!r} is not in the condition table")
            row = conditions.loc[cid]
            num = np.zeros(len(m.constants))
            idx = np.full(len(m.constants), -1)
            computed = np.zeros(len(m.constants), bool)
            for j, c in enumerate(m.constants):
                value = row[c] if c in columns else math.nan
                if not _empty(value):
                    num[j], idx[j] = self._source(value, f"condition {cid!r}, column {c!r}")
                elif c in self._table:
                    num[j], idx[j] = self._source(c, f"parameter {c!r}")
                elif np.isfinite(m.defaults[j]):
                    num[j] = m.defaults[j]
                else:
                    computed[j] = True  # given by its initial assignment
            snum = np.zeros(len(m.states))
            sidx = np.full(len(m.states), -1)
            sset = np.zeros(len(m.states), bool)
            for i, x in enumerate(m.states):
                value = row[x] if x in columns else math.nan
                if not _empty(value):
                    snum[i], sidx[i] = self._source(value, f"condition {cid!r}, column {x!r}")
                    sset[i] = True
            return num, idx, computed, snum, sidx, sset

        def stack(cids):
            parts = [condition(c) for c in cids]
            widths = [len(m.constants)] * 3 + [len(m.states)] * 3
            return [np.array([part[i] for part in parts]).reshape(len(cids), w)
                    for i, w in enumerate(widths)]

        num, idx, self._computed, snum, sidx, self._reset = stack(
            [s for _, s in self.conditions])
        self._params = _Values(num, idx.astype(int))
        self._states = _Values(snum, sidx.astype(int))
        num, idx, self._pre_computed, snum, sidx, self._pre_reset = stack(self._preeq)
        self._pre_params = _Values(num, idx.astype(int))
        self._pre_states = _Values(snum, sidx.astype(int))
        self._pre_of = np.array([self._preeq.index(a) if a is not None else -1
                                 for a, _ in self.conditions])
        # A steady state is of a right-hand side that does not read time: the model's,
        # or the one a condition's values make (a dose of 0 switches off a timed
        # stimulus: Brannmark_JBC2010's preequilibration).
        self._refuse_time(self._pre_params, self._pre_computed, range(len(self._preeq)),
                          self._preeq, "preequilibration condition")
        steady = np.unique(self._row_trajectory[self._row_inf])
        self._refuse_time(self._params, self._computed, steady,
                          [s for _, s in self.conditions],
                          "steady-state measurements (time = inf) of condition")

    def _fixed(self, values, computed, e):
        """The model constants that are numbers in condition `e` of `values`, as SymPy
        substitutions."""
        m = self.model
        return {symbol(c): sp.Float(v) for c, v, i, comp in zip(
            m.constants, values.number[e], values.index[e], computed[e])
            if i < 0 and not comp}

    def _refuse_time(self, values, computed, rows, names, what):
        """Raise `PetabError` where, with condition e's numbers in place, a rate still
        reads time at some t >= 0 (its steady state is then not defined; a switch
        such as `time < 0` is decided there, and the steady state is that of the
        right-hand side at t = 0)."""
        m = self.model
        if not m.time_dependent:
            return
        later = sp.Symbol("t_after_start", nonnegative=True)  # decides `time < 0` etc.
        for e in rows:
            fixed = {**self._fixed(values, computed, e), TIME: later}
            reads = [s for s in m.states if later in m.rhs[s].xreplace(fixed).free_symbols]
            if reads:
                raise PetabError(f"{what} {names[e]!r}: with that condition's values the "
                                 f"right-hand side still reads time at t >= 0 (the rates "
                                 f"of {reads[:5]}), so it has no steady state")

    def _observables(self, df):
        from petab.v1.math import sympify_petab  # the petab extra
        from petab.v1.measurements import split_parameter_replacement_list  # (petab extra)

        m = self.model
        rows = self.measurements
        self.observable_ids = tuple(str(o) for o in df.index)
        missing = sorted(set(rows["observableId"]) - set(self.observable_ids))
        if missing:
            raise PetabError(f"the measurement table uses observables {missing} that the "
                             "observable table lacks")
        self._outputs = tuple(p for p in self._table if p not in m.constants)
        num, idx = zip(*[self._source(p, f"parameter {p!r}") for p in self._outputs]) \
            if self._outputs else ((), ())
        self._g = _Values(np.asarray(num, float), np.asarray(idx, int))
        model_symbols = {symbol(s) for s in m.states + m.constants} | {TIME}
        self._obs = []
        for oid, row in df.iterrows():
            oid = str(oid)
            trafo = _text(row.get("observableTransformation"), "lin")
            dist = _text(row.get("noiseDistribution"), "normal")
            if trafo not in TRANSFORMATIONS:
                raise PetabError(f"observable {oid!r}: observableTransformation must be "
                                 f"one of {TRANSFORMATIONS}, got {trafo!r}")
            if dist not in DISTRIBUTIONS:
                raise PetabError(f"observable {oid!r}: noiseDistribution must be one of "
                                 f"{DISTRIBUTIONS}, got {dist!r}")
            formula = m.expand(canonical(sympify_petab(row["observableFormula"])))
            noise = m.expand(canonical(sympify_petab(row["noiseFormula"])))
            oq = _placeholders(formula, "observableParameter", oid)
            nq = _placeholders(noise, "noiseParameter", oid)
            allowed = model_symbols | set(oq) | set(nq) | {symbol(p) for p in self._outputs}
            for what, expr, extra in (("observableFormula", formula, set()),
                                      ("noiseFormula", noise, {symbol(oid)})):
                unknown = sorted(str(s) for s in expr.free_symbols - allowed - extra)
                if unknown:
                    raise PetabError(f"observable {oid!r}: the {what} uses {unknown}, "
                                     "which are neither model entities, placeholders nor "
                                     "parameter table entries")
            at = np.flatnonzero(rows["observableId"].to_numpy() == oid)
            q = []
            for column, names in (("observableParameters", oq), ("noiseParameters", nq)):
                num = np.zeros((len(at), len(names)))
                idx = np.full((len(at), len(names)), -1)
                for r, i in enumerate(at):
                    values = split_parameter_replacement_list(rows[column].iloc[i]) \
                        if column in rows else []
                    if len(values) != len(names):
                        raise PetabError(
                            f"measurement row {i} ({oid!r}): {column} gives {len(values)} "
                            f"values, the formula has {len(names)} placeholders")
                    for j, v in enumerate(values):
                        num[r, j], idx[r, j] = self._source(
                            v, f"measurement row {i}, {column}")
                q.append(_Values(num, idx))
            x, p = [symbol(s) for s in m.states], [symbol(s) for s in m.constants]
            g = [symbol(s) for s in self._outputs]
            obs = _lambdify([TIME, x, p, oq, g], [formula])
            sigma = _lambdify([TIME, x, p, oq, nq, g, symbol(oid)], [noise])
            self._obs.append((oid, at, trafo, dist, obs, sigma, q[0], q[1]))

    def _functions(self):
        m = self.model
        x, p = [symbol(s) for s in m.states], [symbol(s) for s in m.constants]
        key = (m.states, m.constants, tuple(sp.srepr(m.rhs[s]) for s in m.states))
        if key not in _FIELDS:  # one field per model: its compiled solves are shared
            _FIELDS[key] = _Field(_lambdify([TIME, x, p], [m.rhs[s] for s in m.states]),
                                  m.name)
        self._rhs = _FIELDS[key]
        self._init = _lambdify([p], [m.initial[s] for s in m.states])
        filled = [j for j, c in enumerate(m.constants) if c in m.initial]
        self._fill = [(j, _lambdify([p], [m.initial[m.constants[j]]])) for j in filled]
        # Conservation laws of each preequilibration condition, and of each simulation
        # condition with steady-state measurements.
        self._laws = self._conservation_laws(self._pre_params, self._pre_computed,
                                             range(len(self._preeq)))
        self._steady_of = np.unique(self._row_trajectory[self._row_inf])
        self._steady_laws = self._conservation_laws(self._params, self._computed,
                                                    self._steady_of)
        self._weights = [None if size is None else m.constants.index(size)
                         for size in m.sizes]

    def _conservation_laws(self, values, computed, rows):
        """`(len(rows), d, d)`: the conservation laws of the conditions `rows` of
        `values`, zero-padded to d rows, with the constants that are numbers there
        substituted (a law may hold only at those values)."""
        m, laws = self.model, []
        for e in rows:
            fixed = self._fixed(values, computed, e)
            rates = [m.rhs[s].xreplace(fixed) for s in m.states]
            weights = [1 if size is None else symbol(size).xreplace(fixed)
                       for size in m.sizes]
            L = conservation_laws(rates, weights)
            laws.append(np.vstack([L, np.zeros((len(m.states) - L.shape[0], len(m.states)))]))
        return np.array(laws).reshape(len(laws), len(m.states), len(m.states))

    def _moving_switches(self):
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
        m = self.model
        states = {symbol(x) for x in m.states}
        sets = {}  # constant -> the estimated parameters its value reads, any trajectory
        for j, c in enumerate(m.constants):
            sets[symbol(c)] = {self.parameter_ids[i] for i in
                               np.unique(self._params.index[:, j]) if i >= 0}
        for _ in m.constants:  # through initial assignments, which may use each other
            for j, c in enumerate(m.constants):
                if self._computed[:, j].any():
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
                        found[switch] = tuple(i for i in self.parameter_ids if i in moved)
        return tuple(found.items())

    def _refuse_moving_switches(self, what):
        """Raise `PetabError` for `what` (a gradient) where a switch time moves with
        theta (`_moving_switches`), naming the switch and its parameters."""
        if not self._switches:
            return
        switch, moved = self._switches[0]
        text = str(switch.xreplace({TIME: sp.Symbol("time")}))
        if moved is None:
            raise PetabError(
                f"{what}: the right-hand side switches at {text}, which reads the "
                "states: the switching time moves with every parameter, and the "
                "replay's gradient has no jump term at a moving switch (not supported; "
                "llh, chi2 and simulate are)")
        moved = sorted({i for _, ids in self._switches if ids for i in ids},
                       key=self.parameter_ids.index)
        raise PetabError(
            f"{what}: the estimated parameter(s) {moved} set the time of a switch in the "
            f"right-hand side ({text}); the replay's gradient has no jump term at a "
            "moving switch, so theirs would be 0 (not supported; llh, chi2 and simulate "
            "are). Fix them (estimate = 0 in the parameter table) to fit the others")

    # -- theta to the ensemble -------------------------------------------------------

    def _vector(self, theta):
        if isinstance(theta, dict):
            missing = [i for i in self.parameter_ids if i not in theta]
            extra = [k for k in theta if k not in self.parameter_ids]
            if missing or extra:
                raise PetabError(f"theta must have the estimated parameters "
                                 f"{list(self.parameter_ids)}; missing {missing}, "
                                 f"unknown {extra}")
            values = [jnp.asarray(theta[i]) for i in self.parameter_ids]
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
        """theta (a dict of the estimated parameters) -> `(K, P)` constants of every
        trajectory's simulation condition."""
        return self._constants(self._params, self._vector(theta), self._computed)

    def to_y0(self, theta):
        """theta -> `(K, d)` initial states: the simulation condition's (its table
        entries, else the model's initial values), or, after a preequilibration, its
        steady state with the species the simulation condition sets reinitialised.
        A preequilibration without a steady state gives NaN states."""
        v = self._vector(theta)
        p = self.to_params(theta)
        x0 = jnp.where(self._reset, self._states.at(v), jax.vmap(self._init)(p))
        if not self._preeq:
            return x0
        pp = self._constants(self._pre_params, v, self._pre_computed)
        xp = jnp.where(self._pre_reset, self._pre_states.at(v), jax.vmap(self._init)(pp))
        steady = jax.vmap(self._steady_state)(xp, pp, jnp.asarray(self._laws, pp.dtype))
        after = jnp.where(self._reset, self._states.at(v), steady[np.maximum(self._pre_of, 0)])
        return jnp.where((self._pre_of >= 0)[:, None], after, x0)

    def _steady_state(self, x, p, L):
        """The steady state reached from `x` (one trajectory, parameters `p`, its
        conservation laws `L`), differentiable (`steady_state`); NaN where none is
        found."""
        w = jnp.stack([jnp.ones((), p.dtype) if j is None else p[j] for j in self._weights])
        xs, ok = steady_state(self._rhs.autonomous, x, p, L * w[None, :], self.rtol,
                              self.atol)
        return jnp.where(ok, xs, jnp.nan)

    def _steady_states(self, theta, y0):
        """`(K, d)`: the steady state each trajectory with steady-state measurements
        reaches from its initial state `y0` (after any preequilibration); zeros for
        the others."""
        sel = self._steady_of
        p = self.to_params(theta)
        s = jax.vmap(self._steady_state)(y0[sel], p[sel],
                                         jnp.asarray(self._steady_laws, y0.dtype))
        return jnp.zeros_like(y0).at[sel].set(s)

    # -- the likelihood --------------------------------------------------------------

    def _rows(self, ys, theta):
        """Simulated values, noise and transformation per measurement row, `(M,)`."""
        v = self._vector(theta)
        p = self.to_params(theta)
        g = self._g.at(v)
        M = len(self.measurements)
        sim = jnp.zeros(M, ys.dtype)
        sigma = jnp.ones(M, ys.dtype)
        steady = self._steady_states(theta, self.to_y0(theta)) if self._steady_of.size \
            else None
        for oid, at, trafo, dist, obs, noise, oq, nq in self._obs:
            if not at.size:
                continue
            k, tau, inf = self._row_trajectory[at], self._row_time[at], self._row_inf[at]
            t = jnp.where(inf, jnp.inf, jnp.asarray(self.ts[tau], ys.dtype))
            x, pk, q, r = ys[k, tau], p[k], oq.at(v), nq.at(v)
            if inf.any():
                x = jnp.where(inf[:, None], steady[k], x)
            s = jax.vmap(lambda t, x, p, q: obs(t, x, p, q, g)[0])(t, x, pk, q)
            n = jax.vmap(lambda t, x, p, q, r, s: noise(t, x, p, q, r, g, s)[0])(
                t, x, pk, q, r, s)
            sim, sigma = sim.at[at].set(s), sigma.at[at].set(n)
        return sim, sigma

    def _terms(self, ys, theta, y):
        """Per-row negative log-likelihood and squared normalised residual."""
        sim, sigma = self._rows(ys, theta)
        nllh = jnp.zeros_like(sim)
        chi2 = jnp.zeros_like(sim)
        for oid, at, trafo, dist, *_ in self._obs:
            s, m, sd = sim[at], y[at], sigma[at]
            if trafo == "lin":
                r, jac = s - m, 0.0
            elif trafo == "log":
                r, jac = jnp.log(s) - jnp.log(m), jnp.log(m)
            else:
                r, jac = jnp.log10(s) - jnp.log10(m), jnp.log(m * np.log(10.0))
            z = r / sd
            if dist == "normal":
                term = 0.5 * jnp.log(2 * np.pi * sd ** 2) + jac + 0.5 * z ** 2
            else:
                term = jnp.log(2 * sd) + jac + jnp.abs(z)
            nllh, chi2 = nllh.at[at].set(term), chi2.at[at].set(z ** 2)
        return nllh, chi2

    def loss(self, ys, theta, data):
        """The Calibrator's objective for one fit (`ys` `(K, len(ts), d)`, theta its
        parameters): the negative log-likelihood of `data["measurement"]`, minus the
        log-prior where the parameter table has objective priors (the negative
        log-posterior)."""
        return self._neg_llh(ys, theta, data) - self._log_prior(theta)

    def _neg_llh(self, ys, theta, data):
        return jnp.sum(self._terms(ys, theta, data["measurement"])[0])

    def _log_prior(self, theta):
        """The sum of the objective priors' log-densities at theta (0 without
        priors), traceable; see `PRIORS`."""
        total = jnp.zeros((), jnp.result_type(float))
        for pid, (kind, a, b) in self.priors.items():
            x = jnp.asarray(theta[pid], total.dtype)
            if kind.startswith("parameterScale"):
                z, jac = {"lin": x, "log": jnp.log(x), "log10": jnp.log10(x)}[
                    self.scales[pid]], 0.0
            elif kind.startswith("log"):
                z, jac = jnp.log(x), jnp.log(x)
            else:
                z, jac = x, 0.0
            if kind.endswith(("uniform", "Uniform")):
                density = jnp.where((z >= a) & (z <= b), -np.log(b - a), -jnp.inf)
            elif kind.endswith(("normal", "Normal")):
                density = -0.5 * ((z - a) / b) ** 2 - np.log(b) - 0.5 * np.log(2 * np.pi)
            else:  # laplace
                density = -jnp.abs(z - a) / b - np.log(2 * b)
            total = total + density - jac
        return total

    def log_prior(self, theta=None) -> float:
        """The log-prior at theta (default: nominal): the sum over the parameter
        table's objective priors (0.0 where it has none); see `priors`."""
        return float(self._log_prior(self._theta(theta)))

    @property
    def data(self) -> dict:
        """The measurements as the loss takes them: `{"measurement": (M,)}`."""
        return {"measurement": jnp.asarray(self.measurements["measurement"].to_numpy(float))}

    def _theta(self, theta):
        theta = self.nominal if theta is None else theta
        self._vector(theta)
        return {k: jnp.asarray(theta[k], jnp.result_type(float)) for k in self.parameter_ids}

    def _start(self, theta):
        """`(params, y0)` at theta, refused naming the preequilibration conditions
        without a steady state."""
        params, y0 = self._initial(theta)
        bad = ~np.isfinite(np.asarray(y0)).all(axis=1)
        if bad.any():
            raise PetabError(f"no steady state found for preequilibration condition(s) "
                             f"{sorted({self.conditions[k][0] for k in np.flatnonzero(bad)})}")
        return params, y0

    def _solve(self, theta, mesh=None, ct=None):
        """`(ys, (g_params, g_y0), params, y0)`: the states at `ts` replayed on `mesh`
        (default: recorded at theta), and the replay's cotangents for `ct` (zero by
        default)."""
        params, y0 = self._start(theta)
        mesh = self.record(theta) if mesh is None else mesh
        if ct is None:
            ct = jnp.zeros((self.problem.n, len(self.ts), self.problem.d), y0.dtype)
        ys, grads = _replay_vjp(self.problem, mesh, params, y0, self.ts, ct)
        return ys, grads, params, y0

    def simulate(self, theta=None):
        """The PEtab simulation table at theta (default: nominal): the measurement
        table with `simulation` in place of `measurement` (example: `gs.petab.load`).
        """
        theta = self._theta(theta)
        sim = self._simulated(self._solve(theta)[0], theta)
        table = self.measurements.rename(columns={"measurement": "simulation"})
        table["simulation"] = np.asarray(sim)
        return table

    def llh(self, theta=None) -> float:
        """The PEtab log-likelihood at theta (default: nominal)."""
        theta = self._theta(theta)
        return -float(self._nllh(self._solve(theta)[0], theta))

    def chi2(self, theta=None) -> float:
        """PEtab's chi^2 at theta: the sum of squared residuals over noise, on the
        observables' transformed scales."""
        theta = self._theta(theta)
        return float(self._chi2(self._solve(theta)[0], theta))

    def record(self, theta=None):
        """The mesh of every trajectory recorded at theta (default: nominal), padded to
        one of `gs.Mesh.widened`'s widths; `.engine` then names the recorder."""
        params, y0 = self._start(self._theta(theta))
        recorder = {None: None, True: "fused", False: "general"}[self.fused]
        mesh = record(self.problem.replace(params=params, y0=y0), rtol=self.rtol,
                      atol=self.atol, max_steps=self.max_steps, recorder=recorder)
        if not mesh.ok:
            capped = bool(np.any(np.asarray(mesh.status) == Status.MAX_STEPS))
            raise PetabError("a trajectory failed to record at theta: "
                             + summarize(mesh.status)
                             + (f" (max_steps={self.max_steps}; gs.petab.load(..., "
                                "max_steps=) raises the cap)" if capped else ""))
        self.engine = f"{mesh.recorder} record, JAX replay"
        # On `Mesh.widened`'s few widths, at least MIN_COLUMNS, so that nearby thetas
        # (and small problems of one model) replay with one compiled function; the
        # padding of a small mesh costs microseconds, a compile seconds.
        return mesh.widened(MIN_COLUMNS)

    def llh_and_grad(self, theta=None, mesh=None):
        """The log-likelihood and its exact gradient with respect to the estimated
        parameters (a dict, linear units), on `mesh` (default: recorded at theta): the
        replay differentiated in reverse mode, through the preequilibration's steady
        state by the implicit function theorem. Raises `PetabError` where an estimated
        parameter (or a state) moves a switch of the right-hand side (docs/petab.md,
        "Switches and gradients")."""
        self._refuse_moving_switches("llh_and_grad")
        theta = self._theta(theta)
        mesh = self.record(theta) if mesh is None else mesh
        ys = self._solve(theta, mesh)[0]
        value, (ct, direct) = self._loss_grads(ys, theta)
        _, (g_params, g_y0), _, _ = self._solve(theta, mesh, ct)
        through = self._initial_vjp(theta, g_params, g_y0)
        return -float(value), {k: -float(direct[k] + through[k]) for k in self.parameter_ids}

    def mesh_llh(self, mesh, theta) -> float:
        """The log-likelihood at theta on a fixed `mesh` (what `llh_and_grad`
        differentiates): finite differences of it check the gradient on one mesh."""
        theta = self._theta(theta)
        return -float(self._nllh(self._solve(theta, mesh)[0], theta))

    # Compiled per problem; small (no integration inside).
    @eqx.filter_jit
    def _initial(self, theta):
        return self.to_params(theta), self.to_y0(theta)

    @eqx.filter_jit
    def _initial_vjp(self, theta, g_params, g_y0):
        return jax.vjp(lambda th: (self.to_params(th), self.to_y0(th)), theta)[1](
            (g_params, g_y0))[0]

    @eqx.filter_jit
    def _nllh(self, ys, theta):
        return self._neg_llh(ys, theta, self.data)

    @eqx.filter_jit
    def _chi2(self, ys, theta):
        return jnp.sum(self._terms(ys, theta, self.data["measurement"])[1])

    @eqx.filter_jit
    def _simulated(self, ys, theta):
        return self._rows(ys, theta)[0]

    @eqx.filter_jit
    def _loss_grads(self, ys, theta):
        value, (ct, direct) = jax.value_and_grad(
            lambda ys, th: self._neg_llh(ys, th, self.data), argnums=(0, 1))(ys, theta)
        return value, (ct, direct)

    def with_measurements(self, values) -> "PetabProblem":
        """A copy whose measurement table holds `values` (one per row, in the table's
        order: an array, or a table with a `measurement` or `simulation` column such
        as `simulate()`'s) -- data simulated at known parameters, say."""
        if hasattr(values, "columns"):
            column = "measurement" if "measurement" in values.columns else "simulation"
            values = values[column]
        values = np.asarray(values, float)
        if values.shape != (len(self.measurements),):
            raise PetabError(f"measurements must have one value per measurement row "
                             f"({len(self.measurements)}), got shape {values.shape}")
        other = copy.copy(self)
        other.measurements = self.measurements.copy()
        other.measurements["measurement"] = values
        return other

    # -- calibration -----------------------------------------------------------------

    def starts(self, n_starts, key, method="sobol"):
        """`n_starts` starting points inside the parameter table's bounds (uniform on
        each parameter's scale), as a Calibrator's theta0."""
        scale = {k: ("lin" if s == "lin" else "log") for k, s in self.scales.items()}
        return multistart(dict(self.lower), dict(self.upper), n_starts, key, scale=scale,
                          method=method)

    def calibrator(self, starts, optimizer=None, **settings):
        """A `gs.Calibrator` fitting `starts` copies of the problem at once (the
        negative log-likelihood, each parameter on its PEtab scale within its bounds);
        `settings` go to `gs.Calibrator` (rtol, atol and ts are the problem's). Use:
        `cal.fit(prob.starts(starts, key), steps)`, then `prob.summary(result)`
        (docs/petab.md; tested in tests/test_petab.py).
        """
        if not isinstance(starts, int) or starts < 1:
            raise ValueError(f"starts must be a positive integer, got {starts!r}")
        self._refuse_moving_switches("calibrator")
        for fixed in ("rtol", "atol", "max_steps", "ts", "to_params", "to_y0", "data",
                      "transform"):
            if fixed in settings:
                raise ValueError(f"{fixed} is the PEtab problem's own; set rtol/atol/"
                                 "max_steps in gs.petab.load")
        prob = self.problem.replace(
            y0=jnp.tile(self.problem.y0, (starts, 1)),
            params=jnp.tile(self.problem.params, (starts, 1)))
        data = jax.tree.map(lambda x: jnp.broadcast_to(x, (starts,) + x.shape), self.data)
        return Calibrator(
            prob, self.loss, to_params=self.to_params, data=data, optimizer=optimizer,
            to_y0=self.to_y0, transform=dict(self.transforms), rtol=self.rtol,
            atol=self.atol, max_steps=self.max_steps, ts=self.ts, **settings)

    def summary(self, res) -> str:
        """The PEtab summary of a multistart result: the best start's log-likelihood
        and chi^2 (recomputed by a fresh simulation) beside the nominal parameters',
        and its parameters against the nominal values."""
        best = res.best()
        theta = {k: float(best.theta[k]) for k in self.parameter_ids}
        llh, chi2 = self.llh(theta), self.chi2(theta)
        ok = int(np.sum(np.asarray(res.loss) <= best.loss + 1e-3))
        lines = [f"{len(res.loss)} starts, engine {res.engine}; best start {best.index}: "
                 f"llh {llh:.6f}, chi2 {chi2:.6f}; {ok} starts within 1e-3 of it",
                 f"nominal parameters: llh {self.llh():.6f}, chi2 {self.chi2():.6f}",
                 *([f"objective priors on {len(self.priors)} parameters: log-prior "
                    f"{self.log_prior(theta):.6f} at the best start, "
                    f"{self.log_prior():.6f} at the nominal values (the loss is "
                    f"-llh - log-prior)"] if self.priors else []),
                 f"{'parameter':>14} {'scale':>6} {'lower':>9} {'upper':>9} "
                 f"{'nominal':>11} {'best':>11}"]
        for k in self.parameter_ids:
            lines.append(f"{k:>14} {self.scales[k]:>6} {self.lower[k]:>9.3g} "
                         f"{self.upper[k]:>9.3g} {self.nominal[k]:>11.6g} {theta[k]:>11.6g}")
        return "\n".join(lines)


_FIELDS = {}  # the generated right-hand side of each model loaded, by its expressions


def _replay_vjp(prob, mesh, params, y0, ts, ct):
    """The replay's states at `ts` and its cotangents for `params` and `y0` given the
    states' cotangent `ct`. One function for values and gradients, compiled per field,
    method, span, times and shapes -- not per problem (its name and loss are left
    out) -- so problems of one model share it; a value alone pays a backward pass,
    which for the ensembles of PEtab problems costs less than a second compile."""
    return _replay_vjp_of(prob.f_jax, prob.t_span, prob.stiff, mesh, params, y0,
                          tuple(float(t) for t in ts), ct)


@eqx.filter_jit
def _replay_vjp_of(f_jax, t_span, stiff, mesh, params, y0, ts, ct):
    prob = EnsembleProblem(f_jax=f_jax, y0=y0, params=params, t_span=t_span, stiff=stiff)
    ys, pull = jax.vjp(lambda p, y: replay(prob, mesh, params=p, y0=y, ts=np.array(ts)),
                       params, y0)
    return ys, pull(ct)


class _Field(eqx.Module):
    """The generated right-hand side `f(t, y, p)`, and its autonomous form `f(x, p)`
    for the steady state."""

    fn: object = eqx.field(static=True)
    name: str = eqx.field(static=True)

    def __call__(self, t, y, p):
        return self.fn(t, y, p)

    def autonomous(self, x, p):
        return self.fn(jnp.zeros((), x.dtype), x, p)


def _prior(pid, row):
    """`(type, first, second)` of a parameter's objective prior, or None without one
    (PEtab's default, parameterScaleUniform over the bounds, is flat there)."""
    kind = row.get("objectivePriorType")
    if _empty(kind):
        return None
    kind = str(kind).strip()
    if kind not in PRIORS:
        raise PetabError(f"parameter {pid!r}: objectivePriorType must be one of {PRIORS}, "
                         f"got {kind!r}")
    text = row.get("objectivePriorParameters")
    try:
        a, b = (float(v) for v in str(text).split(";"))
    except ValueError:
        raise PetabError(f"parameter {pid!r}: objectivePriorParameters of a {kind} prior "
                         f"must be two numbers separated by ';', got {text!r}") from None
    if not (np.isfinite(a) and np.isfinite(b)) or (
            b <= a if kind.endswith(("uniform", "Uniform")) else b <= 0):
        what = ("lower < upper" if kind.endswith(("uniform", "Uniform"))
                else "a location and a scale > 0")
        raise PetabError(f"parameter {pid!r}: objectivePriorParameters of a {kind} prior "
                         f"must be {what}, got {text!r}")
    return kind, a, b


def _empty(value) -> bool:
    if value is None:
        return True
    if isinstance(value, float) and math.isnan(value):
        return True
    return isinstance(value, str) and value.strip() in ("", "nan", "NaN")


def _text(value, default):
    return default if _empty(value) else str(value).strip()


def _placeholders(expr, kind, oid):
    """The `kind{i}_{oid}` symbols of `expr`, ordered by i (1, 2, ...)."""
    found = {}
    for s in expr.free_symbols:
        name = s.name
        if name.startswith(kind) and name.endswith("_" + oid):
            i = name[len(kind):-len(oid) - 1]
            if i.isdigit():
                found[int(i)] = s
    if found and sorted(found) != list(range(1, len(found) + 1)):
        raise PetabError(f"observable {oid!r}: {kind} placeholders must be numbered 1..n, "
                         f"got {sorted(found)}")
    return [found[i] for i in sorted(found)]


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


def _check_model(model: Model):
    if not model.states:
        raise UnsupportedSBML("the model has no state variables (nothing changes in time)")
