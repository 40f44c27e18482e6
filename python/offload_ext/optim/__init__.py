"""Optimizers: CPUAdamW on the native fused kernel, its in-backward overlap, and the device optimizer."""
