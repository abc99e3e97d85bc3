"""Test configuration: float64 on, hypothesis profiles (`ci` small by default, `full` opt-in)."""

import os

import jax
from hypothesis import HealthCheck, settings

jax.config.update("jax_enable_x64", True)

settings.register_profile(
    "ci", max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "full", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
