"""Elastic scaling of rollout replicas: everything about scale operations and the autoscaler, in one place.

- :mod:`.operations` - the scale-out/in operation records and their state machine (pure, injected time);
- :mod:`.autoscaler` - the autoscaler's decision core (pure: conditions, cooldowns, the delta formula);
- :mod:`.scaler` - ``Scaler``: runs scale operations against the registry and the agents;
- :mod:`.runs` - the steps of one scale-out or scale-in run (launch, seed weights, drain, stop);
- :mod:`.autoscaler_loop` - ``AutoscalerLoop``: samples metrics and applies the core's decisions;
- :mod:`.service` / :mod:`.convert` - the scaling and autoscaler RPCs and their message conversion.
"""
