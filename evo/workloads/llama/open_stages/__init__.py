"""The seeds of the Llama engine's open stages: each a self-contained source (read as text by
`open_code.py`, imported by `engine.py`)."""
