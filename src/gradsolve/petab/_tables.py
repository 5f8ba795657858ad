"""The PEtab tables compiled to arrays, once, when a problem is loaded.

- Every model constant (parameter, compartment size, constant species) of every
  condition is either a number or an estimated parameter: `Values` holds a number
  array and an index array (-1: the number; i >= 0: entry i of theta), so building
  the parameters of all trajectories from theta is one `where`.
- The same for species reinitialised by a condition, and for the observable and noise
  parameters each measurement row gives its observable's placeholders.
- Observable and noise formulas stay SymPy expressions here, with their placeholder
  symbols; `_model.JaxModel` makes them JAX functions.

Nothing here is JAX but `Values.at`; every refusal is a `PetabError` naming the table
and the entry.
"""

import dataclasses
import math
import numbers
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import sympy as sp

from ..calibrate import transforms as _transforms
from ._sbml import TIME, Model, canonical, symbol

SCALES = ("lin", "log", "log10")
# PEtab v1's objective priors: the density of the parameter in linear units
# (uniform, normal, laplace), of its natural log with the Jacobian to linear units
# (logNormal, logLaplace: densities of the parameter), or of its value on its
# parameterScale (parameterScale*: densities of the scaled value, no Jacobian).
PRIORS = ("uniform", "normal", "laplace", "logNormal", "logLaplace",
          "parameterScaleUniform", "parameterScaleNormal", "parameterScaleLaplace")
TRANSFORMATIONS = ("lin", "log", "log10")
DISTRIBUTIONS = ("normal", "laplace")


class PetabError(ValueError):
    """A PEtab problem this importer cannot take, with the table and entry at fault."""


@dataclasses.dataclass(frozen=True)
class Values:
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


class Observable(NamedTuple):
    """One observable of the observable table and the measurement rows that read it."""

    id: str
    rows: np.ndarray  # its rows of the measurement table
    transformation: str  # one of TRANSFORMATIONS
    distribution: str  # one of DISTRIBUTIONS
    formula: sp.Expr
    noise: sp.Expr
    placeholders: list  # observableParameter{i}_{id}, i = 1, 2, ...
    noise_placeholders: list  # noiseParameter{i}_{id}
    values: Values  # per row, the observable placeholders' values
    noise_values: Values


