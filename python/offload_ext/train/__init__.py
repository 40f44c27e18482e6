"""offload-train: the training application, a client of the package's public API."""
