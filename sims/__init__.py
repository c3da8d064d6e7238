"""Discrete-event simulators: the async-scheduling race (hybridkv.sims.race) and disaggregated
serving throughput (hybridkv.sims.pd)."""

# The repository folder is importable by its bare name from a checkout; a second copy of every class
# under that name would break isinstance checks, so only the installed name is accepted.
if __name__ != "hybridkv.sims":
    raise ImportError(f"import hybridkv.sims, not {__name__}: the sims/ folder installs as "
                      "hybridkv.sims")
