"""Engine plugins: vLLM (hybridkv.connectors.vllm), SGLang (hybridkv.connectors.sglang) and the
reference engine behind `hybridkv demo` (hybridkv.connectors.reference)."""

# The repository folder is importable by its bare name from a checkout; a second copy of every class
# under that name would break isinstance checks, so only the installed name is accepted.
if __name__ != "hybridkv.connectors":
    raise ImportError(f"import hybridkv.connectors, not {__name__}: the connectors/ folder installs as "
                      "hybridkv.connectors")
