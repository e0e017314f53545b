"""The floor everything stands on (ggml.h / ggml-backend.h): the graph and its ops with their
properties, weight records, KV cache types, errors, logging and the `Backend` protocol.
Nothing here imports another floor of the house."""
