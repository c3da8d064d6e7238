"""The `hybridkv` CLI's edges: one error line (no traceback) for what a user can fix, a traceback for
bugs, --version, one-line help for every subcommand, and what the package ships."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib.metadata import EntryPoint, entry_points, version
from pathlib import Path

import pytest

import hybridkv.cli as cli
from hybridkv.cli import CommandError, MissingExtra, install_hint, main, missing_extra

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TRACEBACK = "Traceback (most recent call last)"


def _console_script() -> list[str]:
    exe = Path(sys.executable).with_name("hybridkv")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "hybridkv.cli"]


def _cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*_console_script(), *argv], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert TRACEBACK not in err, err
    assert len(lines) == 1 and lines[0].startswith("hybridkv: error: "), err
    return lines[0]


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ----------------------------------------------------------------------------- version and help


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"hybridkv {version('hybridkv')}"


def _commands() -> list[str]:
    return sorted(ep.name for ep in entry_points(group=cli.ENTRY_POINT_GROUP))


def test_every_command_in_pyproject_is_installed():
    # A stale editable install (entry points changed, `pip install -e .` not rerun) shows here.
    assert _commands() == sorted(PYPROJECT["project"]["entry-points"]["hybridkv.commands"])


def _words(text: str) -> str:
    return " ".join(text.split())


def test_top_level_help_lists_every_command_with_what_it_does(capsys):
    with pytest.raises(SystemExit):
        main(["-h"])
    listing = _words(capsys.readouterr().out)
    assert "--version" in listing
    for ep in entry_points(group=cli.ENTRY_POINT_GROUP):
        top, *rest = ep.name.split(".")
        if not rest:
            summary = cli.command_summary(ep.load())
            assert f"{top} {summary}" in listing
        else:
            assert top in listing and rest[0] in listing  # the group's line names its members


@pytest.mark.parametrize("group", sorted({n.split(".")[0] for n in _commands() if "." in n}))
def test_group_help_lists_each_subcommand_with_what_it_does(capsys, group):
    with pytest.raises(SystemExit):
        main([group, "-h"])
    listing = _words(capsys.readouterr().out)
    for ep in entry_points(group=cli.ENTRY_POINT_GROUP):
        if ep.name.startswith(group + "."):
            summary = cli.command_summary(ep.load())
            assert summary and not summary.startswith("(")
            assert f"{ep.name.split('.')[-1]} {summary}" in listing


def test_summary_comes_from_the_register_modules_docstring():
    import hybridkv.descriptors.analyze_cli as analyze

    assert cli.command_summary(analyze.register) == "descriptors each scheme issues for one request, side by side"


# ----------------------------------------------------------------------------- one error line


def test_bench_transfer_bad_layers_is_one_line():
    proc = _cli("bench", "transfer", "--layers", "3")
    assert proc.returncode == 2
    assert "--layers 3; expected a positive multiple of 4" in _one_error_line(proc.stderr)


def test_bench_transfer_unknown_model_is_one_line():
    proc = _cli("bench", "transfer", "--model", "nope")
    assert proc.returncode == 2
    assert "unknown model 'nope'" in _one_error_line(proc.stderr)


def test_bench_transfer_bad_block_size_is_one_line(capsys):
    rc, _, err = _main(capsys, "bench", "transfer", "--block-size", "0")
    assert rc == 2 and "--block-size 0" in _one_error_line(err)


def test_demo_async_depth_names_a_flag_that_exists(capsys):
    rc, _, err = _main(capsys, "demo", "--async-depth", "1000")
    line = _one_error_line(err)
    assert rc == 2 and line.startswith("hybridkv: error: --async-depth 1000; expected 0 to ")
    with pytest.raises(SystemExit):
        main(["demo", "-h"])
    assert "--async-depth" in capsys.readouterr().out


# ----------------------------------------------------------------------------- missing extras


@pytest.mark.parametrize("argv,module,extra", [
    (("demo", "--requests", "1"), "torch", "kernels"),
    (("bench", "gdn"), "torch", "kernels"),
])
def test_a_missing_optional_dependency_names_its_extra(capsys, monkeypatch, argv, module, extra):
    if ".".join(argv[:2]) not in _commands() and argv[0] not in _commands():
        pytest.skip(f"no `hybridkv {' '.join(argv[:2])}` installed")
    monkeypatch.setitem(sys.modules, module, None)  # `import torch` now fails as if not installed
    rc, _, err = _main(capsys, *argv)
    line = _one_error_line(err)
    assert rc == 1
    assert f"`hybridkv {' '.join(a for a in argv if not a.startswith('-') and not a.isdigit())}` needs {module}" in line
    assert install_hint(extra) in line


def test_missing_matplotlib_stops_sim_pd_before_simulating(capsys, monkeypatch, tmp_path):
    import hybridkv.sims.pd.sweep

    def never(*_a, **_k):
        raise AssertionError("simulated although the plot could not be drawn")

    monkeypatch.setattr(hybridkv.sims.pd.sweep, "run_variant", never)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc, _, err = _main(capsys, "sim", "pd", "--recipe", "seed-6xdep2-1xdep8", "--plot", str(tmp_path / "p.png"))
    assert rc == 1 and install_hint("sims") in _one_error_line(err)


def test_every_named_extra_exists_in_pyproject():
    extras = PYPROJECT["project"]["optional-dependencies"]
    for module, extra in cli.OPTIONAL_MODULES.items():
        assert extra in extras, (module, extra)
        dist = {"yaml": "pyyaml"}.get(module, module)
        if module in ("torch", "triton", "matplotlib", "vllm", "sglang", "rich", "yaml"):  # names the dist
            assert any(re.split(r"[=<>!~\[; ]", req, maxsplit=1)[0].lower() == dist for req in extras[extra]), (
                module, extras[extra])


def test_missing_extra_only_for_optional_dependencies():
    assert missing_extra(ModuleNotFoundError("x", name="torch"), "demo") == (
        f"`hybridkv demo` needs torch, which is not installed; {install_hint('kernels')}")
    # A submodule missing from an installed package is not fixed by installing the extra.
    assert missing_extra(ModuleNotFoundError("x", name="torch.nope"), "demo") is None
    assert missing_extra(ModuleNotFoundError("x", name="hybridkv.nope"), "demo") is None
    own = MissingExtra("NIXL", "transport", detail="tried: nixl._api")
    assert str(own) == f"NIXL is not installed; {install_hint('transport')}\ntried: nixl._api"
    assert missing_extra(own, "bench transfer") == f"`hybridkv bench transfer`: {own}"
    # hybridkv's own ImportErrors that carry the hint without the class count too.
    worded = ImportError(f"ucxx is not installed; {install_hint('transport')}")
    assert missing_extra(worded, "demo") == f"`hybridkv demo`: {worded}"
    wrapped = ImportError("outer")
    wrapped.__cause__ = ModuleNotFoundError("x", name="matplotlib")
    assert install_hint("sims") in missing_extra(wrapped, "sim pd")


# ----------------------------------------------------------------------------- what main() does with errors


@pytest.fixture
def demo_handler(monkeypatch):
    """Make `hybridkv demo` run the given function instead (register reads `run` when it is called)."""
    import hybridkv.connectors.reference.demo_cli as demo_cli

    def use(fn):
        monkeypatch.setattr(demo_cli, "run", fn)

    return use


def test_value_error_is_one_line_exit_2(capsys, demo_handler):
    demo_handler(lambda _a: (_ for _ in ()).throw(ValueError("--thing 3; expected 4")))
    rc, _, err = _main(capsys, "demo")
    assert rc == 2 and _one_error_line(err) == "hybridkv: error: --thing 3; expected 4"


def test_command_error_prints_its_details_under_the_error_line(capsys, demo_handler):
    def fail(_a):
        raise CommandError("demo timed out after 5.0 s\nprefill: {...}\ndecode: {...}")

    demo_handler(fail)
    rc, _, err = _main(capsys, "demo")
    assert rc == 1 and TRACEBACK not in err
    assert err.splitlines() == ["hybridkv: error: demo timed out after 5.0 s", "  prefill: {...}", "  decode: {...}"]


def test_a_bug_keeps_its_traceback(capsys, demo_handler):
    def bug(_a):
        raise KeyError("a bug")

    demo_handler(bug)
    with pytest.raises(KeyError):
        main(["demo"])
    bad_import = ModuleNotFoundError("No module named 'hybridkv.gone'", name="hybridkv.gone")
    demo_handler(lambda _a: (_ for _ in ()).throw(bad_import))
    with pytest.raises(ModuleNotFoundError):
        main(["demo"])


def test_interrupt_is_one_line_exit_130(capsys, demo_handler):
    demo_handler(lambda _a: (_ for _ in ()).throw(KeyboardInterrupt()))
    rc, _, err = _main(capsys, "demo")
    assert rc == 130 and err.strip() == "hybridkv: interrupted"


def _fake_entry_points(monkeypatch, tmp_path, **modules: str):
    """Only the given commands, each backed by a module written to tmp_path."""
    eps = []
    for i, (command, source) in enumerate(modules.items()):
        name = f"_hkv_cli_test_{i}"
        (tmp_path / f"{name}.py").write_text(source)
        eps.append(EntryPoint(name=command.replace("_", "."), value=f"{name}:register", group=cli.ENTRY_POINT_GROUP))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "entry_points", lambda group: eps)


def test_a_command_whose_extra_is_missing_is_listed_and_says_what_to_install(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    _fake_entry_points(monkeypatch, tmp_path, fancy_plot="import matplotlib\ndef register(p): pass\n",
                       broken="import hybridkv.not_a_module\ndef register(p): pass\n")
    with pytest.raises(SystemExit):
        main(["fancy", "-h"])
    assert "(unavailable" in capsys.readouterr().out
    rc, _, err = _main(capsys, "fancy", "plot")
    assert rc == 1 and "`hybridkv fancy plot` needs matplotlib" in _one_error_line(err)
    # hybridkv's own module failing to import is a bug: its traceback is kept.
    with pytest.raises(ModuleNotFoundError):
        main(["broken"])


# ----------------------------------------------------------------------------- demo --timeout


def test_demo_timeout_covers_the_aggregated_baseline():
    pytest.importorskip("torch")
    # 32 requests take the aggregated baseline ~10 s: 1 s must stop it, before any worker starts.
    proc = _cli("demo", "--requests", "32", "--timeout", "1", timeout=180)
    assert proc.returncode == 1, proc.stderr
    assert TRACEBACK not in proc.stderr
    first, *details = proc.stderr.strip().splitlines()
    assert first.startswith("hybridkv: error: the aggregated baseline timed out after 1.0 s"), proc.stderr
    assert details and details[0].startswith("  aggregated: {")


def test_demo_timeout_dump_prints_without_a_traceback(capsys, monkeypatch):
    import hybridkv.connectors.reference.demo as demo

    def stuck(_o):
        raise TimeoutError("demo timed out after 5.0 s with 3/8 requests done; what each worker holds:\n"
                           'prefill: {"op": "dump"}\ndecode: process exited with -9')

    monkeypatch.setattr(demo, "run_demo", stuck)
    rc, _, err = _main(capsys, "demo", "--timeout", "5")
    assert rc == 1 and TRACEBACK not in err
    assert err.splitlines() == ["hybridkv: error: demo timed out after 5.0 s with 3/8 requests done; what each "
                                "worker holds:", '  prefill: {"op": "dump"}', "  decode: process exited with -9"]


_STUCK_DEMO = """
import sys
import hybridkv.connectors.reference.demo as demo
from hybridkv.cli import main

