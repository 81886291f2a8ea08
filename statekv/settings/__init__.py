"""How a `VideoQA` is set up: the option table every consumer builds one from (`options`: `ModelOptions`, whose
engine entries are `statekv.core.stream.settings.ENGINE_SETTINGS`) and the method vocabulary (`methods`: the registry
of carry methods and their sizes, `MethodSettings`)."""

from .methods import MethodSettings, MethodSpec, method, method_names, register_method
from .options import ModelOptions

__all__ = ["MethodSettings", "MethodSpec", "ModelOptions", "method", "method_names", "register_method"]
