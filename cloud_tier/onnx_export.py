"""Export a model to an ONNX directory for onnxruntime-genai devices, verified against our engine.

    export_onnx("smollm2-135m", Path("smollm2-135m-onnx"), precision="int4", target="cpu")

The weights come from the HF directory the engine itself loads (``ensure_hf_dir`` converts the
GGUF once), so the GGUF, the engine and the ONNX export hold one model. onnxruntime-genai's model
builder runs in a subprocess (it prints a progress line per tensor; its output goes to a log file)
into a temporary sibling of ``out``, which is renamed into place only once it is complete,
verified and carries ``cascade_model.json`` (written last): a reader never sees half an export.

Precisions: int4 for CPU (MatMulNBits with accuracy level 4: int8 activations, the fast CPU
kernel), fp16 for CUDA, fp32 as the reference. Verification decodes a few fixed chat prompts
greedily with onnxruntime-genai (a plain append_tokens / argmax(get_logits) loop, the way our
edge backend reads logits) and with our PyTorch engine in float32: the fp32 export must produce
the same tokens or it is not published; int4 and fp16 are quantized, so their agreement is
measured and stored instead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

PRECISIONS = ("int4", "fp16", "fp32")
TARGETS = ("cpu", "cuda")
DEFAULT_PRECISION = {"cpu": "int4", "cuda": "fp16"}
# What the builder supports of ours (its own list: FP32 CPU, FP32 CUDA, FP16 CUDA, INT4 CPU, INT4 CUDA ...)
SUPPORTED = {("int4", "cpu"), ("fp32", "cpu"), ("int4", "cuda"), ("fp16", "cuda"), ("fp32", "cuda")}
MANIFEST = "cascade_model.json"
MANIFEST_VERSION = 1
# Copied from the HF directory when the builder did not write them (the chat template only if the
# model has one).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

VERIFY_TOKENS = 24
# The least mean teacher-forced agreement a quantized export is stated to keep. Measured for SmolLM2
# int4 (accuracy level 4) on an AVX-512 CPU: 78% teacher-forced, 27% greedy (greedy runs part
# at the first near-tie, one prompt at token 1). fp16 is unmeasured here (no GPU), so no floor.
AGREEMENT_FLOOR = {"int4": 0.6}
VERIFY_PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in one sentence what a CPU does.",
    "List three primary colors.",
)


class ExportError(ValueError):
    """The export cannot be made as asked; the message is one line saying why."""


def export_onnx(model: str, out: Path, precision: str = "int4", target: str = "cpu", verify: bool = True,
                cache_home: Path | None = None, force: bool = False) -> dict:
    """Export ``model`` (a catalogue name, a .gguf path or an HF directory) to the directory
    ``out``; returns the manifest written there as ``cascade_model.json``.

    ``cache_home``: the $CASCADE_HOME whose catalogue and engine conversion cache to use (default:
    the current one). ``force``: replace an ``out`` that exists and is not empty. Raises
    ExportError before building anything for a bad request, and after building for a failed build
    or an fp32 export whose tokens differ from the engine's (nothing is published then).
    """
    from cascade.config import cascade_home

    out = Path(out).expanduser().resolve()
    check_request(out, precision, target, force)
    home = Path(cache_home) if cache_home is not None else cascade_home()
    hf_dir, source = resolve_source(model, home)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        built = work / "export"
        start = time.monotonic()
        run_builder(hf_dir, built, precision, target, work)
        build_s = time.monotonic() - start
        complete_files(built, hf_dir)
        genai = json.loads((built / "genai_config.json").read_text())["model"]
        verification = verify_export(built, hf_dir, precision, target) if verify else \
            {"skipped": True, "reason": "not asked (--no-verify)"}
        manifest = {
            "format": "onnx",
            "manifest_version": MANIFEST_VERSION,
            "name": source["name"],
            "precision": precision,
            "quantization": precision,
            "target": target,
            "architecture": genai.get("type", "unknown"),
            "context_length": genai.get("context_length"),
            "vocab_size": genai.get("vocab_size"),
            "source": {"path": source["path"], "sha256": source["sha256"]},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "builder": {"name": "onnxruntime_genai.models.builder", "version": builder_version(),
                        "seconds": round(build_s, 1)},
            "verification": verification,
        }
        (built / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _publish(built, out, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("exported %s (%s, %s) to %s", source["name"], precision, target, out)
    return manifest


def check_request(out: Path, precision: str, target: str, force: bool) -> None:
    """Refuse what cannot work before converting or building anything."""
    if precision not in PRECISIONS:
        raise ExportError(f"unknown precision {precision!r} (one of {', '.join(PRECISIONS)})")
    if target not in TARGETS:
        raise ExportError(f"unknown target {target!r} (one of {', '.join(TARGETS)})")
    if (precision, target) not in SUPPORTED:
        raise ExportError(f"the model builder cannot export {precision} for {target} "
                          f"(for cpu: int4 or fp32; for cuda: fp16, int4 or fp32)")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"{out} exists and is not empty (--force replaces it)")


def resolve_source(model: str, home: Path) -> tuple[Path, dict]:
    """(the HF directory, {name, path, sha256}) for ``model``; ExportError if it is not found."""
    from model_distribution.artifacts.catalog import Catalog, ModelNotFound
    from model_distribution.artifacts.gguf_convert import MARKER, ensure_hf_dir
    from model_distribution.registry.store import file_sha256

    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ExportError(f"{path} is a directory without config.json, not an HF model")
        weights = path / "model.safetensors"
        sha = file_sha256(weights)[0] if weights.is_file() else ""
        return path.resolve(), {"name": path.name, "path": str(path.resolve()), "sha256": sha}
    catalog = Catalog(home)
    try:
        info = catalog.get(model)
        gguf = catalog.ensure_ready(info)
    except ModelNotFound as e:
        raise ExportError(str(e)) from e
    hf_dir = ensure_hf_dir(gguf, home / "engine" / "models")
    sha = json.loads((hf_dir / MARKER).read_text())["sha256"]  # the GGUF's, hashed by the conversion
    return hf_dir, {"name": info.name, "path": str(Path(gguf).resolve()), "sha256": sha}


def run_builder(hf_dir: Path, built: Path, precision: str, target: str, work: Path) -> None:
    """onnxruntime-genai's model builder in a subprocess, its output in ``work/builder.log``."""
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(built),
           "-p", precision, "-e", target, "-c", str(work / "cache")]
    if precision == "int4" and target == "cpu":
        cmd += ["--extra_options", "accuracy_level=4"]
    log_path = work / "builder.log"
    log.info("building: %s", " ".join(cmd))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # a local directory only
    with open(log_path, "wb") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=work).returncode
    if rc != 0 or not (built / "genai_config.json").is_file() or not (built / "model.onnx").is_file():
        raise ExportError(f"the model builder failed (exit {rc}): {_last_line(log_path)}")


