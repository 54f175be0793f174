"""The rollmesh replica agent: one per node, manages the engine replicas there."""
