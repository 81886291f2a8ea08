"""One stream's engine: `StreamingPrefill` (`prefill`), its statistics (`stats`) and settings (`settings`)."""
