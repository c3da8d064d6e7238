"""`hybridkv bench` subcommands, one module (or package) each: plan, fence, transfer, gdn.

Each prints side-by-side ratios against a baseline measured in the same run; current results, with
the command that regenerates each table, are in docs/benchmarks/README.md."""

# The repository folder is importable by its bare name from a checkout; a second copy of every class
# under that name would break isinstance checks, so only the installed name is accepted.
if __name__ != "hybridkv.benchmarks":
    raise ImportError(f"import hybridkv.benchmarks, not {__name__}: the benchmarks/ folder installs as "
                      "hybridkv.benchmarks")
