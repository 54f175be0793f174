"""Tests of the weight-broadcast transfer (mesh_runtime.weights)."""
