"""Hardware facts, the ONNX Runtime provider choice, and the mixed-install refusal."""

import pytest

from edge_agent import hardware
from edge_agent.hardware import MixedOnnxRuntime, check_onnxruntime_install, choose_providers

X86 = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile avx_vnni

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx avx2
"""
ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes crc32 asimddp sve i8mm bf16 sve2
CPU implementer\t: 0x41
CPU part\t: 0xd4f
"""


def test_cpu_flags_from_x86_cpuinfo_are_the_first_cores_in_a_fixed_order():
    assert hardware.cpu_facts(X86) == {
        "model": "Intel(R) Xeon(R) Platinum 8480+",
        "flags": ["avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile",
                  "amx_bf16"]}


def test_cpu_flags_from_arm_cpuinfo_name_neon_and_sve():
    facts = hardware.cpu_facts(ARM)
    assert facts["flags"] == ["asimd", "asimddp", "i8mm", "bf16", "sve", "sve2"]
    assert facts["model"] == "ARM implementer 0x41 part 0xd4f"


def test_detect_reports_cpu_memory_and_this_venvs_onnxruntime():
    facts = hardware.detect()
    assert facts["cpu"]["cores"] >= 1 and facts["memory"]["total_bytes"] > 0
    ort = facts["onnxruntime"]
    assert len(ort["distributions"]) == 1 and ort["mixed"] is None
    assert "CPUExecutionProvider" in ort["loadable"] and ort["genai_version"]


def test_a_provider_whose_session_falls_back_to_cpu_is_not_loadable():
    import onnxruntime as ort

    # this CPU build does not have CUDA: ORT warns and runs the session on CPU anyway
    assert hardware._probe(ort, "CUDAExecutionProvider") is not None
    assert hardware._probe(ort, "CPUExecutionProvider") is None


def _dist(site, name: str, version: str):
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_the_installed_cpu_build_alone_passes():
    check_onnxruntime_install()


def test_onnxruntime_and_onnxruntime_gpu_together_are_refused_naming_both_and_the_fix(tmp_path, monkeypatch):
    _dist(tmp_path, "onnxruntime-gpu", "1.32.0")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(MixedOnnxRuntime) as e:
        check_onnxruntime_install()
    message = str(e.value)
    assert "\n" not in message
    assert "onnxruntime 1.32.0 and onnxruntime-gpu 1.32.0" in message
    assert "pip uninstall -y onnxruntime onnxruntime-gpu" in message and "--force-reinstall" in message
    assert "its files now are onnxruntime's" in message  # the real folder is the CPU build's


def test_both_genai_builds_together_are_refused(tmp_path, monkeypatch):
    _dist(tmp_path, "onnxruntime-genai-cuda", "0.18.0")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(MixedOnnxRuntime, match="onnxruntime-genai 0.18.0 and onnxruntime-genai-cuda 0.18.0"):
        check_onnxruntime_install()


def test_companion_packages_are_not_a_second_build(tmp_path, monkeypatch):
    _dist(tmp_path, "onnxruntime-extensions", "0.14.0")
    monkeypatch.syspath_prepend(str(tmp_path))
    check_onnxruntime_install()


def facts(available=("CPUExecutionProvider",), loadable=("CPUExecutionProvider",), not_loading=None,
          dists=(("onnxruntime", "1.32.0"),), genai=(("onnxruntime-genai", "0.18.0"),), cuda_version=None):
    """onnxruntime_facts() as a machine would report it."""
    return {"distributions": [{"name": n, "version": v} for n, v in dists],
            "genai_distributions": [{"name": n, "version": v} for n, v in genai], "mixed": None,
            "version": dists[0][1], "package": dists[0][0], "cuda_version": cuda_version,
            "available": list(available), "loadable": list(loadable), "not_loading": dict(not_loading or {}),
            "genai_version": genai[0][1], "genai_cuda": any(n == "onnxruntime-genai-cuda" for n, _ in genai),
            "error": None}


CUDA_LOADS = facts(available=("CUDAExecutionProvider", "CPUExecutionProvider"),
                   loadable=("CUDAExecutionProvider", "CPUExecutionProvider"), dists=(("onnxruntime-gpu", "1.31.1"),),
                   genai=(("onnxruntime-genai-cuda", "0.18.0"),), cuda_version="13.0")
