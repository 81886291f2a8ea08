"""Where tokens sit in RoPE: each stream's frozen rotation (`rope`), the positions a stream gives its steps and
questions (`placing`: ``stream``, or ``bounded`` inside the model's trained range), where a bounded step's chunk
and carried keys go (`layouts`), and keys rotated from one position to another (`rotation`)."""