# No baseline: all of --timeout goes to the disaggregated run, which 500 requests cannot finish in it.
demo.run_aggregated = lambda o, requests, figures=None: {}
sys.exit(main(["demo", "--requests", "500", "--timeout", "20"]))
"""


@pytest.mark.slow
def test_demo_timeout_in_the_disaggregated_run_is_an_error_line_and_details():
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, "-c", _STUCK_DEMO], capture_output=True, text=True, timeout=240,
                          cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert TRACEBACK not in proc.stderr
    lines = proc.stderr.splitlines()
    [at] = [i for i, line in enumerate(lines) if line.startswith("hybridkv: error: ")]
    if "--timeout covers the whole run" in lines[at]:  # a loaded machine: the workers did not even start in time
        return
    assert lines[at].startswith("hybridkv: error: demo timed out after 20.0 s with "), lines[at]
    assert lines[at].endswith("requests done; what each worker holds:")
    assert [line.split(":")[0] for line in lines[at + 1:]] == ["  prefill", "  decode"]


class _DeadProc:
    pid, exitcode = 0, -9

    def is_alive(self):
        return False


class _VanishingProc:
    """Alive when asked, gone when signalled: the race the dump must survive."""

    # Above Linux's PID_MAX_LIMIT (2**22): never a real process, so os.kill raises ProcessLookupError.
    pid, exitcode = 2**22 + 12345, None

    def is_alive(self):
        return True


class _W:
    def __init__(self, proc):
        self.proc = proc


def test_the_stuck_run_dump_survives_dead_and_vanishing_workers():
    from hybridkv.connectors.reference.demo import _diagnose

    text = _diagnose((("prefill", _W(_DeadProc())), ("decode", _W(_VanishingProc()))))
    assert text.splitlines() == ["prefill: process exited with -9",
                                 "decode: gone while asked for a dump (ProcessLookupError: [Errno 3] No such process)"]


# ----------------------------------------------------------------------------- what the package ships


def test_license_and_py_typed_are_shipped():
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "Copyright 2026 the hybridkv authors" in text
    for folder in ("hybridkv", "descriptors", "connectors", "sims", "benchmarks"):
        assert (ROOT / folder / "py.typed").is_file(), folder
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["*"]


def test_scripts_parse():
    for script in sorted((ROOT / "scripts").glob("*.sh")):
        subprocess.run(["bash", "-n", str(script)], check=True)
