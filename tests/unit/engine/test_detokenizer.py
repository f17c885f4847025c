"""The incremental detokenizer on a real tokenizer: the text it releases token by token is the
whole sequence decoded at once, on the Rust tokenizer's decode and on the HF wrapper's alike."""

import pytest

from cloud_tier.engine.detokenizer import IncrementalDetokenizer
from cloud_tier.engine.model_files import load_tokenizer
from model_distribution.artifacts.model_dirs import resolve_model_dir

TEXT = "Grüße aus Köln 🚀🚀 — naïve café, 東京タワー! <|im_end|> x = [1, 2]\n\tdone."


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_dir("smollm2-135m"))


class _WrapperOnly:  # the HF wrapper's decode alone (no backend to take the fast path)
    clean_up_tokenization_spaces = False

    def __init__(self, tok):
        self.decode = tok.decode


@pytest.mark.parametrize("wrapper", [False, True])
def test_deltas_add_up_to_the_whole_decode(tokenizer, wrapper):
    ids = tokenizer.encode(TEXT, add_special_tokens=False) + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(_WrapperOnly(tokenizer) if wrapper else tokenizer)
    deltas = [detok.add(t) for t in ids]
    tail = detok.finish()
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) + tail == detok.text == whole
    assert all("\ufffd" not in d for d in deltas)  # a split character is held back, never shown broken


def test_a_stop_string_ends_the_text_on_either_path(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    texts = []
    for tok in (tokenizer, _WrapperOnly(tokenizer)):
        detok = IncrementalDetokenizer(tok, stop=("café",))
        for t in ids:
            detok.add(t)
            if detok.stopped:
                break
        texts.append(detok.text + detok.finish())
    assert texts[0] == texts[1] == TEXT.split("café")[0]
