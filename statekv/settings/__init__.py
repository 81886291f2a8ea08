"""Every setting, in one home: how a value of each kind is checked and read from text (`values`), a setting
declared once and the checked dataclasses made from tables of them (`setting`), the engine's settings
(`engine`: `EngineSettings`, `ENGINE_SETTINGS`, and the values they take), the methods and retrieval rules by
name with a method's sizes (`methods`: `MethodSpec`, `MethodSettings`), and how a `VideoQA` is set up (`options`:
`ModelOptions`, made from one table of the model's, the method's, the engine's and the video's settings).

It imports nothing of the engine: the engine reads its settings from here, the built-in methods are described here
(`methods.BUILTIN_METHODS`, whose policies load the engine's rules when first made), and the retrieval rules
register their names here (a lookup of a rule by name loads the engine once, `methods.with_builtins`, so that the
built-in rules are there however the package was imported)."""

from .engine import ENGINE_SETTINGS, EngineSettings
from .methods import MethodSettings, MethodSpec, method, method_names, register_method
from .options import ModelOptions
from .setting import Setting, settings_class

__all__ = ["ENGINE_SETTINGS", "EngineSettings", "MethodSettings", "MethodSpec", "ModelOptions", "Setting", "method",
           "method_names", "register_method", "settings_class"]
