import numpy as np
import pytest
from gguf import GGUFWriter

from model_distribution.artifacts.catalog import QWEN_15B, Catalog, ModelNotFound, served_names
from model_distribution.artifacts.gguf_meta import GGUFError, read_metadata


def write_gguf(path, arch="llama", file_type=3, chat_template=None, vocab=("a", "b", "c")):
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_file_type(file_type)
    w.add_context_length(128)
    w.add_token_list(list(vocab))
    w.add_token_scores([0.0] * len(vocab))
    if chat_template:
        w.add_chat_template(chat_template)
    w.add_tensor("token_embd.weight", np.zeros((len(vocab), 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_header_reader_reads_scalars_and_skips_arrays(tmp_path):
    p = write_gguf(tmp_path / "tiny.gguf", file_type=15, chat_template="{{ x }}", vocab=("x",) * 50)
    meta = read_metadata(p)
    assert meta.architecture == "llama"
    assert meta.quantization == "Q4_K_M"
    assert meta.chat_template == "{{ x }}"
    assert meta.context_length == 128
    assert meta.vocab_size == 50
    assert meta.tensor_count == 1


def test_not_a_gguf_file_is_refused(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(GGUFError, match="magic"):
        read_metadata(bad)
    good = write_gguf(tmp_path / "t.gguf")
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(good.read_bytes()[:40])
    with pytest.raises(GGUFError, match="truncated"):
        read_metadata(truncated)


def test_packaged_models_are_located_not_downloaded(tmp_path):
    models = {m.name: m for m in Catalog(tmp_path).list()}
    smol = models["smollm2-135m"]
    assert smol.ready and smol.path.is_file() and "site-packages" in str(smol.path)
    assert (smol.quantization, smol.architecture, smol.kind) == ("Q4_1", "llama", "instruct")
    assert smol.size_bytes == smol.path.stat().st_size
    gemma = models["gemma3-270m"]
    assert (gemma.quantization, gemma.architecture, gemma.kind) == ("Q4_K_M", "gemma3", "base")
    assert not gemma.ready  # assembled from its chunk packages on first use, under $CASCADE_HOME
    assert gemma.path.parent == tmp_path / "models"
    assert gemma.size_bytes > 200_000_000


def test_models_found_by_name_alias_and_path(tmp_path):
    cat = Catalog(tmp_path)
    assert cat.get("SmolLM2-135M-Instruct").name == "smollm2-135m"
    assert cat.get("smollm2").name == "smollm2-135m"
    own = write_gguf(tmp_path / "elsewhere.gguf")
    info = cat.get(str(own))
    assert info.source == "file" and info.kind == "base" and info.path == own


def test_files_in_home_models_are_listed(tmp_path):
    (tmp_path / "models").mkdir()
    write_gguf(tmp_path / "models" / "My-Tiny.gguf", chat_template="{{ m }}")
    (tmp_path / "models" / "broken.gguf").write_bytes(b"nope")
    cat = Catalog(tmp_path)
    names = [m.name for m in cat.list()]
    assert "my-tiny" in names and "broken" not in names
    assert cat.get("my-tiny").kind == "instruct"


def test_unknown_model_names_what_is_there(tmp_path):
    with pytest.raises(ModelNotFound, match="smollm2-135m"):
        Catalog(tmp_path).get("gpt-17")


def test_the_qwen_tier_pair_is_described_from_its_first_part_before_assembly(tmp_path):
    models = {m.name: m for m in Catalog(tmp_path).list()}
    for name, size in (("qwen2.5-coder-0.5b", 491_400_064), ("qwen2.5-coder-1.5b", 1_117_320_768)):
        info = models[name]
        assert (info.quantization, info.architecture, info.kind) == ("Q4_K_M", "qwen2", "instruct")
        assert info.size_bytes == size
        assert not info.ready and info.path.parent == tmp_path / "models" and not info.path.exists()
    cat = Catalog(tmp_path)
    assert cat.get("qwen-0.5b").name == "qwen2.5-coder-0.5b"
    assert cat.get("Qwen2.5-Coder-1.5B-Instruct-Q4_K_M").name == "qwen2.5-coder-1.5b"
    assert served_names("qwen-1.5b") == ("qwen2.5-coder-1.5b", {*QWEN_15B.aliases, "qwen-1.5b"})
    assert not (tmp_path / "models").exists()  # listing assembles nothing


def test_odd_entries_in_the_models_folder_are_skipped_never_read(tmp_path):
    """A FIFO named *.gguf hung every lookup (its open blocks); a dangling link or a folder named
    *.gguf was a traceback from `models list`, `edge run --model` and `cloud worker --model`."""
    import os
    import threading

    from model_distribution.artifacts.catalog import Catalog, ModelNotFound

    models = tmp_path / "models"
    models.mkdir()
    os.mkfifo(models / "fifo.gguf")
    (models / "dangling.gguf").symlink_to(tmp_path / "nowhere.gguf")
    (models / "folder.gguf").mkdir()
    catalog = Catalog(tmp_path, packaged=())
    result: dict = {}

    def look():
        result["listed"] = catalog.list()
        try:
            catalog.get("nosuch")
        except ModelNotFound as e:
            result["refused"] = str(e)

    worker = threading.Thread(target=look, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():  # unblock the FIFO so the thread can end, then fail
        os.close(os.open(models / "fifo.gguf", os.O_WRONLY | os.O_NONBLOCK))
        raise AssertionError("listing the models folder hung on a FIFO")
    assert result["listed"] == [] and "unknown model 'nosuch'" in result["refused"]
