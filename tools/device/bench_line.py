"""One `hybridkv bench transfer --json` report (stdin) as two lines: hybridkv, plan, plan_cold and raw side by side."""
import json
import sys

try:
    r = json.load(sys.stdin)
except ValueError:
    sys.exit("  no report")
s = r["schemes"]
print("  " + "  ".join(f"{k} {s[k]['posted']}d post {s[k]['post_us']:.0f} cpu {s[k]['post_cpu_us']:.0f} landed "
                       f"{s[k]['landed_us']:.0f} x{s[k]['x_raw']:.3f}/p{s[k]['x_raw_paired']:.3f}"
                       for k in ("hybridkv", "plan", "plan_cold", "raw")))
print(f"  {r['bytes'] / 1e6:.1f} MB, median of {r['iters']}; fetch phases {r.get('fetch_phases_us')}")
