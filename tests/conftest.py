"""Tests run in float64 on the CPU, with strict dtype promotion off (the library's
own steps cast coefficients to the state dtype)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
