"""`cascade models export --format onnx`: onnxruntime-genai's model builder on the engine's HF
directory, verified against our PyTorch engine. Real builds (int4 ~20 s, fp32 ~35 s here); the
fp32 export comes from the session's `onnx_export` fixture, shared with the ONNX backend's tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cloud_tier.onnx_export import (
    AGREEMENT_FLOOR,
    VERIFY_PROMPTS,
    VERIFY_TOKENS,
    ExportError,
    export_onnx,
    verify_export,
)
from tests.conftest import REPO

pytestmark = pytest.mark.slow


def cascade(*args, home: Path):
    return subprocess.run([sys.executable, "-m", "cascade_cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "CASCADE_HOME": str(home)})


def smollm2_hf_dir() -> Path:
    """The engine's HF directory for SmolLM2, converted in $CASCADE_HOME (engine_home sets it)."""
    from model_distribution.artifacts.model_dirs import resolve_model_dir

    return resolve_model_dir("smollm2-135m")


def test_cli_exports_int4_for_cpu_with_tokenizer_template_manifest_and_measured_agreement(engine_home, tmp_path):
    out = tmp_path / "smollm2-135m-onnx"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier export")  # --force replaces it
    r = cascade("models", "export", "smollm2-135m", "--format", "onnx", "--out", str(out), "--force",
                home=engine_home)
    assert r.returncode == 0, r.stderr
    assert str(out) in r.stdout and "verified on" in r.stdout
    names = {p.name for p in out.iterdir()}
    assert {"model.onnx", "model.onnx.data", "genai_config.json", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "cascade_model.json"} <= names and "stale.txt" not in names
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no temporary sibling left
    genai = json.loads((out / "genai_config.json").read_text())["model"]
    assert genai["type"] == "llama" and genai["decoder"]["filename"] == "model.onnx"
    m = json.loads((out / "cascade_model.json").read_text())
    assert (m["format"], m["precision"], m["quantization"], m["target"], m["name"]) == \
        ("onnx", "int4", "int4", "cpu", "smollm2-135m")
    assert m["architecture"] == "llama" and m["context_length"] == genai["context_length"]
    assert len(m["source"]["sha256"]) == 64 and m["source"]["path"].endswith(".gguf")
    v = m["verification"]
    assert (v["prompts"], v["tokens"], len(v["per_prompt"])) == (len(VERIFY_PROMPTS), VERIFY_TOKENS,
                                                                 len(VERIFY_PROMPTS))
    for p in v["per_prompt"]:
        first = VERIFY_TOKENS if p["first_divergence"] is None else p["first_divergence"]
        assert p["agreement"] == round(first / VERIFY_TOKENS, 3)
        assert 0 <= p["teacher_forced_agreement"] <= 1
    # int4's stated bound: the mean teacher-forced agreement stays at its floor or above
    assert v["floor"] == AGREEMENT_FLOOR["int4"] and v["within_floor"], v
    assert v["mean_teacher_forced_agreement"] >= AGREEMENT_FLOOR["int4"]


def test_fp32_export_greedy_tokens_equal_the_engines(onnx_export, engine_home):
    export = onnx_export("fp32")
    manifest = json.loads((export / "cascade_model.json").read_text())
    assert manifest["precision"] == "fp32" and manifest["verification"]["skipped"]  # the fixture's: unverified
    v = verify_export(export, smollm2_hf_dir(), "fp32", "cpu")
    assert v["exact"] and v["mean_agreement"] == 1.0
    assert all(p["first_divergence"] is None for p in v["per_prompt"])


def test_cuda_export_without_a_cuda_runtime_says_why_it_is_not_verified(onnx_export, engine_home):
    import onnxruntime_genai as og

    if og.is_cuda_available():
        pytest.skip("this onnxruntime-genai has CUDA: the export would be verified")
    v = verify_export(onnx_export("fp32"), smollm2_hf_dir(), "fp16", "cuda")
    assert v["skipped"] and "CUDA" in v["reason"]


@pytest.mark.parametrize("args, says", [
    (["smollm2-135m", "--format", "onnx", "--precision", "int8"], "--precision"),
    (["smollm2-135m", "--format", "gguf"], "--format"),
    (["smollm2-135m", "--format", "onnx", "--precision", "fp16", "--target", "cpu"], "fp16 for cpu"),
    (["no-such-model", "--format", "onnx"], "unknown model 'no-such-model'"),
    (["smollm2-135m", "--format", "onnx", "--target", "npu"], "--target"),
])
def test_export_refuses_bad_input_with_exit_2_and_one_line(tmp_path, args, says):
    out = tmp_path / "out"
    r = cascade("models", "export", *args, "--out", str(out), home=tmp_path)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()


def test_export_refuses_an_out_that_is_not_empty_and_leaves_it_alone(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = cascade("models", "export", "smollm2-135m", "--format", "onnx", "--out", str(out), home=tmp_path)
    assert r.returncode == 2 and "not empty" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"


def test_failed_build_leaves_no_half_written_directory(tmp_path):
    model = tmp_path / "not-a-real-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["NopeForCausalLM"], "model_type": "nope"}))
    parent = tmp_path / "exports"
    with pytest.raises(ExportError, match="model builder failed") as e:
        export_onnx(str(model), parent / "nope-onnx", precision="int4", verify=False)
    assert "\n" not in str(e.value)
    assert parent.is_dir() and list(parent.iterdir()) == []  # neither the export nor its temporary sibling
