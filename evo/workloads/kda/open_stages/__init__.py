"""The hand-written intra, per-chunk state update and output stages of the torch engine, each a
self-contained source (imports only torch): `stages.py` imports them, `open_code.py` reads them as the
seeds that a genome's code replaces."""
