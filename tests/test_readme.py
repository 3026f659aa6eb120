"""The README's "Using it" example runs exactly as written, in a fresh process, in < 4 GiB."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3


def readme_python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S)


def test_readme_has_one_python_example_using_numpy_and_a_namespace():
    blocks = readme_python_blocks()
    assert len(blocks) == 1, "the README's python example is what this test runs"
    code = blocks[0]
    assert "import numpy" in code and "np.uint16" in code  # the bfloat16 answer, shown
    assert '"namespace"' in code


def test_readme_example_runs_as_written_with_peak_rss_under_4_gib(tmp_path):
    code = readme_python_blocks()[0]
    # The example's store root is redirected by the environment (the variable beats the
    # config, as the operator guide says), so the code runs unchanged and leaves nothing behind.
    env = {**os.environ, "KVCORE_FILE_ROOT": str(tmp_path / "store")}
    env.pop("PYTHONPATH", None)  # only what an installed kvcore provides
    # a parent of its own, so RUSAGE_CHILDREN's peak is the example's alone
    (tmp_path / "example.py").write_text(code)
    parent = (
        "import resource, subprocess, sys\n"
        "child = subprocess.run([sys.executable, 'example.py'], capture_output=True, text=True)\n"
        "sys.stdout.write(child.stdout)\n"
        "sys.stderr.write(child.stderr)\n"
        "print('peak_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "sys.exit(child.returncode)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", parent],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "complete 15 0"  # written
    assert lines[1] == "15"  # queried
    assert lines[2] == "complete 15"  # restored, and the assert on the bytes passed
    peak = int(lines[-1].split()[1]) * 1024  # ru_maxrss is in KiB on Linux
    assert 0 < peak < 4 * GIB, f"peak RSS {peak / GIB:.2f} GiB"
    assert any((tmp_path / "store" / "qwen2-7b").iterdir())  # under <root>/<namespace>
