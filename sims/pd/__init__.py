"""`hybridkv sim pd`: a discrete-event simulation of disaggregated serving.

Prefill endpoints holding each prompt's blocks until its transfer ends, KV/state transfers (posting in
the thread that posts, then descriptors x wire cost + bytes / bandwidth on a node's shared link, counts
from the descriptor analyzer) and decode endpoints whose blocks grow with the context, with preemption:
params (the simulator's parameters), recipe (YAML recipes, each parameter with its source), model (per-request
sizes from the analyzer and each scheme's cache layout), loop (event clock, step loop, shared link), engine
(requests through it all), sweep (loads x seeds, schemes, sensitivity), report (tables, JSON, plots), cli.
"""
