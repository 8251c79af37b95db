"""H100 program benchmark: a Keras 3 step compiled for an H100 without a GPU (see README.md)."""
