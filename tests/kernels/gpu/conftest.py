"""The Triton kernels run on the CPU here, in Triton's interpreter: the variable must be set
before the kernels are defined (at import)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton comes with the test extras")
