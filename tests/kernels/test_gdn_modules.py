"""CPU: how the GDN kernel package hangs together: no import circle among its modules, nothing imported from the
layers above it (benchmarks, tools), the decode tuning key, and the engine-shaped decode steps `bench gdn` runs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import hybridkv.kernels

ROOT = Path(hybridkv.kernels.__file__).parent


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT.parent.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports() -> dict[str, set[str]]:
    """Every hybridkv module each kernel module imports, at module level or inside a function."""
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hybridkv"):
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("hybridkv"))
        graph[name] = {d for d in deps if d != name}
    return graph


def test_no_import_circle_among_kernel_modules():
    graph = _imports()
    kernel = {m: {d for d in deps if d in graph} for m, deps in graph.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(kernel[m]):
            if state.get(d) == 1:
                cycle = path[path.index(d):] + [d] if d in path else [m, d]
                pytest.fail(f"import circle: {' -> '.join(cycle)}")
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(kernel):
        if m not in state:
            visit(m, [m])


def test_kernels_import_nothing_from_the_layers_above():
    above = ("hybridkv.benchmarks", "hybridkv.descriptors", "hybridkv.connectors", "hybridkv.sims", "tools")
    bad = {m: sorted(d for d in deps if d.startswith(above)) for m, deps in _imports().items()}
    assert not {m: d for m, d in bad.items() if d}


def test_no_bench_or_probe_module_is_left_in_the_package():
    names = {p.stem for p in ROOT.rglob("*.py")}
    assert not {n for n in names if n.startswith(("bench", "triton_")) or "probe" in n
                or n in ("breakdown", "host_profile", "baselines", "flashinfer_args", "compile_report", "compile_specs")}


torch = pytest.importorskip("torch")
pytest.importorskip("triton")


def test_the_decode_key_holds_the_pool():
    """Two pools of the same shapes that differ in slot count, slot stride (a per-layer view of a block-major pool)
    or index dtype get keys of their own: the tuner's pick for one is not reused for the other."""
    from hybridkv.kernels.gdn.decode import decode_key

    q, v = torch.zeros(8, 2, 128), torch.zeros(8, 4, 128)
    dense = torch.zeros(16, 4, 128, 128)
    larger = torch.zeros(64, 4, 128, 128)
    layer = torch.zeros(16, 2, 4, 128, 128)[:, 1]
    i64, i32 = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int32)
    keys = {decode_key(q, v, pool, idx, True, True) for pool in (dense, larger, layer) for idx in (i64, i32)}
    assert len(keys) == 6
    assert decode_key(q, v, dense, i64, True, True) == decode_key(q, v, dense.clone(), i64.clone(), True, True)


@pytest.mark.parametrize("N", [64, 256])
def test_engine_decode_steps_are_laid_out_as_the_engines_lay_them(N):
    from hybridkv.benchmarks.gdn import cases

    vllm = cases.decode_step(cases.Pool.VLLM, N, "cpu")
    live = vllm.indices[:N]
    assert vllm.indices.dtype == torch.int32 and vllm.slots == 4 * N
    assert (vllm.indices[N:] == cases.PAD_SLOT_ID).all() and vllm.indices.numel() == N + N // 8
    assert (live >= 1).all() and (live < vllm.slots).all() and live.unique().numel() == N  # block 0: the null block
    sglang = cases.decode_step(cases.Pool.SGLANG, N, "cpu")
    assert sglang.indices.dtype == torch.int64 and (sglang.indices[N:] == 0).all() and (sglang.indices[:N] > 0).all()
    dense = cases.decode_step(cases.Pool.DENSE, N, "cpu")
    assert dense.indices.numel() == N and dense.slots == 2 * N
    with pytest.raises(ValueError, match="pool must be a Pool .*got 'vllm'"):
        cases.decode_step("vllm", N, "cpu")
