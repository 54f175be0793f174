"""Tests of the weight-broadcast transfer (weight_transfer)."""