class Tables:
    """A PEtab v1 problem's tables as arrays, for `model`.

    Attributes:
        measurements: the measurement table (rows renumbered from 0).
        table: every parameter table entry's nominal value, by id.
        parameter_ids, scales, lower, upper, nominal, priors, transforms: the
            estimated parameters (see `PetabProblem`).
        ts: the sorted unique finite measurement times (every trajectory's outputs).
        conditions: per trajectory, `(preequilibration condition or None, simulation
            condition)`; `preeq`: the preequilibration conditions.
        row_trajectory, row_time, row_inf: per measurement row, its trajectory, its
            index into `ts`, and whether it reads the steady state (time = inf).
        steady_of: the trajectories with steady-state measurements.
        params, computed, states, reset: per trajectory, the model constants
            (`Values`; `computed`: given by an initial assignment) and the species a
            condition sets (`reset`); `pre_*` the same per preequilibration condition,
            `pre_of` each trajectory's (-1: none).
        outputs, g: the parameter table entries that are not model constants (read by
            observable and noise formulas), and their `Values`.
        observable_ids, observables: the observable table, one `Observable` each.
    """

    def __init__(self, petab_problem, model: Model):
        self.model = model
        self.measurements = petab_problem.measurement_df.reset_index(drop=True)
        self._parameters(petab_problem.parameter_df)
        self._trajectories(petab_problem.condition_df)
        self._observables(petab_problem.observable_df)

    def _parameters(self, df):
        for column in ("parameterScale", "lowerBound", "upperBound", "nominalValue",
                       "estimate"):
            if column not in df.columns:
                raise PetabError(f"the parameter table has no {column!r} column")
        self.table, priors = {}, {}
        ids, scales, lower, upper, nominal = [], [], [], [], []
        for pid, row in df.iterrows():
            value = float(row["nominalValue"])
            self.table[pid] = value
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

    def source(self, value, where):
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
        if text in self.table:
            return self.table[text], -1
        raise PetabError(f"{where} refers to {text!r}, which is not in the parameter table")

    def _trajectories(self, conditions):
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
        # simulation reaches from its initial state (`JaxModel.steady_states`).
        self.row_inf = np.isinf(times)
        finite = times[~self.row_inf]
        self.ts = np.unique(finite) if finite.size else np.zeros(1)  # (no row reads it)
        pre = df["preequilibrationConditionId"] if "preequilibrationConditionId" in df \
            else [None] * len(df)
        pairs = [(None if _empty(a) else str(a), str(b))
                 for a, b in zip(pre, df["simulationConditionId"])]
        self.conditions = tuple(dict.fromkeys(pairs))
        self.row_trajectory = np.array([self.conditions.index(p) for p in pairs])
        self.row_time = np.where(self.row_inf, 0, np.searchsorted(self.ts, times))
        self.steady_of = np.unique(self.row_trajectory[self.row_inf])
        columns = [c for c in conditions.columns if c != "conditionName"]
        for c in columns:
            if c in m.derived:
                raise PetabError(f"condition table column {c!r} sets an assignment-rule "
                                 "target")
            if c not in m.constants and c not in m.states:
                raise PetabError(f"condition table column {c!r} is neither a model "
                                 "parameter, a compartment nor a species")
        self.preeq = tuple(dict.fromkeys(a for a, _ in self.conditions if a is not None))

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
                    num[j], idx[j] = self.source(value, f"condition {cid!r}, column {c!r}")
                elif c in self.table:
                    num[j], idx[j] = self.source(c, f"parameter {c!r}")
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
                    snum[i], sidx[i] = self.source(value, f"condition {cid!r}, column {x!r}")
                    sset[i] = True
            return num, idx, computed, snum, sidx, sset

        def stack(cids):
            parts = [condition(c) for c in cids]
            widths = [len(m.constants)] * 3 + [len(m.states)] * 3
            return [np.array([part[i] for part in parts]).reshape(len(cids), w)
                    for i, w in enumerate(widths)]

        num, idx, self.computed, snum, sidx, self.reset = stack(
            [s for _, s in self.conditions])
        self.params = Values(num, idx.astype(int))
        self.states = Values(snum, sidx.astype(int))
        num, idx, self.pre_computed, snum, sidx, self.pre_reset = stack(self.preeq)
        self.pre_params = Values(num, idx.astype(int))
        self.pre_states = Values(snum, sidx.astype(int))
        self.pre_of = np.array([self.preeq.index(a) if a is not None else -1
                                for a, _ in self.conditions])
        # A steady state is of a right-hand side that does not read time: the model's,
        # or the one a condition's values make (a dose of 0 switches off a timed
        # stimulus: Brannmark_JBC2010's preequilibration).
        self._refuse_time(self.pre_params, self.pre_computed, range(len(self.preeq)),
                          self.preeq, "preequilibration condition")
        self._refuse_time(self.params, self.computed, self.steady_of,
                          [s for _, s in self.conditions],
                          "steady-state measurements (time = inf) of condition")

    def fixed(self, values, computed, e):
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
            fixed = {**self.fixed(values, computed, e), TIME: later}
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
        self.outputs = tuple(p for p in self.table if p not in m.constants)
        num, idx = zip(*[self.source(p, f"parameter {p!r}") for p in self.outputs]) \
            if self.outputs else ((), ())
        self.g = Values(np.asarray(num, float), np.asarray(idx, int))
        model_symbols = {symbol(s) for s in m.states + m.constants} | {TIME}
        self.observables = []
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
            allowed = model_symbols | set(oq) | set(nq) | {symbol(p) for p in self.outputs}
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
                        num[r, j], idx[r, j] = self.source(
                            v, f"measurement row {i}, {column}")
                q.append(Values(num, idx))
            self.observables.append(Observable(oid, at, trafo, dist, formula, noise, oq, nq,
                                               q[0], q[1]))


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
