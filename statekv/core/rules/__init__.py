"""The carry rules: which tokens a layer carries into the next step (`policies`), and the built-in methods that
name them for users (`methods`)."""

from . import methods  # noqa: F401  (registers the built-in methods)
