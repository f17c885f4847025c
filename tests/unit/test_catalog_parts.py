"""Models assembled from part packages (model_distribution/artifacts/parts.py), on fake part packages
built in tmp_path: small files, a module folder per part, put on sys.path."""

import errno
import hashlib
import importlib
import multiprocessing
import os
import shutil
import time
import tracemalloc
import uuid
from pathlib import Path

import pytest

from model_distribution.artifacts import catalog as catalog_mod
from model_distribution.artifacts import parts
from model_distribution.artifacts.catalog import Catalog, ModelNotFound, Packaged
from model_distribution.artifacts.parts import AssemblyError, CorruptPart, MissingParts, PartSpec, numbered_parts

PART = 1 << 20  # each fake part but the last: 1 MiB


class Fake:
    """A fake model shipped as three part packages ``fake-<tag>-part1..3`` (extra ``models-fake``)."""

    def __init__(self, root: Path, monkeypatch):
        from tests.unit.test_catalog import write_gguf  # gguf and numpy: only where the fakes are built

        header = write_gguf(root / "header.gguf", arch="qwen2", file_type=15, chat_template="{{ m }}").read_bytes()
        self.data = header + os.urandom(2 * PART + 12345 - len(header))
        chunks = [self.data[:PART], self.data[PART:2 * PART], self.data[2 * PART:]]
        tag = uuid.uuid4().hex[:8]
        self.parts = numbered_parts(f"fake-{tag}-part", "1.0", [(len(c), hashlib.sha256(c).hexdigest())
                                                                for c in chunks])
        self.pkgs = root / "site"
        for part, chunk in zip(self.parts, chunks, strict=True):
            (self.pkgs / part.module / "data").mkdir(parents=True)
            (self.pkgs / part.module / "__init__.py").write_text("")
            (self.pkgs / part.module / "data" / part.file).write_bytes(chunk)
        monkeypatch.syspath_prepend(str(self.pkgs))
        self.spec = PartSpec("fake-model.gguf", len(self.data), hashlib.sha256(self.data).hexdigest(),
                             "models-fake", self.parts)
        self.packaged = Packaged("fake-model", f"fake-{tag}-part1..3", self.parts[0].module, ("fake",), self.spec)
        self.home = root / "home"
        self.models = self.home / "models"
        self.target = self.models / "fake-model.gguf"

    def catalog(self) -> Catalog:
        return Catalog(self.home, packaged=(self.packaged,))

    def part_file(self, i: int) -> Path:
        return self.pkgs / self.parts[i].module / "data" / self.parts[i].file

    def left_in_models(self) -> list[str]:
        return sorted(p.name for p in self.models.iterdir()) if self.models.is_dir() else []


@pytest.fixture
def fake(tmp_path, monkeypatch):
    return Fake(tmp_path, monkeypatch)


def test_assembles_verified_once_and_lists_ready_false_then_true(fake):
    cat = fake.catalog()
    [before] = cat.list()
    assert (before.name, before.ready, before.path) == ("fake-model", False, fake.target)
    # described from part 01's header before assembly
    assert (before.quantization, before.architecture, before.kind, before.size_bytes) == (
        "Q4_K_M", "qwen2", "instruct", len(fake.data))
    assert cat.get("fake") == before
    assert cat.ensure_ready(before) == fake.target
    assert fake.target.read_bytes() == fake.data
    assert fake.left_in_models() == ["fake-model.gguf"]  # no temp file left
    [after] = cat.list()
    assert after.ready and after.path == fake.target and after.size_bytes == len(fake.data)
    assert (after.quantization, after.architecture) == ("Q4_K_M", "qwen2")
    assert oct(fake.target.stat().st_mode & 0o777) == oct(0o644)


def test_parts_stream_through_a_bounded_chunk(fake, monkeypatch):
    monkeypatch.setattr(parts, "CHUNK", 64 << 10)
    tracemalloc.start()
    try:
        parts.assemble(fake.spec, fake.target, "fake-model")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert fake.target.read_bytes() == fake.data
    assert peak < PART // 2, f"peak {peak} bytes: a part (or the file) was held in memory"


def test_a_missing_part_package_is_named_with_its_extra(fake):
    shutil.rmtree(fake.pkgs / fake.parts[1].module)
    importlib.invalidate_caches()
    cat = fake.catalog()
    assert cat.list() == []
    with pytest.raises(MissingParts, match=rf"{fake.parts[1].dist}==1\.0 .*'cascade-serve\[models-fake\]'") as e:
        cat.get("fake-model")
    assert fake.parts[0].dist not in str(e.value)
    assert isinstance(e.value, ModelNotFound) and fake.left_in_models() == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend"])
def test_a_corrupt_part_is_named_and_nothing_is_left(fake, damage):
    cat = fake.catalog()
    info = cat.get("fake-model")
    last = fake.part_file(2)  # the parts before it were already written when it is found
    data = bytearray(last.read_bytes())
    if damage == "flip":
        data[100] ^= 0x01
    last.write_bytes(bytes(data[:-1] if damage == "truncate" else data + b"x" if damage == "extend" else data))
    with pytest.raises(CorruptPart, match=rf"part03\.bin of package {fake.parts[2].dist} is corrupt"):
        cat.ensure_ready(info)
    assert fake.left_in_models() == []