# the CUDA extra on a machine without CUDA, as measured (README: ONNX Runtime backend)
CUDA_EXTRA_NO_CUDA = facts(
    available=("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"),
    not_loading={"CUDAExecutionProvider": "libcublasLt.so.13: cannot open shared object file: No such file or "
                                          "directory"},
    dists=(("onnxruntime-gpu", "1.31.1"),), genai=(("onnxruntime-genai-cuda", "0.18.0"),), cuda_version="13.0")
OPENVINO_LOADS = facts(available=("OpenVINOExecutionProvider", "CPUExecutionProvider"),
                       loadable=("OpenVINOExecutionProvider", "CPUExecutionProvider"),
                       dists=(("onnxruntime-openvino", "1.23.0"),))


@pytest.mark.parametrize("requested, machine, providers, reason, warned", [
    ([], facts(), ["cpu"], "auto: only the CPU provider loads here (onnxruntime 1.32.0)", []),
    ([], CUDA_LOADS, ["cuda", "cpu"], "auto: CUDAExecutionProvider loads here", []),
    ([], CUDA_EXTRA_NO_CUDA, ["cpu"], "auto: only the CPU provider loads here (onnxruntime-gpu 1.31.1)",
     ["libcublasLt.so.13"]),
    ([], OPENVINO_LOADS, ["openvino", "cpu"], "auto: OpenVINOExecutionProvider loads here", []),
    (["cuda"], CUDA_LOADS, ["cuda", "cpu"], "cuda requested and loadable", []),
    (["cuda"], facts(), ["cpu"], "cuda requested but onnxruntime-gpu is not installed", ["onnxruntime-gpu"]),
    (["cuda"], CUDA_EXTRA_NO_CUDA, ["cpu"], "cuda requested but CUDAExecutionProvider does not load here "
     "(libcublasLt.so.13", ["needs CUDA 13.0 and cuDNN 9"]),
    (["cuda", "openvino", "cpu"], OPENVINO_LOADS, ["openvino", "cpu"], "falling back to openvino", ["cuda"]),
    (["CPU"], CUDA_LOADS, ["cpu"], "cpu requested", []),
    (["cpu", "cuda"], CUDA_LOADS, ["cpu"], "cpu requested", ["cuda comes after cpu"]),
    (["dml"], facts(available=("DmlExecutionProvider", "CPUExecutionProvider"),
                    loadable=("DmlExecutionProvider", "CPUExecutionProvider"),
                    dists=(("onnxruntime-directml", "1.23"),)),
     ["cpu"], "onnxruntime-genai-directml is not installed", ["dml"]),
])
def test_provider_choice(requested, machine, providers, reason, warned):
    choice = choose_providers(requested, machine)
    assert choice.providers == providers and choice.providers[-1] == "cpu"
    assert reason in choice.reason
    assert len(choice.warnings) == len(warned)
    for warning, fragment in zip(choice.warnings, warned, strict=True):
        assert fragment in warning


def test_a_cuda_build_of_onnxruntime_without_genais_cuda_build_falls_back():
    machine = {**CUDA_LOADS, "genai_distributions": [{"name": "onnxruntime-genai", "version": "0.18.0"}],
               "genai_cuda": False}
    choice = choose_providers(["cuda"], machine)
    assert choice.providers == ["cpu"] and "onnxruntime-genai-cuda is not installed" in choice.reason


@pytest.mark.parametrize("name", ["tensorrt", "gpu", "rocm"])
def test_an_unknown_provider_is_a_configuration_error(name):
    with pytest.raises(ValueError, match=f"unknown ONNX Runtime provider '{name}'"):
        choose_providers(["cuda", name], facts())


def test_without_onnxruntime_only_cpu_is_chosen():
    machine = {**facts(), "error": "onnxruntime is not importable: No module named 'onnxruntime'", "version": None,
               "available": [], "loadable": []}
    assert choose_providers([], machine).providers == ["cpu"]
    choice = choose_providers(["cuda"], machine)
    assert choice.providers == ["cpu"] and "onnxruntime is not importable" in choice.reason


def test_provider_choice_on_this_machine_measures_it():
    if "CUDAExecutionProvider" in hardware.onnxruntime_facts()["available"]:
        pytest.skip("a CUDA build of onnxruntime is installed here")
    choice = choose_providers(["cuda", "cpu"])
    assert choice.providers == ["cpu"] and "onnxruntime-gpu is not installed" in choice.reason
