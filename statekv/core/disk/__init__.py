"""The disk tier: a stream's detailed cache in an append-only, memory-mapped, journaled file set of its own
(`tier`: `DiskTier`), its layers' files (`buffers`), its descriptions and journal read back (`files`), and resuming
a cache from it (`resume`)."""
