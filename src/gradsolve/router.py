"""The router: a pure function from a request to an engine, recording why each
engine it passed over refused.

With `engine=None`: a gradient takes `fused_replay` for a fused field with d <= 64,
else `general_replay`; a forward solve takes `fused` for a fused field with d <= 64,
else `diffrax` if installed, else `general`. Engines not built into this version are
passed over with that reason.
"""

from . import methods
from .engines import ENGINES, Engine, Request


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
        ('general_replay', 'not built into this version')
    """
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
