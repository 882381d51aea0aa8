"""benchmarks/device_wheels.sh: the wheels it downloads are the ones gpu_bench.sh installs on the GPU machine, for
the device's Python, not this machine's (pip itself is stood in for: the test reaches no index)."""

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_it_downloads_every_wheel_gpu_bench_installs_for_the_device_s_python(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    calls = tmp_path / "calls.txt"
    (fake / "python3").write_text(f'#!/bin/bash\necho "$*" >> {calls}\n')
    (fake / "python3").chmod(0o755)
    dest = tmp_path / "whl"
    subprocess.run(["bash", str(ROOT / "benchmarks" / "device_wheels.sh"), str(dest)], check=True,
                   capture_output=True, env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"})
    lines = calls.read_text().splitlines()
    assert dest.is_dir() and all(line.startswith("-m pip download ") and f"-d {dest}" in line for line in lines)
    binary = next(line for line in lines if "--only-binary=:all:" in line)
    assert "--python-version 3.12" in binary and "--platform manylinux2014_x86_64" in binary
    downloaded = {word for line in lines for word in line.split() if re.fullmatch(r"[a-z][a-z0-9-]+", word)}
    installed = {name.replace("_", "-") for name in
                 re.findall(r'"\$WHEELS"/([a-z0-9_]+)-\*\.whl', (ROOT / "benchmarks" / "gpu_bench.sh").read_text())}
    assert installed == {"soundfile", "soxr", "cffi", "pycparser", "orjson", "py-spy", "dashscope"}
    assert installed <= downloaded
