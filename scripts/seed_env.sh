# Sourced by the engine set-ups (setup_vllm.sh, setup_sglang.sh): start an engine's environment as hard
# links to the core environment's installed files, so that torch, NIXL, UCX, Triton and the test tools
# are stored once on disk rather than three times. Three full copies took ~8 GB and filled CI's disk
# (6 GB free); seeded, the three take ~4 GB. pip unlinks a file before it writes one, and Python writes
# bytecode by rename, so an install or upgrade in one environment never changes the other's files.
#
# seed_env VENV: (re)creates VENV seeded from .venv, after making sure .venv is set up.
seed_env() {
    local venv="$1" core="$ROOT/.venv" site core_site f
    mkdir -p "$ROOT/.logs"
    # Both engine set-ups may start at once: one of them builds .venv, the other waits for it.
    flock "$ROOT/.logs/core_setup.lock" bash "$ROOT/scripts/setup.sh"
    rm -rf "$venv"
    "${PY:-python3}" -m venv --without-pip "$venv"
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    core_site="$("$core/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    if ! cp -al "$core_site/." "$site/" 2>/dev/null; then
        # Another file system (no hard links): start empty and let pip install everything.
        echo "seed_env: cannot hard-link $core_site into $site; installing every package" >&2
        rm -rf "$venv"
        "${PY:-python3}" -m venv "$venv"
        return 0
    fi
    # Console scripts name their interpreter on the first line: copies that name this environment's.
    for f in "$core/bin/"*; do
        [[ -f "$f" && ! -L "$f" && ! -e "$venv/bin/$(basename "$f")" ]] || continue
        if head -c 64 "$f" | head -1 | grep -q "^#!$core/bin/python"; then
            sed "1s|^#!$core/bin/python|#!$venv/bin/python|" "$f" > "$venv/bin/$(basename "$f")"
            chmod +x "$venv/bin/$(basename "$f")"
        fi
    done
}
