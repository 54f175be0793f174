"""rollmesh's simulator: the real controller core on a virtual clock with simulated hardware.

``rollmesh simulate --scenario NAME|FILE --out DIR`` (see :mod:`simulator.cli`)
runs every configuration of a scenario - static splits and dynamic scheduling
- through :class:`controller.core.DynamicResourceController`, its policies and
its ``dynamic_resource/*`` metrics, with engines, trainer, weight sync and
sleep/wake simulated (:mod:`simulator.world`, :mod:`simulator.ports`), and
compares policies against an oracle found by search (:mod:`simulator.compare`,
:mod:`simulator.oracle`).
"""

from .run import RunResult, StepRecord, simulate_run
from .scenario import Scenario, ScenarioError, load_scenario, parse_scenario

__all__ = ["RunResult", "Scenario", "ScenarioError", "StepRecord", "load_scenario", "parse_scenario",
           "simulate_run"]
