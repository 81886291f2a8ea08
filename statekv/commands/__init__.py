"""The ``statekv`` sub-commands that work on videos: ``answer``, ``stream`` and ``demo``."""
