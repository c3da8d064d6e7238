"""`hybridkv sim pd`: a discrete-event simulation of disaggregated serving.

Prefill endpoints, KV/state transfers (descriptors x per-descriptor cost + bytes / bandwidth, counts from the
descriptor analyzer) and decode endpoints with KV/state capacity: params (the model's parameters), recipe (YAML
recipes, each parameter with its source), model (per-request costs from the analyzer), engine (the event loop),
sweep (concurrency sweeps), report (tables, JSON, plots), cli.
"""
