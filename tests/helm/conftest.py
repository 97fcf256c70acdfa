"""Session fixtures for tests/helm: the helm binary (fetched once if missing) and validators.

The machinery lives in helm_support.py, beside this file.
"""

from __future__ import annotations

import subprocess

import pytest

from helm_support import FETCH_HELM, SCHEMAS, TOOLS_BIN, Helm, Validators


@pytest.fixture(scope="session")
def helm() -> Helm:
    binary = TOOLS_BIN / "helm"
    if not binary.exists():
        proc = subprocess.run(["bash", str(FETCH_HELM)], capture_output=True, text=True,
                              timeout=600, check=False)
        assert proc.returncode == 0, f"scripts/fetch-helm.sh failed:\n{proc.stdout}\n{proc.stderr}"
    assert binary.exists(), f"{binary} missing after scripts/fetch-helm.sh"
    return Helm(binary)


@pytest.fixture(scope="session")
def validators() -> Validators:
    missing = [f for f in ("ray.io_rayservices.yaml", "ray.io_rayclusters.yaml",
                           "monitoring.coreos.com_podmonitor_v1.json") if not (SCHEMAS / f).exists()]
    assert not missing, f"schemas missing from {SCHEMAS}: {missing}"
    return Validators()
