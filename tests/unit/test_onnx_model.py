"""ONNX exports as the fleet sees them (model_distribution/artifacts/onnx_model.py): what describe_onnx_dir
reads from genai_config.json and cascade_model.json, the reasons it refuses a directory, the one
deterministic tar an export travels as, and an unpack that never writes outside its directory.
The directories are built here in the builder's layout (its genai_config.json schema, a graph
file with or without MatMulNBits); the real export is served in tests/integration/test_onnx_agent.py."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from model_distribution.artifacts.onnx_model import (
    OnnxModelError,
    describe_onnx_dir,
    describe_onnx_tar,
    pack_onnx_dir,
    unpack_onnx_tar,
)
from model_distribution.registry.store import Registry, RegistryError


def make_export(root: Path, graph: bytes = b"\x08\x07 ... MatMulNBits ...", provider_options=(), ours=None) -> Path:
    """A directory laid out as onnxruntime-genai's builder writes it."""
    root.mkdir(parents=True)
    config = {"model": {"bos_token_id": 1, "context_length": 8192, "type": "llama", "vocab_size": 49152,
                        "decoder": {"filename": "model.onnx", "num_hidden_layers": 30,
                                    "session_options": {"provider_options": list(provider_options)}}},
              "search": {"max_length": 8192}}
    (root / "genai_config.json").write_text(json.dumps(config, indent=4))
    (root / "model.onnx").write_bytes(graph)
    (root / "model.onnx.data").write_bytes(os.urandom(4096))
    (root / "tokenizer.json").write_text('{"version": "1.0"}')
    (root / "chat_template.jinja").write_text("{{ messages }}")
    if ours is not None:
        (root / "cascade_model.json").write_text(json.dumps(ours))
    return root


def test_an_export_is_described_from_its_genai_config(tmp_path):
    d = describe_onnx_dir(make_export(tmp_path / "smol-onnx"))
    assert d == {"format": "onnx", "quantization": "int4", "architecture": "llama", "context_length": 8192,
                 "vocab_size": 49152, "name": "smol-onnx", "target": "cpu"}


def test_cascade_model_json_names_the_precision_name_and_target_when_present(tmp_path):
    ours = {"format": "onnx", "name": "smollm2-135m", "precision": "fp16", "quantization": "fp16",
            "target": "cuda", "architecture": "llama", "context_length": 2048}
    d = describe_onnx_dir(make_export(tmp_path / "e", graph=b"plain graph", ours=ours))
    assert (d["quantization"], d["name"], d["target"], d["context_length"]) == ("fp16", "smollm2-135m", "cuda", 2048)


def test_without_our_manifest_a_graph_without_matmulnbits_is_unknown_and_the_target_comes_from_the_provider(tmp_path):
    d = describe_onnx_dir(make_export(tmp_path / "e", graph=b"plain graph", provider_options=[{"cuda": {}}]))
    assert (d["quantization"], d["target"]) == ("unknown", "cuda")


def _break(root: Path, how: str) -> Path:
    if how == "not a directory":
        (root / "model.gguf").write_bytes(b"GGUF")
        return root / "model.gguf"
    make_export(root / "e")
    if how == "no genai_config.json":
        (root / "e" / "genai_config.json").unlink()
    elif how == "not a valid genai config":
        (root / "e" / "genai_config.json").write_text("{not json")
    elif how == "no decoder":
        (root / "e" / "genai_config.json").write_text('{"model": {"type": "llama"}}')
    elif how == "lacks model.onnx":
        (root / "e" / "model.onnx").unlink()
    return root / "e"


@pytest.mark.parametrize("how, reason", [
    ("not a directory", "is not a directory"),
    ("no genai_config.json", "has no genai_config.json"),
    ("not a valid genai config", "is not a valid genai config"),
    ("no decoder", "is not a valid genai config"),
    ("lacks model.onnx", "lacks model.onnx, the model file its genai_config.json names"),
])
def test_a_directory_that_is_not_an_export_is_refused_with_one_line_saying_why(tmp_path, how, reason):
    with pytest.raises(OnnxModelError, match=reason) as e:
        describe_onnx_dir(_break(tmp_path, how))
    assert "\n" not in str(e.value)


def test_the_same_directory_packs_to_the_same_bytes_whatever_its_mtimes_or_creation_order(tmp_path):
    a = make_export(tmp_path / "a")
    first = pack_onnx_dir(a, tmp_path / "a.tar")
    for f in a.iterdir():
        os.utime(f, (1_000_000, 1_000_000))
    assert pack_onnx_dir(a, tmp_path / "again.tar") == first
    b = tmp_path / "b"  # the same files, written in the reverse order
    b.mkdir()
    for f in sorted(a.iterdir(), reverse=True):
        (b / f.name).write_bytes(f.read_bytes())
    assert pack_onnx_dir(b, tmp_path / "b.tar") == first
    digest, size = first
    assert digest == hashlib.sha256((tmp_path / "a.tar").read_bytes()).hexdigest()
    assert size == (tmp_path / "a.tar").stat().st_size
    with tarfile.open(tmp_path / "a.tar") as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == sorted(f.name for f in a.iterdir())
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in members} == {(0, 0, 0, "", "", 0o644)}
    (a / "tokenizer.json").write_text('{"version": "1.1"}')
    assert pack_onnx_dir(a, tmp_path / "changed.tar")[0] != digest


