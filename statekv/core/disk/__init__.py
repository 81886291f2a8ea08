"""The disk tier: a stream's detailed cache in an append-only, memory-mapped, journaled file set."""
