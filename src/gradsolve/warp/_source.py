"""Warp source text's two primitives, shared by every generator (`_steps`,
`_rosenbrock23`, `_translate`): a float as a typed literal with all its digits, and a
weighted sum of named vectors."""


def lit(x) -> str:
    """A float as a typed Warp literal with all its digits: `T(0.1)`."""
    return f"T({float(x)!r})"


def combo(weights, names):
    """`T(w0) * k0 + T(w1) * k1 ...` over nonzero weights."""
    terms = [f"{lit(w)} * {k}" for w, k in zip(weights, names) if w != 0]
    return " + ".join(terms) if terms else "V()"
