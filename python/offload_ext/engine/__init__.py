"""The engine: the Offloader and its runtime parts (backends, device rings, gradient paths, activations)."""