def _last_line(path: Path) -> str:
    """The last meaningful line of a builder log (tqdm redraws lines with carriage returns)."""
    lines = [ln.strip() for ln in path.read_text(errors="replace").replace("\r", "\n").splitlines()]
    return next((ln for ln in reversed(lines) if ln), "no output")[:300]


def complete_files(built: Path, hf_dir: Path) -> None:
    """Copy the tokenizer and chat template from the HF directory where the builder omitted them."""
    for name in TOKENIZER_FILES:
        if not (built / name).is_file() and (hf_dir / name).is_file():
            shutil.copy2(hf_dir / name, built / name)
    missing = [n for n in ("tokenizer.json", "tokenizer_config.json") if not (built / n).is_file()]
    if missing:
        raise ExportError(f"the export has no {', '.join(missing)} and {hf_dir} has none to copy")


def builder_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("onnxruntime-genai", "onnxruntime-genai-cuda"):
        with contextlib.suppress(PackageNotFoundError):
            return version(dist)
    return "unknown"


def _publish(built: Path, out: Path, work: Path) -> None:
    """Rename the finished export to ``out``; an existing ``out`` (empty, or --force) is moved
    aside into ``work`` first and removed with it."""
    if out.exists():
        out.rename(work / f"replaced-{uuid.uuid4().hex}")
    built.rename(out)


# -- verification ---------------------------------------------------------------------------

