"""Run the Python code blocks of the docs, to check them against the real API.

    python docs/_ext/check_snippets.py          # every runnable block (embedded transport)
    python docs/_ext/check_snippets.py --ray    # also the blocks marked <!-- test: ray -->

A ```python block runs as a script of its own. A block right after an HTML comment
``<!-- test: skip -->`` (a fragment) is not run; ``<!-- test: ray -->`` marks blocks that
start Ray (run with ``--ray``; they start a local Ray on loopback). Exit status 1 when a
block fails.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tempfile

DOCS = pathlib.Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(?:<!-- test: (\w+) -->\n)?```python\n(.*?)```", re.S)
RAY_PRELUDE = ('import ray\nray.init(address="local", num_cpus=2, include_dashboard=False, '
               '_node_ip_address="127.0.0.1")\n')


def main() -> int:
    with_ray = "--ray" in sys.argv
    failed = 0
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        for md in sorted(DOCS.rglob("*.md")):
            for i, m in enumerate(BLOCK.finditer(md.read_text())):
                tag, code = m.group(1) or "run", m.group(2)
                if tag == "skip" or (tag == "ray" and not with_ray):
                    continue
                script = pathlib.Path(tmp) / f"{md.stem}_{i}.py"
                script.write_text((RAY_PRELUDE if tag == "ray" else "") + code)
                name = f"{md.relative_to(DOCS)} block {i}"
                try:
                    out = subprocess.run([sys.executable, str(script)], capture_output=True,
                                         text=True, timeout=300, cwd=tmp, env=env)
                    ok = out.returncode == 0
                    detail = out.stderr[-2000:]
                except subprocess.TimeoutExpired:
                    ok, detail = False, "timed out"
                print(("ok    " if ok else "FAIL  ") + name, flush=True)
                if not ok:
                    failed += 1
                    print(detail)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
