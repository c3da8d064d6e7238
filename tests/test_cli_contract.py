"""The CLI contract, command by command (hybridkv/cli.py's docstring):

- --json: stdout is exactly one JSON document; whatever else writes to stdout (NIXL, UCX, child
  processes, a stray print) lands on stderr;
- every error is one `hybridkv: error:` line on stderr; 2 for bad input (argparse's errors
  included, with no usage block), 1 for a run that could not finish (a missing optional
  dependency, no GPU); the same codes for every command;
- absurd sizes are refused at once, naming the bound;
- every option of every command has help that shows its default.

Runs in CI (2 cores, no GPU): no timing, no fixed ports.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import hybridkv.cli as cli
from hybridkv.cli import install_hint, main

ROOT = Path(__file__).resolve().parents[1]
TRACEBACK = "Traceback (most recent call last)"
# main() imported rather than `-m hybridkv.cli`: run as __main__, the module would be a second copy.
MAIN = "import sys\nfrom hybridkv.cli import main\n"


def _run(*argv: str, prelude: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    code = prelude + MAIN + "if __name__ == '__main__':\n    sys.exit(main(sys.argv[1:]))\n"
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def _one_error_line(err: str) -> str:
    assert TRACEBACK not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    # Details may follow, indented under the error line.
    assert lines and lines[0].startswith("hybridkv: error: ") and all(x.startswith("  ") for x in lines[1:]), err
    return lines[0]


def _one_document(out: str):
    """stdout holds exactly one JSON document (json.loads refuses anything before or after it)."""
    return json.loads(out)


def _installed(command: str) -> bool:
    parser = cli.build_parser()
    try:
        sub = _subparser(parser, command.split())
    except KeyError:
        return False
    handler = sub.get_default("handler")
    # A command whose module cannot be imported here is listed as unavailable (tests/test_cli.py).
    return handler is not None and not getattr(handler, "__qualname__", "").startswith("_unavailable")


def _subparser(parser: argparse.ArgumentParser, words: list[str]) -> argparse.ArgumentParser:
    for word in words:
        [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = action.choices[word]
    return parser


def _leaf_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every runnable command: its words -> its parser."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, words: tuple[str, ...]) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            found[" ".join(words)] = parser
            return
        for name, sub in subs[0].choices.items():
            walk(sub, (*words, name))

    walk(cli.build_parser(), ())
    return found


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# ----------------------------------------------------------------------------- --json: one document


def _small_recipe(tmp_path: Path) -> Path:
    from hybridkv.sims.pd.recipe import RECIPE_DIR

    data = yaml.safe_load((RECIPE_DIR / "seed-4xdep2-1xdep8.yaml").read_text())
    data["workload"]["osl"] = 64
    data["sweep"]["warmup_requests"] = 32
    data["sweep"]["measure_requests"] = 48
    data["sources"]["sweep.warmup_requests"] = "assumed: short window for a test"
    data["sources"]["sweep.measure_requests"] = "assumed: short window for a test"
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _json_runs(tmp_path: Path) -> dict[str, tuple[str, ...]]:
    """A short real run of every command that has --json."""
    return {
        "analyze": ("analyze", "--model", "qwen3.5-0.8b", "--json"),
        "sim race": ("sim", "race", "--requests", "20", "--json"),
        "sim pd": ("sim", "pd", "--recipe", str(_small_recipe(tmp_path)), "--concurrency", "64", "--seeds", "1",
                   "--json"),
        "bench plan": ("bench", "plan", "--runs", "10", "--baseline-runs", "2", "--json"),
        "bench fence": ("bench", "fence", "--steps", "20", "--json"),
        # NIXL writes its INFO lines on stdout, in this process and in the ones it starts.
        "bench transfer": ("bench", "transfer", "--layers", "4", "--tokens", "1024", "--iters", "1", "--json"),
        "bench staging": ("bench", "staging", "--tokens", "1024", "--tp", "2:1", "--iters", "1", "--json"),
        "demo": ("demo", "--requests", "2", "--json"),
        "bench gdn": ("bench", "gdn", "--only", "decode", "--iters", "2", "--no-fla", "--no-qla", "--no-fi", "--json"),
        "bench vllm-steps": ("bench", "vllm-steps", "--requests", "20", "--block-tokens", "16", "--prompt", "64",
                             "--steps", "2", "--json"),
    }


def _json_commands() -> list[str]:
    return sorted(name for name, p in _leaf_parsers().items()
                  if any("--json" in a.option_strings for a in p._actions) and _installed(name))


def test_every_command_with_json_has_a_run_here(tmp_path):
    # A new command with --json must join the purity test below.
    assert set(_json_commands()) <= set(_json_runs(tmp_path)), set(_json_commands()) - set(_json_runs(tmp_path))


@pytest.mark.parametrize("command", _json_commands())
def test_json_stdout_is_exactly_one_document(tmp_path, command):
    if command == "demo":
        pytest.importorskip("torch")
    if command in ("demo", "bench transfer"):
        if not any(_importable(m) for m in ("nixl", "nixl_cu12", "nixl_cu13")):
            pytest.skip("NIXL is not installed")
    if command == "bench vllm-steps" and not _importable("vllm"):
        pytest.skip("vLLM is not installed (the vllm extra; its own environment runs it)")
    if command == "bench gdn" and not _has_cuda():
        pytest.skip("bench gdn needs a CUDA device")
    proc = _run(*_json_runs(tmp_path)[command])
    assert proc.returncode == 0, proc.stderr[-3000:]
    _one_document(proc.stdout)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


_NOISY = """
import os, subprocess
import hybridkv.descriptors.analyze_cli as analyze
from hybridkv.cli import print_json

