"""The rollmesh trainer agent: one per trainer node; rank 0 drives fully-async training."""
