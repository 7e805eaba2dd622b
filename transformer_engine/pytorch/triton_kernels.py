"""The old path of `kernels.casts` (the Triton cast kernels), kept so that existing
imports work: importing it gives that very module, so monkeypatching either name
patches the kernels the package runs. Importing it imports Triton."""

import sys

from .kernels import casts as _casts

sys.modules[__name__] = _casts
