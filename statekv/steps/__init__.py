"""How frames become the engine's steps: decoding, vision and the language model overlapped on threads
(`overlap`), and the steps of one or several videos planned, vision-encoded in one call, laid out and stepped in
rounds through the engine's batcher (`jobs`)."""
