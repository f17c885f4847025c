"""The fleet's model registry on tiny GGUF files built here (the real header format, written by
the `gguf` package): content-addressed artifacts, immutable versions, refused files."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import numpy as np
import pytest

from model_distribution.registry.store import Registry, RegistryError, parse_semver


def make_gguf(path: Path, fill: float = 0.0, file_type: int = 3, arch: str = "llama") -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_file_type(file_type)
    w.add_tensor("t", np.full((4, 4), fill, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def reg(tmp_path):
    r = Registry(tmp_path / "fleet")
    yield r
    r.close()


def test_a_push_is_content_addressed_and_described_from_the_header(reg, tmp_path):
    f = make_gguf(tmp_path / "m.gguf")
    m, created = reg.push(f, "tiny", "1.0.0")
    assert created and m.ref == "tiny@1.0.0"
    assert m.sha256 == hashlib.sha256(f.read_bytes()).hexdigest() and m.size == f.stat().st_size
    assert (m.format, m.quantization, m.architecture, m.context_length) == ("gguf", "Q4_1", "llama", 256)
    assert reg.artifact_path(m.sha256).read_bytes() == f.read_bytes()
    assert reg.resolve("tiny@1.0.0") == m


def test_a_published_version_is_immutable_and_the_same_bytes_again_are_a_no_op(reg, tmp_path):
    a, b = make_gguf(tmp_path / "a.gguf", 0.0), make_gguf(tmp_path / "b.gguf", 1.0)
    first, _ = reg.push(a, "tiny", "1.0.0")
    again, created = reg.push(a, "tiny", "1.0.0")
    assert not created and again == first
    with pytest.raises(RegistryError, match="immutable"):
        reg.push(b, "tiny", "1.0.0")
    assert reg.resolve("tiny@1.0.0").sha256 == first.sha256
    second, created = reg.push(b, "tiny", "1.1.0")
    assert created and second.sha256 != first.sha256
    same_bytes_other_name, _ = reg.push(a, "other", "0.1.0")  # stored once
    assert same_bytes_other_name.sha256 == first.sha256
    assert len(list(reg.artifacts.iterdir())) == 2


@pytest.mark.parametrize("content, reason", [(b"hello, not a model\n" * 10, "GGUF magic"),
                                             (b"GGUF\x03\x00\x00\x00\xff", "not a valid GGUF"),
                                             (b"", "GGUF magic")])
def test_a_file_that_is_not_a_valid_model_is_refused_with_the_reason(reg, tmp_path, content, reason):
    f = tmp_path / "bad.gguf"
    f.write_bytes(content)
    with pytest.raises(RegistryError, match=reason):
        reg.push(f, "tiny", "1.0.0")
    assert reg.models() == [] and not list(reg.artifacts.iterdir())


@pytest.mark.parametrize("name, version, min_agent", [("Tiny", "1.0.0", None), ("a/b", "1.0.0", None),
                                                      ("", "1.0.0", None), ("tiny", "1.0", None),
                                                      ("tiny", "01.0.0", None), ("tiny", "v1.0.0", None),
                                                      ("tiny", "1.0.0", "latest")])
def test_bad_names_and_versions_are_refused(reg, tmp_path, name, version, min_agent):
    with pytest.raises(RegistryError):
        reg.push(make_gguf(tmp_path / "m.gguf"), name, version, min_agent_version=min_agent)


def test_the_calibrated_thresholds_travel_with_the_version(reg, tmp_path):
    cal = tmp_path / "edge.toml"
    cal.write_text('[cascade]\nmin_mean_logprob = -1.25\nhold_tokens = 8\n\n[server]\nport = 1\n')
    m, _ = reg.push(make_gguf(tmp_path / "m.gguf"), "tiny", "1.0.0", calibration=cal, min_agent_version="0.3.0")
    assert reg.resolve("tiny@1.0.0").calibration == {"min_mean_logprob": -1.25, "hold_tokens": 8}
    assert m.min_agent_version == "0.3.0"
    empty = tmp_path / "empty.toml"
    empty.write_text("[server]\nport = 1\n")
    with pytest.raises(RegistryError, match=r"no \[cascade\]"):
        reg.push(make_gguf(tmp_path / "m2.gguf", 2.0), "tiny", "1.0.1", calibration=empty)


def test_models_are_listed_by_name_newest_semver_first(reg, tmp_path):
    for i, v in enumerate(["1.9.0", "1.10.0", "1.10.0-rc.1", "0.1.0"]):
        reg.push(make_gguf(tmp_path / f"{i}.gguf", float(i)), "tiny", v)
    reg.push(make_gguf(tmp_path / "x.gguf", 9.0), "alpha", "2.0.0")
    assert [m.ref for m in reg.models()] == ["alpha@2.0.0", "tiny@1.10.0", "tiny@1.10.0-rc.1", "tiny@1.9.0",
                                             "tiny@0.1.0"]
    assert [m.version for m in reg.models("tiny")][0] == "1.10.0"


def test_semver_order():
    assert parse_semver("1.0.0-alpha") < parse_semver("1.0.0-alpha.1") < parse_semver("1.0.0-beta.2")
    assert parse_semver("1.0.0-beta.2") < parse_semver("1.0.0-beta.11") < parse_semver("1.0.0-rc.1")
    assert parse_semver("1.0.0-rc.1") < parse_semver("1.0.0") < parse_semver("1.0.1")


def test_resolve_names_what_is_wrong(reg):
    with pytest.raises(RegistryError, match="not name@version"):
        reg.resolve("tiny")
    with pytest.raises(RegistryError, match="not published"):
        reg.resolve("tiny@1.0.0")
