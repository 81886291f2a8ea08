"""One stream's engine: `StreamingPrefill` (`prefill`: its settings read from `statekv.settings.engine`) and its
statistics (`stats`)."""