@pytest.mark.parametrize("failure", [KeyboardInterrupt(), OSError(errno.ENOSPC, "No space left on device")])
def test_an_interrupted_assembly_leaves_nothing(fake, monkeypatch, failure):
    copied = []
    real_copy = parts._copy

    def copy_then_fail(part, *args):
        if copied:
            raise failure
        copied.append(part)
        real_copy(part, *args)

    monkeypatch.setattr(parts, "_copy", copy_then_fail)
    cat = fake.catalog()
    with pytest.raises(AssemblyError if isinstance(failure, OSError) else KeyboardInterrupt) as e:
        cat.ensure_ready(cat.get("fake-model"))
    assert fake.left_in_models() == [] and copied
    if isinstance(failure, OSError):
        assert str(e.value).startswith("no space left on device: assembling 'fake-model'")


def test_a_dead_assemblers_temp_file_is_swept(fake):
    fake.models.mkdir(parents=True)
    child = multiprocessing.get_context("spawn").Process(target=int)
    child.start()
    child.join()  # a pid that is gone
    stale = fake.models / f".fake-model.gguf.{child.pid}.abc123.partial"
    stale.write_bytes(b"half")
    os.utime(stale, (time.time() - 600, time.time() - 600))  # written last ten minutes ago
    fake.catalog().ensure_ready(fake.catalog().get("fake-model"))
    assert fake.left_in_models() == ["fake-model.gguf"]


def test_a_temp_file_still_being_written_is_never_swept_even_when_its_pid_looks_dead(fake):
    """Two containers sharing the models folder see different process ids: the attacker's second
    assembler, in its own PID namespace, removed the first one's live temp file and failed it."""
    fake.models.mkdir(parents=True)
    child = multiprocessing.get_context("spawn").Process(target=int)
    child.start()
    child.join()
    live = fake.models / f".fake-model.gguf.{child.pid}.abc123.partial"
    live.write_bytes(b"being written")  # just now
    fake.catalog().ensure_ready(fake.catalog().get("fake-model"))
    assert live.exists()


def _assemble_after(barrier, spec, target) -> None:
    parts.CHUNK = 16 << 10  # slower: the two copies overlap
    barrier.wait(timeout=30)
    parts.assemble(spec, target, "fake-model")


def test_two_processes_assembling_at_once_leave_one_correct_file(fake):
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_assemble_after, args=(barrier, fake.spec, fake.target)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert hashlib.sha256(fake.target.read_bytes()).hexdigest() == fake.spec.sha256
    assert fake.left_in_models() == ["fake-model.gguf"]


def test_a_target_of_the_wrong_size_is_rebuilt_and_one_of_the_right_size_is_trusted(fake):
    fake.models.mkdir(parents=True)
    fake.target.write_bytes(fake.data[:1000])  # an older, cut-off copy
    cat = fake.catalog()
    info = cat.get("fake-model")
    assert not info.ready
    cat.ensure_ready(info)
    assert fake.target.read_bytes() == fake.data
    damaged = fake.data[:-1000] + bytes(1000)
    fake.target.write_bytes(damaged)  # the right size and a GGUF header: trusted, not re-hashed
    assert cat.get("fake-model").ready
    assert cat.ensure_ready(cat.get("fake-model")).read_bytes() == damaged
    fake.target.write_bytes(bytes(len(fake.data)))  # the right size but no GGUF header: rebuilt
    info = cat.get("fake-model")
    assert not info.ready
    assert cat.ensure_ready(info).read_bytes() == fake.data


def test_cli_assemble_prints_the_path_or_one_line_and_exit_2(fake, monkeypatch, capsys):
    from cascade_cli.main import main

    monkeypatch.setenv("CASCADE_HOME", str(fake.home))
    monkeypatch.setattr(catalog_mod, "PACKAGED", (fake.packaged,))
    assert main(["--log-level", "warning", "models", "assemble", "fake"]) == 0
    assert capsys.readouterr().out.splitlines() == [str(fake.target)]
    fake.target.unlink()
    fake.part_file(0).write_bytes(b"\0" * fake.parts[0].size)
    assert main(["--log-level", "warning", "models", "assemble", "fake-model"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "part01.bin" in err and fake.parts[0].dist in err
    assert fake.left_in_models() == []
    with pytest.raises(SystemExit) as e:
        main(["models", "assemble"])
    assert e.value.code == 2 and capsys.readouterr().err.startswith("cascade: models assemble: ")


def test_an_assembled_model_is_served_from_its_file_once_its_part_packages_are_gone(fake):
    cat = fake.catalog()
    cat.ensure_ready(cat.get("fake-model"))
    shutil.rmtree(fake.pkgs)
    importlib.invalidate_caches()
    [info] = fake.catalog().list()
    assert info.ready and info.path == fake.target and info.quantization == "Q4_K_M"


def test_a_models_folder_that_cannot_be_made_is_one_clear_error(fake):
    fake.home.mkdir()
    fake.models.write_text("a file where the folder should be")
    cat = fake.catalog()
    with pytest.raises(AssemblyError, match=r"^file exists: assembling 'fake-model'"):
        cat.ensure_ready(cat.get("fake-model"))


def test_an_explicit_assemble_hashes_an_assembled_file_again_and_rebuilds_one_damaged_in_place(fake):
    """A file damaged in place keeps its size, so a lookup still trusts it; `cascade models assemble`
    (verify=True) hashes it whole and assembles it again (it printed the path of the damaged file)."""
    cat = fake.catalog()
    cat.ensure_ready(cat.get("fake-model"))
    damaged = bytearray(fake.target.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    fake.target.write_bytes(bytes(damaged))
    info = fake.catalog().get("fake-model")
    assert info.ready  # trusted by size, as every lookup does
    assert fake.catalog().ensure_ready(info, verify=True) == fake.target
    assert fake.target.read_bytes() == fake.data