def noisy(args):
    os.write(1, b"native log line\\n")                                     # C-level, like NIXL and UCX
    subprocess.run([sys.executable, "-c", "print('child process log')"])  # inherits descriptor 1
    print("a stray print")
    print_json({"ok": True})
    return 0

analyze.run = noisy
"""


def test_json_run_sends_native_child_and_stray_output_to_stderr():
    proc = _run("analyze", "--json", prelude="import sys\n" + _NOISY)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == '{"ok": true}\n'
    for line in ("native log line", "child process log", "a stray print"):
        assert line in proc.stderr


def test_a_second_document_or_none_is_a_bug(monkeypatch):
    import hybridkv.descriptors.analyze_cli as analyze

    def twice(_args):
        cli.print_json({})
        cli.print_json({})

    monkeypatch.setattr(analyze, "run", twice)
    with pytest.raises(RuntimeError, match="second JSON document"):
        main(["analyze", "--json"])
    monkeypatch.setattr(analyze, "run", lambda _a: 0)
    with pytest.raises(RuntimeError, match="without a JSON document"):
        main(["analyze", "--json"])


def test_a_failed_json_run_leaves_stdout_empty(capsys, monkeypatch):
    import hybridkv.descriptors.analyze_cli as analyze

    def late_error(_args):
        cli.print_json({"partial": True})
        raise ValueError("--thing 3; expected 4")

    monkeypatch.setattr(analyze, "run", late_error)
    assert main(["analyze", "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and _one_error_line(err) == "hybridkv: error: --thing 3; expected 4"


# ----------------------------------------------------------------------------- one error line, one exit-code rule


@pytest.mark.parametrize("argv,needle", [
    (("analyze", "--tokens", "x"), "argument --tokens: invalid int value: 'x'"),
    (("analyze", "--nope"), "unrecognized arguments: --nope"),
    (("sim", "race", "--policy", "maybe"), "argument --policy: invalid choice: 'maybe'"),
    (("sim", "pd"), "the following arguments are required: --recipe"),
    (("bench",), "the following arguments are required: COMMAND"),
    (("nope",), "argument COMMAND: invalid choice: 'nope'"),
    (("demo", "--requests"), "argument --requests: expected one argument"),
])
def test_argparse_errors_are_one_line_exit_2_pointing_to_help(capsys, argv, needle):
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    assert exit_.value.code == cli.EXIT_USAGE
    out, err = capsys.readouterr()
    line = _one_error_line(err)
    assert out == "" and needle in line and "usage:" not in err
    assert "(see `hybridkv" in line and line.endswith(" -h`)"), line


@pytest.mark.parametrize("argv,needle", [
    (("analyze", "--tokens", "0"), "tokens must be a positive int, got 0"),
    (("analyze", "--model", "nope"), "unknown model 'nope'"),
    (("demo", "--devices", "0"), "--devices '0'; expected two CUDA device indices"),
    (("sim", "pd", "--recipe", "/nonexistent.yaml"), "is not a file"),
    (("bench", "transfer", "--layers", "3"), "--layers 3; expected a positive multiple of 4"),
    (("bench", "staging", "--tp", "3:2"), "--tp '3:2': expected two different positive TP sizes"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, needle):
    assert main(list(argv)) == cli.EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == "" and needle in _one_error_line(err)


def test_exit_codes_are_documented_in_the_docstring_and_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["-h"])
    help_text = capsys.readouterr().out
    assert cli.EXIT_HELP in help_text  # as written, not re-wrapped
    for code, status in (("1", cli.EXIT_FAILED), ("2", cli.EXIT_USAGE), ("130", cli.EXIT_INTERRUPTED)):
        assert str(status) == code
        assert re.search(rf"^  {code} +\S", cli.EXIT_HELP, re.M)
        assert f"{code} " in cli.__doc__


# ----------------------------------------------------------------------------- missing optional dependencies

_BLOCK = """import sys
class _Block:
    # As if these were not installed: any import of them fails like a missing module.
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name.split('.')[0])
sys.meta_path.insert(0, _Block())
"""


@pytest.mark.parametrize("argv,blocked,extra", [
    (("analyze", "--model", "qwen3.5-0.8b"), ("rich",), "cli"),  # the table needs rich
    (("sim", "race", "--requests", "5"), ("rich",), "sims"),  # the sims extra has rich too
    (("sim", "pd", "--recipe", "seed-4xdep2-1xdep8", "--json"), ("yaml",), "sims"),
    (("demo", "--requests", "1"), ("torch",), "kernels"),
    (("bench", "transfer", "--layers", "4", "--tokens", "64", "--iters", "1"), ("nixl", "nixl_cu12", "nixl_cu13"),
     "transport"),
])
def test_a_missing_optional_module_is_one_line_exit_1_naming_its_extra(argv, blocked, extra):
    proc = _run(*argv, prelude=_BLOCK.format(blocked=blocked))
    assert proc.returncode == cli.EXIT_FAILED, proc.stderr[-3000:]
    line = _one_error_line(proc.stderr)
    assert f"`hybridkv {' '.join(a for a in argv[:2] if not a.startswith('-'))}" in line
    assert install_hint(extra) in line
    assert proc.stdout == ""


def test_rich_and_yaml_map_to_the_cli_and_sims_extras():
    assert cli.OPTIONAL_MODULES["rich"] == "cli" and cli.OPTIONAL_MODULES["yaml"] == "sims"


def test_a_sim_command_is_pointed_at_the_sims_extra_which_has_rich():
    import tomllib

    rich = ModuleNotFoundError("x", name="rich")
    assert install_hint("cli") in cli.missing_extra(rich, "analyze")
    assert install_hint("sims") in cli.missing_extra(rich, "sim pd")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for group, (extra, modules) in cli.COMMAND_EXTRAS.items():
        named = {req.split(">")[0].split("=")[0].lower() for req in extras[extra]}
        assert {{"yaml": "pyyaml"}.get(m, m) for m in modules} <= named, (group, extras[extra])


def test_a_peer_or_transfer_failure_is_one_line_exit_1(capsys, monkeypatch):
    import hybridkv.descriptors.analyze_cli as analyze
    from hybridkv.errors import PeerLost

    def lost(_args):
        raise PeerLost("the producer's connection dropped")

    monkeypatch.setattr(analyze, "run", lost)
    assert main(["analyze"]) == cli.EXIT_FAILED
    assert _one_error_line(capsys.readouterr().err) == "hybridkv: error: PeerLost: the producer's connection dropped"


def test_install_hints_say_how_to_install_from_a_checkout_or_a_wheel():
    hint = install_hint("transport")
    assert hint == ("install hybridkv's \"transport\" extra: pip install -e '.[transport]' in a checkout, "
                    "or pip install '<wheel>[transport]'")


def test_every_install_hint_in_the_code_uses_the_one_format():
    # `pip install 'hybridkv[...]'` names a distribution the public index does not have.
    stale = []
    for folder in ("hybridkv", "descriptors", "connectors", "sims", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"pip install ['\"]?hybridkv\[", line):
                    stale.append(f"{path.relative_to(ROOT)}:{n}")
    assert not stale, stale


# ----------------------------------------------------------------------------- no GPU


@pytest.mark.skipif(_has_cuda(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("argv", [("demo", "--device", "cuda", "--requests", "1"), ("bench", "transfer", "--mem", "vram")])
def test_no_gpu_is_one_line_and_the_same_exit_code_everywhere(capsys, argv):
    pytest.importorskip("torch")
    assert main(list(argv)) == cli.EXIT_FAILED
    out, err = capsys.readouterr()
    assert out == "" and "torch sees no CUDA device" in _one_error_line(err)


# ----------------------------------------------------------------------------- bounds


@pytest.mark.parametrize("argv,bound", [
    (("analyze", "--tokens", "100000000000"), "at most 16,777,216"),
    (("analyze", "--tp-decode", "100000"), "at most 72"),
    (("analyze", "--link-gbps", "1e300"), "at most 100,000"),
    (("analyze", "--link-gbps", "nan"), "at most 100,000"),
    (("demo", "--requests", "1000000"), "at most 4,096"),
    (("demo", "--max-prompt", "100000000"), "at most 4,096"),
    (("demo", "--timeout", "1e12"), "at most 86,400"),
    (("sim", "race", "--requests", "1000000000"), "at most 1,000,000"),
    (("sim", "pd", "--recipe", "x", "--concurrency", "1000000000"), "at most 100,000"),
    (("sim", "pd", "--recipe", "x", "--seeds", "100000"), "at most 100"),
    (("bench", "plan", "--runs", "1000000000"), "at most 1,000,000"),
    (("bench", "fence", "--steps", "1000000000"), "at most 1,000,000"),
    (("bench", "transfer", "--tokens", "100000000"), "at most 262,144"),
    (("bench", "transfer", "--iters", "100000000"), "at most 1,000"),
])
def test_absurd_sizes_are_refused_at_once_naming_the_bound(capsys, argv, bound):
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    assert exit_.value.code == cli.EXIT_USAGE
    assert f"is outside the bound {bound}" in _one_error_line(capsys.readouterr().err)


def _edit(data: dict, dotted: str, value) -> None:
    *path, key = dotted.split(".")
    for part in path:
        data = data[part]
    data[key] = value


@pytest.mark.parametrize("field,value,message", [
    ("prefill.endpoints", 1_000_000, "prefill.endpoints=1000000: above the bound 1,024"),
    ("decode.endpoints", 1_000_000, "decode.endpoints=1000000: above the bound 1,024"),
    ("decode.ranks", 1_000_000, "decode.ranks=1000000: above the bound 1,024"),
    ("prefill.max_batched_tokens", 10**12, "above the bound 16,777,216"),
    ("workload.isl", 10**12, "workload.isl=1000000000000: above the bound 16,777,216"),
    ("sweep.seeds", 10**6, "sweep.seeds=1000000: above the bound 100"),
    ("sweep.measure_requests", 10**12, "sweep.measure_requests=1000000000000: above the bound 1,000,000"),
    ("sweep.concurrency", [10**9], "sweep.concurrency has 1000000000: above the bound 100,000 users"),
    ("sweep.concurrency", list(range(1, 1002)), "sweep.concurrency has 1001 points: above the bound 100"),
])
def test_a_recipe_of_absurd_size_is_refused_before_simulating(capsys, monkeypatch, tmp_path, field, value, message):
    import hybridkv.sims.pd.sweep as sweep

    def never(*_a, **_k):
        raise AssertionError("simulated a recipe that should have been refused")

    monkeypatch.setattr(sweep, "run_variant", never)
    path = _small_recipe(tmp_path)
    data = yaml.safe_load(path.read_text())
    _edit(data, field, value)
    path.write_text(yaml.safe_dump(data))
    assert main(["sim", "pd", "--recipe", str(path), "--json"]) == cli.EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == "" and message in _one_error_line(err)


# ----------------------------------------------------------------------------- help


def _options():
    for command, parser in sorted(_leaf_parsers().items()):
        if not _installed(command):
            continue
        for action in parser._actions:
            if action.option_strings and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                yield pytest.param(parser, action, id=f"{command} {action.option_strings[-1]}")


@pytest.mark.parametrize("parser,action", list(_options()))
def test_every_option_has_help_that_shows_its_default(parser, action):
    assert (action.help or "").strip(), "no help text"
    shown = " ".join(parser._get_formatter()._expand_help(action).split())
    if action.nargs == 0:  # a flag: off unless given
        return
    if action.required:
        assert "required" in shown, shown
        return
    assert "default" in shown.lower(), shown
    assert "default: None" not in shown and "default: []" not in shown, shown  # says nothing a reader can use
    if isinstance(action.type, cli.bounded):
        assert action.type.describe() in shown, shown


def test_the_summary_of_a_wrapped_first_sentence_is_whole():
    import types

    mod = types.ModuleType("_hkv_wrapped")
    mod.__doc__ = ("`hybridkv bench x`: hybridkv's kernels side by side with FLA, FlashQLA and FlashInfer, in one\n"
                   "run.\n\nMore.")

    def register(_p):
        pass

    register.__module__ = mod.__name__
    sys.modules[mod.__name__] = mod
    try:
        assert cli.command_summary(register) == (
            "hybridkv's kernels side by side with FLA, FlashQLA and FlashInfer, in one run")
    finally:
        del sys.modules[mod.__name__]



def test_what_native_code_prints_at_exit_stays_off_a_json_stdout():
    """ucxx's worker can warn from its destructor while the interpreter exits, after the document went out (seen
    once in CI under `bench transfer --json`). A write to fd 1 at exit (atexit: after threading's exit hooks, as the
    destructors are) stands in for it, named so: the JSON stdout still holds the document alone."""
    late = "import atexit, os\natexit.register(lambda: os.write(1, b'UCXX WARN late native write (fake)\\n'))\n"
    proc = _run("analyze", "--model", "qwen3.5-0.8b", "--json", prelude=late)
    assert proc.returncode == 0, proc.stderr[-2000:]
    _one_document(proc.stdout)
    assert "late native write (fake)" in proc.stderr
