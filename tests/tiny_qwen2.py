"""A tiny random-weight Qwen2 saved as an HF directory (transformers' ``save_pretrained``), for
tests that run the engine's Qwen2 against ``transformers.Qwen2ForCausalLM`` in seconds.

Two layers, hidden 64, 4 query heads on 2 KV heads (GQA), RoPE base 1e6, and q/k/v biases drawn
nonzero (transformers initialises them to zero, where a lost bias would go unseen). Weights are
drawn wider than transformers' default so that greedy choices are not near-ties. The tokenizer
is byte-level without merges: one token per byte of UTF-8, ids 0-255."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 272  # 256 bytes, then <|endoftext|> (256) and <|im_end|> (257), then unused rows
SPECIALS = ("<|endoftext|>", "<|im_end|>")


def qwen2_config(tie: bool):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=tie,
        bos_token_id=256, eos_token_id=257, pad_token_id=256, initializer_range=0.15, dtype="float32",
    )


def make_tiny_qwen2(out_dir: Path, tie: bool, seed: int = 0) -> Path:
    """Write the model (and its tokenizer) into ``out_dir``; returns it."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(qwen2_config(tie)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    _byte_tokenizer().save_pretrained(out_dir)
    return out_dir


def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[1],
                                   pad_token=SPECIALS[0])


def _byte_of(char: str) -> int:
    """The byte GPT-2's byte-level alphabet maps to ``char``."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if ord(char) in printable:
        return ord(char)
    others = [b for b in range(256) if b not in printable]
    return others[ord(char) - 256]


def hf_greedy(model, prompt: list[int], max_tokens: int, eos: int = 257) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens for ``prompt`` and the logits row of each step (float32),
    stopping after ``eos`` as the engine does."""
    ids = list(prompt)
    tokens, logits = [], []
    with torch.inference_mode():
        for _ in range(max_tokens):  # the whole sequence each step: no cache API in the way
            row = model(torch.tensor([ids + tokens])).logits[0, -1].float()
            tokens.append(int(row.argmax()))
            logits.append(row)
            if tokens[-1] == eos:
                break
    return tokens, logits


def engine_greedy(engine, prompts: list[list[int]], max_tokens: int, join_after: int = 2) -> list:
    """The engine's greedy (tokens, [logits per step]) for each prompt: half of them first, the
    rest after ``join_after`` steps (prefill chunks and decodes share steps); the KV cache's
    invariants checked after every step."""
    from cloud_tier.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    index, logits, done = {}, {}, {}
    half, steps = len(prompts) // 2, 0
    execute = engine.runner.execute

    def keeping(batch):
        result = execute(batch)
        for rid, row in (result.logits or {}).items():
            logits.setdefault(index[rid], []).append(row)
        return result

    engine.runner.keep_logits, engine.runner.execute = True, keeping
    try:
        for i, p in enumerate(prompts[:half]):
            index[engine.add_request(p, params)] = i
        while len(done) < len(prompts):
            if steps == join_after:
                for i, p in enumerate(prompts[half:], start=half):
                    index[engine.add_request(p, params)] = i
            for out in engine.step():
                if out.finished:
                    done[index[out.request_id]] = out.token_ids
            engine.check_integrity()
            steps += 1
    finally:
        engine.runner.keep_logits, engine.runner.execute = False, execute
    return [(done[i], logits[i]) for i in range(len(prompts))]
