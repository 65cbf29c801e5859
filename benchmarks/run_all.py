"""Run every benchmark script in this folder in turn (``make bench``).

Each ``benchmarks/*.py`` is a standalone script that prints its own medians and
ratios against a naive baseline measured in the same run. This runner only starts
them one after another (never in parallel: they time themselves on a shared
machine), shows which one is running, and exits non-zero if any of them failed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    wanted = set(argv)
    scripts = sorted(p for p in HERE.glob("*.py") if p.name != Path(__file__).name and not p.name.startswith("_"))
    if wanted:
        scripts = [p for p in scripts if p.stem in wanted or p.name in wanted]
    failed: list[str] = []
    for script in scripts:
        print(f"\n=== {script.name} ===", flush=True)
        t0 = time.monotonic()
        rc = subprocess.run([sys.executable, str(script)], cwd=HERE.parent).returncode
        print(f"=== {script.name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {time.monotonic() - t0:.1f} s", flush=True)
        if rc != 0:
            failed.append(script.name)
    print(f"\n{len(scripts) - len(failed)}/{len(scripts)} benchmarks ok" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
