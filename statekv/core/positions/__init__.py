"""Where tokens sit in RoPE: each stream's frozen rotation (`rope`), the positions a stream gives its steps
and questions (`placing`: ``stream``, or ``bounded`` inside the model's trained range), and keys rotated from one
position to another (`rotation`)."""
