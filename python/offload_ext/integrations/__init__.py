"""Integrations: the Offloader inside the training loops users already have (transformers' Trainer)."""
