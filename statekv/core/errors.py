"""Exceptions raised by the engine. Each carries a one-line message that names the problem."""


class StateKVError(Exception):
    """Base class of every error statekv raises on purpose."""


class ConfigurationError(StateKVError, ValueError):
    """An argument or setting is invalid (for example a budget that is not a positive integer)."""


class InputError(StateKVError, ValueError):
    """A chunk or prompt given to the engine is malformed (empty, wrong hidden size, wrong batch)."""


class UnsupportedModelError(StateKVError, ValueError):
    """The model cannot be streamed (its attention does not go through transformers' AttentionInterface)."""


class HorizonError(StateKVError, ValueError):
    """The planned or reached sequence length is beyond what the model's RoPE can represent."""
