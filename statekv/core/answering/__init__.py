"""Answering a question from a stream: the cache a question decodes with (`answer_cache`), the steps it retrieves
(`retrieval`), transformers' ``generate`` over it (`decoding`) and the check of its generation arguments
(`generation_args`)."""
