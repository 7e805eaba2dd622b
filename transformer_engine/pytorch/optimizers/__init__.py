"""Fused optimizers and multi-tensor operations."""
