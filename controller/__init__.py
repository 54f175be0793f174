"""The rollmesh controller: owns the mesh's state and every transition in it."""
