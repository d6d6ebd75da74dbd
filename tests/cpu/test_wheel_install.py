"""`pip install outrider` as a new user does it: a wheel built from this checkout, installed in
a fresh virtual environment beside `proto-plus` (which `ray[serve]` and every Google Cloud
client bring) and Hugging Face's `kernels`, then `outrider serve --demo tiny` started outside
the checkout answers the official `openai` client.

The venv installs everything from the package index (pip's cache makes a rerun quick); torch
is pinned to the version running this test first, as `make install` does, so a CPU machine
gets the CPU build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from cli_testlib import running
from serve_testlib import free_port

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _run(*argv, cwd: Path | None = None) -> str:
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, cwd=cwd)
    assert result.returncode == 0, f"{' '.join(map(str, argv))} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_wheel_serves_beside_proto_plus_and_hf_kernels(tmp_path: Path, outrider_home: Path, tiny_family):
    dist = tmp_path / "dist"
    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", dist, REPO)
    (wheel,) = dist.glob("outrider-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    packages = {name for name in top_level if not name.endswith(".dist-info")}
    assert packages == {"outrider"}, f"the wheel installs more than the outrider package: {sorted(top_level)}"
    for shipped in (
        "outrider/proto/outrider.proto",
        "outrider/proto/outrider_pb2.pyi",
        "outrider/benchmarks/bench.py",
    ):
        assert shipped in names

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv)
    python, outrider = venv / "bin" / "python", venv / "bin" / "outrider"
    _run(python, "-m", "pip", "install", "--quiet", f"torch=={torch.__version__.split('+')[0]}")
    _run(python, "-m", "pip", "install", "--quiet", wheel, "proto-plus", "kernels")

    # The generic names belong to their owners; ours live under `outrider`.
    owners = json.loads(
        _run(
            python,
            "-c",
            "import importlib.metadata as m, json, proto, kernels, outrider.proto, outrider.kernels; "
            "d = m.packages_distributions(); print(json.dumps({n: d[n] for n in ('proto', 'kernels', 'outrider')}))",
            cwd=tmp_path,
        )
    )
    assert owners == {"proto": ["proto-plus"], "kernels": ["kernels"], "outrider": ["outrider"]}
    site = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    assert f"outrider.proto          {site}/outrider/proto" in _run(outrider, "check-install", cwd=tmp_path)
    assert "usage: outrider bench" in _run(outrider, "bench", "--help", cwd=tmp_path)
    # An installed `outrider bench` writes its reports where it runs, not into site-packages.
    results = _run(
        python, "-c", "from outrider.benchmarks.report import RESULTS_DIR; print(RESULTS_DIR)", cwd=tmp_path
    )
    assert Path(results.strip()) == tmp_path

    from openai import OpenAI

    port = free_port()
    env = {**os.environ, "OUTRIDER_HOME": str(outrider_home)}
    env.pop("PYTHONPATH", None)
    argv = [outrider, "serve", "--demo", "tiny", "--port", port, "--host", "127.0.0.1", "--num-cpus", "2"]
    with running(argv, "Outrider is ready", timeout_s=300, env=env, cwd=tmp_path):
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        completion = client.completions.create(
            model="outrider-demo-tiny", prompt="def fib(n):", max_tokens=8, temperature=0
        )
        assert completion.choices[0].text
        assert completion.usage.completion_tokens > 0