def test_an_export_with_a_link_in_it_is_not_packed(tmp_path):
    a = make_export(tmp_path / "a")
    (a / "extra.json").symlink_to("/etc/passwd")
    with pytest.raises(OnnxModelError, match="link"):
        pack_onnx_dir(a, tmp_path / "a.tar")


def test_a_packed_export_unpacks_to_the_same_files_and_describes_the_same(tmp_path):
    a = make_export(tmp_path / "a", ours={"name": "smollm2-135m", "quantization": "int4"})
    pack_onnx_dir(a, tmp_path / "a.tar")
    assert describe_onnx_tar(tmp_path / "a.tar") == describe_onnx_dir(a)
    out = unpack_onnx_tar(tmp_path / "a.tar", tmp_path / "models" / "x.d")
    assert {f.name: f.read_bytes() for f in out.iterdir()} == {f.name: f.read_bytes() for f in a.iterdir()}
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["x.d"]  # no temporary left beside it


def _tar_with(path: Path, *members: tarfile.TarInfo, export: Path | None = None) -> Path:
    with tarfile.open(path, "w") as tar:
        if export is not None:
            for f in sorted(export.iterdir()):
                tar.add(f, arcname=f.name)
        for m in members:
            tar.addfile(m, io.BytesIO(b"x" * m.size) if m.isfile() else None)
    return path


def _file(name: str) -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.size = 1
    return m


def _link(name: str, target: str, kind=tarfile.SYMTYPE) -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.linkname = kind, target
    return m


@pytest.mark.parametrize("member, reason", [
    (_file("../escaped"), "outside the model directory"),
    (_file("/tmp/absolute"), "outside the model directory"),
    (_file("sub/../../escaped"), "outside the model directory"),
    (_link("evil", "/etc/passwd"), "link"),
    (_link("hard", "genai_config.json", tarfile.LNKTYPE), "link"),
])
def test_an_artifact_that_would_write_outside_its_directory_is_refused_and_nothing_is_written(tmp_path, member,
                                                                                               reason):
    tar = _tar_with(tmp_path / "evil.tar", member, export=make_export(tmp_path / "src"))
    models = tmp_path / "deep" / "models"
    models.mkdir(parents=True)
    with pytest.raises(OnnxModelError, match=reason):
        unpack_onnx_tar(tar, models / "v.d")
    with pytest.raises(OnnxModelError, match=reason):
        describe_onnx_tar(tar)
    assert list(models.iterdir()) == [] and not (tmp_path / "deep" / "escaped").exists()


def test_a_tar_that_is_not_an_export_is_not_unpacked(tmp_path):
    tar = _tar_with(tmp_path / "t.tar", _file("readme.txt"))
    with pytest.raises(OnnxModelError, match="has no genai_config.json"):
        unpack_onnx_tar(tar, tmp_path / "v.d")
    assert not (tmp_path / "v.d").exists() and [p.name for p in tmp_path.iterdir()] == ["t.tar"]


def test_the_registry_publishes_an_export_directory_as_its_tar(tmp_path):
    reg = Registry(tmp_path / "fleet")
    try:
        a = make_export(tmp_path / "a", ours={"quantization": "int4", "architecture": "llama",
                                              "context_length": 8192})
        digest, size = pack_onnx_dir(a, tmp_path / "a.tar")
        m, created = reg.push(a, "smol-onnx", "1.0.0")
        assert created and (m.format, m.quantization, m.architecture, m.context_length) == ("onnx", "int4", "llama",
                                                                                            8192)
        assert (m.sha256, m.size) == (digest, size)
        assert reg.artifact_path(digest).read_bytes() == (tmp_path / "a.tar").read_bytes()
        assert reg.push(a, "smol-onnx", "1.0.0") == (m, False)  # the same directory again: a no-op
        assert reg.push(tmp_path / "a.tar", "smol-onnx", "1.0.0") == (m, False)  # its tar, as uploaded over HTTP
        assert [p.name for p in reg.artifacts.iterdir()] == [digest]  # no packing left behind
        with pytest.raises(RegistryError, match="has no genai_config.json"):
            reg.push(tmp_path, "not-onnx", "1.0.0")
        evil = _tar_with(tmp_path / "evil.tar", _file("../x"), export=a)
        with pytest.raises(RegistryError, match="outside the model directory"):
            reg.push(evil, "evil", "1.0.0")
    finally:
        reg.close()
