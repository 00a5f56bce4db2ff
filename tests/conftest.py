"""Shared pytest fixtures."""

import jax
import pytest


@pytest.fixture
def x64():
  """Runs a test in float64 (restored afterwards, so other tests keep float32)."""
  with jax.enable_x64(True):
    yield
