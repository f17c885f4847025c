"""An ONNX export's vocabulary as bytes per token id, from its tokenizer.json."""

from __future__ import annotations


def token_pieces(tok_json: dict, n_vocab: int) -> list[bytes]:
    """Each token id's bytes, so text split inside a UTF-8 character streams right. Byte-level
    BPE (GPT-2, SmolLM2, Llama 3) spells bytes as printable characters, which we map back;
    SentencePiece-style vocabularies spell a space as U+2581 and raw bytes as <0xNN>. Special
    tokens render as nothing, as on llama.cpp."""
    model = tok_json["model"]
    vocab = model["vocab"]
    items = vocab.items() if isinstance(vocab, dict) else ((tok, i) for i, (tok, _) in enumerate(vocab))
    decoder = tok_json.get("decoder") or {}
    byte_level = decoder.get("type") == "ByteLevel" or any(
        d.get("type") == "ByteLevel" for d in decoder.get("decoders", []))
    pieces = [b""] * n_vocab
    if byte_level:
        to_byte = _gpt2_byte_decoder()
        for tok, i in items:
            if i < n_vocab:
                pieces[i] = bytes(to_byte[c] for c in tok if c in to_byte)
    else:
        for tok, i in items:
            if i < n_vocab:
                if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                    pieces[i] = bytes([int(tok[3:5], 16)])
                else:
                    pieces[i] = tok.replace("\u2581", " ").encode("utf-8")
    for t in tok_json.get("added_tokens", []):
        if t["id"] < n_vocab:
            pieces[t["id"]] = b"" if t.get("special") else t["content"].encode("utf-8")
    return pieces


def _gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: printable bytes stand for themselves, the rest
    are shifted to code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in out.values():
            out[chr(256 + shifted)] = b
            shifted += 1
    return out
