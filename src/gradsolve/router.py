"""The router: a pure function from a request to an engine, recording why each
engine it passed over refused.

With `engine=None` the router tries, in the registry's order (`gs.engine_names()`),
the engines that route the task (`Engine.routes`) and takes the first that serves
the request: a gradient takes `fused_replay` for a field with a fused form (d <= 64 on
a GPU, <= 8 on the CPU), else `general_replay`; a forward solve takes `fused` under
the same rule, else `diffrax` (Tsit5 problems), else `general`.

The rules every engine obeys are here, once: the task (solve / gradient), the method
(`methods.default_for` picks it when none is named), the continuous extension for
`interpolate=True`, and several devices only for an engine that splits
(`Engine.one_device`). A family's own rules are asked through the engine hooks
(`Engine.admits`, `refuses_method`, `supports`; the Warp engines' fused form, dtype, d
cutoff and Rosenbrock23 rules live in engines/fused.py), and what they read off the
problem comes from `Engine.describe`: the router knows nothing of Warp.
"""

import equinox as eqx
import jax
import numpy as np

from . import layout, methods
from .config import check_interpolate, make_config
from .engines import ENGINES, Engine, Request
from .problem import _is_shared


def refusal(engine: Engine, request: Request) -> str | None:
    """`None` if `engine` can serve `request`, else the reason it cannot."""
    task = request.task
    if not engine.serves(task):
        if task == "gradient":
            hint = f" (gradients: {engine.gradients_by!r})" if engine.gradients_by else ""
            return "forward only" + hint
        return f"it does not serve {task}s"
    if (why := engine.admits(request)) is not None:
        return why
    if request.devices > 1 and not engine.splits:
        return f"one device only ({engine.one_device})"
    method = request.method or engine.default_method(request)
    if (why := engine.refuses_method(method, request)) is not None:
        return why
    if request.interpolate and not methods.get(method).has_dense_output:
        return (f"interpolate=True needs a method with a continuous extension; "
                f"{method!r} has none")
    if request.interpolate and not engine.interpolates_with(task, method):
        return (f"its Warp kernels serve ts by an integrated step ({method}); "
                f"interpolate=True runs on the JAX replay")
    return engine.supports(request)


def _named(engine) -> Engine:
    if isinstance(engine, str):
        if engine not in ENGINES:
            raise ValueError(f"engine must be None or one of {sorted(ENGINES)}, got {engine!r}")
        return ENGINES[engine]
    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be None, a name or a gs.Engine, got "
                        f"{type(engine).__name__}")
    return engine


def route(request: Request, engine=None, refused=None) -> tuple[Engine, dict[str, str]]:
    """Choose the engine for `request`.

    Args:
        request: a `gs.engines.Request`.
        engine: None (choose), an engine name, or an `Engine` instance.
        refused: `{name: reason}` of engines already turned down (their `check` of the
            problem), passed over with that reason.

    Returns:
        `(engine, passed_over)`, the second mapping each engine the router passed over
        to its reason.

    Examples:
        >>> import gradsolve as gs
        >>> from gradsolve.engines import Request
        >>> eng, why = gs.route(Request(gradient=True, stiff=False, d=3, method="tsit5"))
        >>> eng.name, why["fused_replay"].startswith("f_jax has no fused form")
        ('general_replay', True)
        >>> gs.route(Request(gradient=True, stiff=False, d=3, facts={"fused": True}))[0].name
        'fused_replay'
    """
    if request.method is not None:
        methods.get(request.method)
    if engine is not None:
        engine = _named(engine)
        reason = refusal(engine, request)
        if reason is not None:
            raise ValueError(f"engine {engine.name!r} cannot serve this request: {reason}")
        return engine, {}
    passed, last_warp = {}, None
    refused = refused or {}
    for candidate in ENGINES.values():
        if request.task not in candidate.routes:
            continue
        if request.warp and not candidate.warp:
            continue  # fused=True: only the Warp engines are candidates
        reason = refused.get(candidate.name) or refusal(candidate, request)
        if reason is None:
            policy = candidate.declines(request)
            if policy is None:
                return candidate, passed
            passed[candidate.name] = policy
            continue
        passed[candidate.name] = reason
        if candidate.warp:
            # The Warp engine named in the error: the last that refused, the one that
            # asks least of a request (fused_replay: every method, any mode).
            last_warp = candidate.name
    if request.warp and last_warp is not None:
        raise ValueError(f"engine {last_warp!r} cannot serve this request: "
                         f"{passed[last_warp]}")
    raise ValueError(f"no engine can serve this request: {passed}")


def _holds_module(params) -> bool:
    """Whether a `gs.Shared` subtree of `params` holds an Equinox module."""
    shared = [x.value for x in jax.tree.leaves(params, is_leaf=_is_shared) if _is_shared(x)]
    is_module = lambda x: isinstance(x, eqx.Module)
    return any(is_module(x) for s in shared for x in jax.tree.leaves(s, is_leaf=is_module))


def request_for(prob, *, gradient: bool, method=None, rtol=None, mode="reverse",
                interpolate=None, ts=False, fused=None, devices=None) -> Request:
    """The router's view of a call: the problem's stiffness, dimension, dtype and
    parameters, what the engine families read off it (`Engine.describe`: the Warp
    engines, whether the field has a fused form and a Jacobian), what is asked."""
    facts = {}
    for describe in dict.fromkeys(type(e).describe for e in ENGINES.values()):
        facts.update(describe(prob, fused))
    return Request(gradient=gradient, stiff=prob.stiff, d=prob.d, n=prob.n, method=method,
                   rtol=rtol, mode=mode,
                   interpolate=None if interpolate is None else bool(interpolate), facts=facts,
                   ts=bool(ts), dtype=np.dtype(prob.y0.dtype).name,
                   shared_module=_holds_module(prob.params),
                   warp=None if fused is None else bool(fused),
                   devices=0 if devices is None else layout.size(layout.device_mesh(devices)))


def plan(prob, *, gradient: bool, engine=None, method=None, fused=None, mode="reverse",
         **settings):
    """Route, resolve the method (the engine's default when none is given) and
    validate the settings: `(engine, passed_over, config)`."""
    if fused not in (None, True, False):
        raise ValueError(f"fused must be None, True or False, got {fused!r}")
    interpolate = settings.get("interpolate")
    check_interpolate(methods.get(method) if method is not None else None, interpolate)
    request = request_for(prob, gradient=gradient, method=method, rtol=settings.get("rtol"),
                          mode=mode, interpolate=interpolate,
                          ts=settings.get("ts") is not None, fused=fused,
                          devices=settings.get("devices"))
    if engine is not None and fused is False and _named(engine).warp:
        raise ValueError(f"engine {_named(engine).name!r} runs on Warp, but fused=False "
                         f"keeps the request off the Warp engines")
    refused = {}
    while True:
        chosen, passed = route(request, engine, refused)
        chosen_method = chosen.default_method(request) if method is None else method
        why = chosen.check(prob, chosen_method)
        if why is None:
            break
        if engine is not None:
            raise ValueError(f"engine {chosen.name!r} cannot serve this problem: {why}")
        refused[chosen.name] = why
    return chosen, passed, make_config(prob, method=chosen_method, splits=chosen.splits,
                                       interpolates=chosen.interpolates_with(
                                           request.task, chosen_method),
                                       **settings)
