"""Steps of one or several streams through the model: the batcher every step goes through (`batching`), CUDA
graphs of steady steps (`graphs`) and their compiled decoder (`compiled`)."""
