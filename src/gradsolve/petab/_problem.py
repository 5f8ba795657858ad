"""`PetabProblem`: a PEtab v1 problem as an ensemble -- one trajectory per simulation
condition (and per preequilibration/simulation pair), the measurements and the PEtab
likelihood -- with simulate / llh / chi2 / llh_and_grad and a multistart Calibrator.

A thin facade over three parts, each in its own module: `_tables.Tables` (the tables
as arrays), `_model.JaxModel` (the model and tables as JAX functions: theta ->
`(params, y0)`, observables, steady states) and `_likelihood` (the objective). Here:
recording and replaying, the gradient, and the Calibrator's settings.
"""

import copy

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..calibrate import Calibrator, multistart
from ..problem import EnsembleProblem
from ..record import record
from ..replay import replay
from ..status import Status, summarize
from . import _likelihood
from ._model import JaxModel
from ._sbml import Model
from ._tables import PetabError, Tables

MIN_COLUMNS = 64  # the narrowest mesh `PetabProblem.record` returns


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
        tables, jax_model: the parts it is built from (`_tables.Tables`,
            `_model.JaxModel`).
    """

    def __init__(self, petab_problem, model: Model, *, rtol, atol, max_steps, stiff, fused,
                 name):
        self.petab_problem = petab_problem
        self.model = model
        self.rtol, self.atol, self.fused = float(rtol), float(atol), fused
        self.max_steps = int(max_steps)
        self.tables = t = Tables(petab_problem, model)
        self.jax_model = JaxModel(t, self.rtol, self.atol)
        self.measurements = t.measurements  # (`with_measurements` replaces the values)
        # Through the compiled `_initial` that every llh starts from (its compile is
        # shared): run eagerly, each of the conditions' and steady state's ops
        # compiled a small program of its own (Weber_BMC2015: 98, 2.1 s).
        params, y0 = self._initial(self._theta(None))
        y0 = np.asarray(y0)
        failed = [self.conditions[k][0] for k in range(len(y0)) if not np.isfinite(y0[k]).all()]
        if failed:
            raise PetabError(f"no steady state found for preequilibration condition(s) "
                             f"{sorted(set(failed))} at the nominal parameters")
        t_end = float(self.ts[-1]) if self.ts[-1] > 0 else 1.0
        self.problem = EnsembleProblem(f_jax=self.jax_model.rhs, y0=y0,
                                       params=params, t_span=(0.0, t_end),
                                       stiff=stiff, name=name)

    # The tables' attributes, read-only here (the tables are the one home of each).
    parameter_ids = property(lambda self: self.tables.parameter_ids)
    nominal = property(lambda self: self.tables.nominal)
    lower = property(lambda self: self.tables.lower)
    upper = property(lambda self: self.tables.upper)
    scales = property(lambda self: self.tables.scales)
    transforms = property(lambda self: self.tables.transforms)
    priors = property(lambda self: self.tables.priors)
    ts = property(lambda self: self.tables.ts)
    conditions = property(lambda self: self.tables.conditions)

    # -- theta to the ensemble -------------------------------------------------------

    def to_params(self, theta):
        """theta (a dict of the estimated parameters) -> `(K, P)` constants of every
        trajectory's simulation condition."""
        return self.jax_model.to_params(theta)

    def to_y0(self, theta):
        """theta -> `(K, d)` initial states: the simulation condition's (its table
        entries, else the model's initial values), or, after a preequilibration, its
        steady state with the species the simulation condition sets reinitialised.
        A preequilibration without a steady state gives NaN states."""
        return self.jax_model.to_y0(theta)

    # -- the likelihood --------------------------------------------------------------

    def loss(self, ys, theta, data):
        """The Calibrator's objective for one fit (`ys` `(K, len(ts), d)`, theta its
        parameters): the negative log-likelihood of `data["measurement"]`, minus the
        log-prior where the parameter table has objective priors (the negative
        log-posterior)."""
        return (_likelihood.neg_llh(self.jax_model, ys, theta, data)
                - _likelihood.log_prior(self.jax_model, theta))

    def residuals(self, ys, theta, data):
        """The least-squares form of `loss` for one fit: half the squared norm of
        these is the negative log-likelihood plus a constant (`_likelihood.residuals`:
        normal noise, no objective priors; `calibrator(least_squares=True)`)."""
        return _likelihood.residuals(self.jax_model, ys, theta, data["measurement"])

    def log_prior(self, theta=None) -> float:
        """The log-prior at theta (default: nominal): the sum over the parameter
        table's objective priors (0.0 where it has none); see `priors`."""
        return float(_likelihood.log_prior(self.jax_model, self._theta(theta)))

    @property
    def data(self) -> dict:
        """The measurements as the loss takes them: `{"measurement": (M,)}`."""
        return {"measurement": jnp.asarray(self.measurements["measurement"].to_numpy(float))}

    def _theta(self, theta):
        theta = self.nominal if theta is None else theta
        self.jax_model.vector(theta)
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
        one of `gs.Mesh.widened`'s widths (its `.recorder` names the recorder that
        ran)."""
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
        self.jax_model.refuse_moving_switches("llh_and_grad")
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
        return _likelihood.neg_llh(self.jax_model, ys, theta, self.data)

    @eqx.filter_jit
    def _chi2(self, ys, theta):
        return jnp.sum(_likelihood.terms(self.jax_model, ys, theta,
                                        self.data["measurement"])[1])

    @eqx.filter_jit
    def _simulated(self, ys, theta):
        return _likelihood.rows(self.jax_model, ys, theta)[0]

    @eqx.filter_jit
    def _loss_grads(self, ys, theta):
        value, (ct, direct) = jax.value_and_grad(
            lambda ys, th: _likelihood.neg_llh(self.jax_model, ys, th, self.data), argnums=(0, 1))(ys, theta)
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

    def calibrator(self, starts, optimizer=None, least_squares=False, edges="squash",
                   **settings):
        """A `gs.Calibrator` fitting `starts` copies of the problem at once (the
        negative log-likelihood, each parameter on its PEtab scale within its bounds);
        `settings` go to `gs.Calibrator` (rtol, atol and ts are the problem's). Use:
        `cal.fit(prob.starts(starts, key), steps)`, then `prob.summary(result)`
        (docs/petab.md; tested in tests/test_petab.py).

        `least_squares=True` fits the problem's `residuals` (its loss then differs
        from the negative log-likelihood by a constant), by Levenberg-Marquardt unless
        `optimizer` says otherwise; refused, with the reason, for Laplace noise and
        objective priors.

        `edges` is how the bounds are kept (`gs.transforms`' module): `"squash"` (the
        logit of each parameter's position between its bounds; the better space to
        search from scattered starts) or `"clip"` (the scale itself, each step
        projected into the bounds; a bound is a finite step away, so a fit whose
        optimum lies on one gets there). A polish, as `benchmarks/time_to_optimum.py`
        does on Boehm: `prob.calibrator(S, least_squares=True, edges="clip").fit(
        res.theta, steps=100)` from a squashed multistart's `res`.
        """
        if not isinstance(starts, int) or starts < 1:
            raise ValueError(f"starts must be a positive integer, got {starts!r}")
        self.jax_model.refuse_moving_switches("calibrator")
        for fixed in ("rtol", "atol", "max_steps", "ts", "to_params", "to_y0", "data",
                      "transform"):
            if fixed in settings:
                raise ValueError(f"{fixed} is the PEtab problem's own; set rtol/atol/"
                                 "max_steps in gs.petab.load")
        prob = self.problem.replace(
            y0=jnp.tile(self.problem.y0, (starts, 1)),
            params=jnp.tile(self.problem.params, (starts, 1)))
        data = jax.tree.map(lambda x: jnp.broadcast_to(x, (starts,) + x.shape), self.data)
        objective = {"loss": self.loss}
        if least_squares:
            why = _likelihood.least_squares_refusal(self.jax_model)
            if why is not None:
                raise PetabError(f"least_squares=True: the objective is not a sum of "
                                 f"squares: {why}")
            objective = {"residuals": self.residuals}
        return Calibrator(
            prob, **objective, to_params=self.to_params, data=data, optimizer=optimizer,
            to_y0=self.to_y0, transform={k: type(t)(t.lo, t.hi, edges=edges)
                                         for k, t in self.transforms.items()},
            rtol=self.rtol, atol=self.atol, max_steps=self.max_steps, ts=self.ts,
            **settings)

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


