# Sourced by the device scripts: $OUT, the carried wheels (.whl, from tools/device/wheels.sh) installed into $SITE,
# hybridkv installed editable (its subcommands are entry points), and the environment every GPU run takes.
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/hybridkv_device_out}
SITE=${SITE:-/tmp/site}
export PY OUT SITE  # the scripts that skip this file (HKV_ENV_DONE) read them
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 UCX_WARN_UNUSED_ENV_VARS=n
# No NVLink multicast on lent machines (the device tool's KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    >"$OUT/install.log" 2>&1 || { echo "wheel install failed"; tail "$OUT/install.log"; }
export PYTHONPATH="$SITE:$PWD"
"$PY" -m pip install -q --no-deps --no-index --no-build-isolation -e . >"$OUT/install_hkv.log" 2>&1 \
    || { echo "editable install failed:"; tail -n 5 "$OUT/install_hkv.log"; }
