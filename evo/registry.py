"""The old home of the registered-model class: models registered before the layout moved pickle
`evo.registry.EnginePyfunc`, so the name stays importable here (see `evo.evidence.mlflow.registry`)."""
from evo.evidence.mlflow.registry import EnginePyfunc, register_engine

__all__ = ["EnginePyfunc", "register_engine"]
