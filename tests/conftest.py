import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".inductor_cache"))
