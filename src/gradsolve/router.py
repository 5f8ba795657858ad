"""The router: a pure function from a request to an engine, recording why each
engine it passed over refused.

With `engine=None`: a gradient takes `fused_replay` for a fused field with d <= 64,
else `general_replay`; a forward solve takes `fused` for a fused field with d <= 64,
else `diffrax` if installed, else `general`. Engines not built into this version are
passed over with that reason.
"""

from . import methods
from .config import make_config
from .engines import ENGINES, Engine, Request
from .fields._warp import fused_form


GRADIENT_ORDER = ("fused_replay", "general_replay")
FORWARD_ORDER = ("fused", "diffrax", "general")


def route(request: Request, engine=None) -> tuple[Engine, dict[str, str]]:
    """Choose the engine for `request`.

    Args:
        request: a `gs.engines.Request`.
        engine: None (choose), an engine name, or an `Engine` instance.

    Returns:
        `(engine, passed_over)`, the second mapping each engine the router passed over
        to its reason.

    Examples:
        >>> import gradsolve as gs
        >>> from gradsolve.engines import Request
        >>> eng, why = gs.route(Request(gradient=True, stiff=False, d=3, method="tsit5"))
        >>> eng.name, why["fused_replay"]
        ('general_replay', 'f_jax has no fused form (gs.register_field translates one)')
        >>> gs.route(Request(gradient=True, stiff=False, d=3, fused=True))[0].name
        'fused_replay'
    """
    if request.method is not None:
        methods.get(request.method)
    if engine is not None:
        if isinstance(engine, str):
            if engine not in ENGINES:
                raise ValueError(
                    f"engine must be None or one of {sorted(ENGINES)}, got {engine!r}")
            engine = ENGINES[engine]
        elif not isinstance(engine, Engine):
            raise TypeError(f"engine must be None, a name or a gs.Engine, got "
                            f"{type(engine).__name__}")
        reason = engine.supports(request)
        if reason is not None:
            raise ValueError(f"engine {engine.name!r} cannot serve this request: {reason}")
        return engine, {}
    passed = {}
    for name in GRADIENT_ORDER if request.gradient else FORWARD_ORDER:
        candidate = ENGINES.get(name)
        if candidate is None:
            passed[name] = "not built into this version"
            continue
        reason = candidate.supports(request)
        if reason is None:
            return candidate, passed
        passed[name] = reason
    raise ValueError(f"no engine can serve this request: {passed}")


def request_for(prob, *, gradient: bool, method=None, rtol=None) -> Request:
    """The router's view of a problem: stiffness, dimension, whether its field has a
    fused form (and a hand-written Jacobian), the tolerance asked for."""
    field, why = fused_form(prob)
    return Request(gradient=gradient, stiff=prob.stiff, d=prob.d, method=method,
                   fused=field is not None, jacobian=bool(field is not None and field.stiff),
                   rtol=rtol, fused_why=why)


def plan(prob, *, gradient: bool, engine=None, method=None, **settings):
    """Route, resolve the method (the engine's default when none is given) and
    validate the settings: `(engine, passed_over, config)`."""
    request = request_for(prob, gradient=gradient, method=method, rtol=settings.get("rtol"))
    chosen, passed = route(request, engine)
    method = chosen.default_method(request) if method is None else method
    return chosen, passed, make_config(prob, method=method, **settings)
