"""The old path of `kernels.launch` (how the Triton kernels are launched), kept so
that existing imports work: importing it gives that very module."""

import sys

from .kernels import launch as _launch

sys.modules[__name__] = _launch
