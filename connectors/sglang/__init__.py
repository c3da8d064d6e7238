"""SGLang PD-disaggregation transfer backend `hybridkv`.

Registered through the `sglang.srt.plugins` entry point (see `plugin.py`); an
operator passes `--disaggregation-transfer-backend hybridkv` to both the
prefill and the decode server. Nothing here imports SGLang at package import
time, so installing hybridkv without SGLang costs nothing.
"""

BACKEND_NAME = "hybridkv"
