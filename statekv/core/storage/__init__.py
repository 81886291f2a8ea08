"""Where the detailed cache lives and how it is read: token buffers (`buffers`), a layer's storage with the model
or offloaded (`layer_storage`), stored quantized (`quantized`), which one a layer gets (`tiers`), a cap on it and
eviction (`limits`), and the memory a horizon needs (`memory`)."""
