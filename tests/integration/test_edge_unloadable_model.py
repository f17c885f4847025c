"""`cascade edge run --model FILE` on a GGUF whose header reads but which llama.cpp cannot load (its
tensor data cut short): one line naming the model and llama.cpp's reason, exit 2. It was a 35-line
uvicorn traceback and exit 3 (the attacker's finding 5 on issue 39)."""

from __future__ import annotations

import os
import subprocess

from cascade_cli.spawn import cascade_command
from tests.conftest import REPO


def test_a_gguf_llama_cpp_cannot_load_is_one_line_and_exit_2(tmp_path, smollm2_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as src:
        cut.write_bytes(src.read(60_000_000))  # the header and part of the tensors
    r = subprocess.run(cascade_command("edge", "run", "--no-config", "--port", "0", "--model", str(cut),
                                       log_level="warning"),
                       cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "CASCADE_HOME": str(tmp_path / "home")})
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if "cannot load" in line or "Traceback" in line]
    assert len(errors) == 1 and errors[0].startswith(f"cascade: cannot load model '{cut}': "), r.stderr
