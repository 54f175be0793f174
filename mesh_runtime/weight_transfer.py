"""Weight-broadcast transfer: the public names of :mod:`mesh_runtime.weights` in one module.

Imports torch; only the model-running servers import this.
"""

from mesh_runtime.weights import *  # noqa: F403
from mesh_runtime.weights import __all__  # noqa: F401
