"""Attention: a step's attention and the attention mass its keys receive (`scored`: the backends), and how the
model's own attention reaches the engine (`switch`: the language model's attention switched once to the engine's
function; `thread_value`: the per-thread values such calls read; `untraced`: the engine's calls a compiled decoder
leaves out of its graph)."""
