"""The Mamba kernel-path probe (``checks/logits._dispatchers``) with stand-in ``mamba_ssm`` / ``causal_conv1d``
packages written to tmp_path: it must find every dispatcher transformers bound to a kernel whether the dispatchers
are plain functions (no ``kernels`` package) or ``nn.Module`` objects (``kernels`` installed, as transformers 5.25
requires), and none bound without the packages. Each case runs in a fresh interpreter: transformers binds the
kernels when the modeling module is imported."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

STAND_INS = {
    "causal_conv1d/__init__.py": (
        "def causal_conv1d_fn(x, weight, bias=None, activation=None, **kwargs):\n"
        "    raise RuntimeError('stand-in kernel')\n"
        "def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, **kwargs):\n"
        "    raise RuntimeError('stand-in kernel')\n"),
    "mamba_ssm/__init__.py": "",
    "mamba_ssm/ops/__init__.py": "",
    "mamba_ssm/ops/triton/__init__.py": "",
    "mamba_ssm/ops/triton/ssd_combined.py": (
        "def mamba_chunk_scan_combined(*args, **kwargs):\n    raise RuntimeError('stand-in kernel')\n"
        "def mamba_split_conv1d_scan_combined(*args, **kwargs):\n    raise RuntimeError('stand-in kernel')\n"),
    "mamba_ssm/ops/triton/selective_state_update.py": (
        "def selective_state_update(*args, **kwargs):\n    raise RuntimeError('stand-in kernel')\n"),
    "mamba_ssm/ops/selective_scan_interface.py": (
        "def mamba_inner_fn(*args, **kwargs):\n    raise RuntimeError('stand-in kernel')\n"
        "def selective_scan_fn(*args, **kwargs):\n    raise RuntimeError('stand-in kernel')\n"),
}

PROBE = """
import importlib, json, sys
import torch
if sys.argv[2] == "without":
    sys.modules["kernels"] = None  # transformers then takes its path without the kernels package
if sys.argv[1]:
    sys.path.insert(0, sys.argv[1])
from transformers.utils import is_kernels_available
from kvconform.checks.logits import _dispatchers
out = {"kernels": bool(is_kernels_available())}
for name in ("mamba", "mamba2"):
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    found = _dispatchers(module)
    out[name] = {"kernels": sorted(k for k, (_, _, uses) in found.items() if uses), "all": sorted(found),
                 "modules": sorted(k for k, (obj, _, _) in found.items() if isinstance(obj, torch.nn.Module))}
print(json.dumps(out))
"""


def _probe(stand_ins: str, kernels: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", PROBE, stand_ins, kernels], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    root = tmp_path_factory.mktemp("kernels")
    for rel, text in STAND_INS.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return str(root)


MAMBA = ["causal_conv1d_fn", "causal_conv1d_update", "mamba_inner_fn", "mamba_selective_scan",
         "mamba_selective_state_update"]
MAMBA2 = ["causal_conv1d_fn", "causal_conv1d_update", "mamba2_chunk_scan", "mamba2_selective_state_update",
          "mamba2_split_conv1d_scan_combined"]


def test_the_probe_finds_the_kernels_wrapped_as_modules_by_the_kernels_package(stand_ins):
    pytest.importorskip("kernels")
    found = _probe(stand_ins, "with")
    assert found["kernels"], found
    assert found["mamba"]["kernels"] == MAMBA and found["mamba2"]["kernels"] == MAMBA2, found
    assert found["mamba2"]["modules"] == MAMBA2, found  # what it found were nn.Module dispatchers


def test_the_probe_finds_the_kernels_as_plain_functions_without_the_kernels_package(stand_ins):
    found = _probe(stand_ins, "without")
    assert not found["kernels"], found
    assert found["mamba"]["kernels"] == MAMBA and found["mamba2"]["kernels"] == MAMBA2, found
    assert found["mamba2"]["modules"] == [], found


def test_without_the_kernel_packages_it_finds_the_dispatchers_bound_to_no_kernel():
    found = _probe("", "with")
    assert found["mamba"]["all"] == MAMBA and found["mamba2"]["all"] == MAMBA2, found
    assert found["mamba"]["kernels"] == [] and found["mamba2"]["kernels"] == [], found