def verify_export(export_dir: Path, hf_dir: Path, precision: str, target: str) -> dict:
    """Greedy tokens of the export vs our PyTorch engine (float32) on VERIFY_PROMPTS.

    Per prompt: the index of the first differing token (None: all equal), the share of the
    VERIFY_TOKENS positions equal before it, and the share of positions whose argmax equals the
    engine's next token when both read the engine's tokens (teacher-forced). fp32 must match
    exactly (else ExportError)."""
    import onnxruntime_genai as og

    if target == "cuda" and not og.is_cuda_available():
        return {"skipped": True, "reason": "target cuda, but this onnxruntime-genai has no CUDA provider "
                                           "(a CPU build, or no GPU here)"}
    from cascade.chat_template import ChatTemplate
    from cloud_tier.engine import LLMEngine
    from cloud_tier.sampling import SamplingParams

    engine = LLMEngine.from_model(str(hf_dir), dtype="float32", max_model_len=512, num_kv_blocks=64)
    tok = engine.tokenizer
    template = ChatTemplate(tok.chat_template, tok.bos_token or "", tok.eos_token or "")  # as the cloud's chat API
    prompts = [tok.encode(template.render([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in VERIFY_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=VERIFY_TOKENS, ignore_eos=True)
    reference = [o.token_ids for o in engine.generate(prompts, params)]
    del engine
    exported, forced = onnx_decode(export_dir, prompts, reference, target)
    per_prompt = []
    for text, ref, got, matches in zip(VERIFY_PROMPTS, reference, exported, forced, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), None)
        equal = VERIFY_TOKENS if first is None else first
        per_prompt.append({"prompt": text, "first_divergence": first, "agreement": round(equal / VERIFY_TOKENS, 3),
                           "teacher_forced_agreement": round(matches / VERIFY_TOKENS, 3)})
    result = {
        "reference": "cloud_tier.engine float32, greedy",
        "runtime": f"onnxruntime-genai {builder_version()} ({target})",
        "prompts": len(prompts), "tokens": VERIFY_TOKENS,
        "exact": all(p["first_divergence"] is None for p in per_prompt),
        "mean_agreement": round(sum(p["agreement"] for p in per_prompt) / len(per_prompt), 3),
        "mean_teacher_forced_agreement": round(
            sum(p["teacher_forced_agreement"] for p in per_prompt) / len(per_prompt), 3),
        "per_prompt": per_prompt,
    }
    floor = AGREEMENT_FLOOR.get(precision)
    if floor is not None:
        result["floor"] = floor
        result["within_floor"] = result["mean_teacher_forced_agreement"] >= floor
        if not result["within_floor"]:
            log.warning("the %s export agrees with the engine on %.0f%% of teacher-forced positions, below its "
                        "stated floor of %.0f%%", precision, 100 * result["mean_teacher_forced_agreement"],
                        100 * floor)
    if precision == "fp32" and not result["exact"]:
        worst = min(per_prompt, key=lambda p: p["agreement"])
        raise ExportError(f"the fp32 export's greedy tokens differ from the engine's (prompt {worst['prompt']!r} "
                          f"from token {worst['first_divergence']}): not published")
    return result


def onnx_decode(export_dir: Path, prompts: list[list[int]], references: list[list[int]],
                target: str) -> tuple[list[list[int]], list[int]]:
    """(greedy tokens, teacher-forced matches) from onnxruntime-genai, per prompt.

    Greedy: append the prompt, then the argmax of each step's logits, as many tokens as the
    reference has. Teacher-forced: append the reference's tokens instead and count the steps whose
    argmax equals the reference's next token; unlike the greedy run, one early near-tie does not
    decide every later position."""
    import numpy as np
    import onnxruntime_genai as og

    config = og.Config(str(export_dir))
    config.clear_providers()
    if target == "cuda":
        config.append_provider("cuda")
    model = og.Model(config)

    def run(ids: list[int], forced: list[int] | None, n: int) -> list[int]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + n, batch_size=1)
        gen = og.Generator(model, params)
        gen.append_tokens(np.array(ids, dtype=np.int32))
        tokens: list[int] = []
        for i in range(n):
            tokens.append(int(np.argmax(gen.get_logits()[0, -1])))
            if i + 1 < n:
                gen.append_tokens(np.array([forced[i] if forced else tokens[-1]], dtype=np.int32))
        return tokens

    greedy = [run(ids, None, len(ref)) for ids, ref in zip(prompts, references, strict=True)]
    matches = [sum(a == b for a, b in zip(run(ids, ref, len(ref)), ref, strict=True))
               for ids, ref in zip(prompts, references, strict=True)]
    return greedy, matches


def summary(manifest: dict) -> str:
    """One line on the verification, for the CLI."""
    v = manifest["verification"]
    if v.get("skipped"):
        return f"verification skipped: {v['reason']}"
    firsts = ", ".join("-" if p["first_divergence"] is None else str(p["first_divergence"]) for p in v["per_prompt"])
    verdict = "tokens equal the engine's" if v["exact"] else (
        f"greedy agreement {v['mean_agreement']:.0%}, teacher-forced {v['mean_teacher_forced_agreement']:.0%}")
    if v.get("within_floor") is False:
        verdict += f", BELOW the stated floor of {v['floor']:.0%}"
    return (f"verified on {v['prompts']} prompts x {v['tokens']} greedy tokens against the PyTorch engine: "
            f"{verdict} (first divergence per prompt: {firsts})")
