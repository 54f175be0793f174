"""Runtime shared by every rollmesh server: config, errors, tracing, bootstrap, channels.

Nothing here imports torch or transformers; the controller and the load
balancer depend only on this package and the generated contracts.
"""

__version__ = "0.1.0"
