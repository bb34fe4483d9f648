"""Serving the best engine over HTTP: the tensor codec and request validation (codec.py)."""
