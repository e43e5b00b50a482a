"""The hand-written stub of the extension (python/rsccl/_rsccl.pyi) matches the binary."""

import subprocess
import sys


def test_stub_matches_extension():
    out = subprocess.run([sys.executable, "-m", "mypy.stubtest", "rsccl._rsccl"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
